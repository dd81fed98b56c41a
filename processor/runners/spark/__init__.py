"""The SOW kept by Spark Structured Streaming (`ksow up --engine spark`). pyspark is imported only
inside functions: the rest of ksow starts without a JVM."""
