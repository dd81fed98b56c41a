"""The pure semantic core: no Kafka, Faust, RocksDB or Spark imports may appear in this package."""
