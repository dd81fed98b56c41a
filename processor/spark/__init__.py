"""ksow on Apache Spark: point-in-time snapshots, replays and SQL over SOW topics.

Only this package and `processor.runner.spark_stream` import pyspark, and only inside functions, so
the Faust worker, the client and the rest of the CLI start without a JVM (pyspark is the optional
`spark` extra). The pure pieces (`history`: the reference fold over the core) need no Spark at all.
"""
