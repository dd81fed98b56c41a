"""One SparkSession builder for every Spark job of ksow.

Why these settings: the Kafka connector is not in the pyspark wheel (it comes from Maven Central via
`spark.jars.packages`, cached in ~/.ivy2); few shuffle partitions because SOW jobs are small per
core and the default 200 makes every stage wait on empty tasks; RocksDB is the state store that
`transformWithState` needs.
"""

from __future__ import annotations

import os
from typing import Any

DEFAULT_MASTER = os.environ.get("KSOW_SPARK_MASTER", "local[*]")
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


def kafka_package(spark_version: str | None = None) -> str:
    """Maven coordinates of the Kafka connector matching the installed Spark."""
    if spark_version is None:
        import pyspark

        spark_version = pyspark.__version__
    return f"org.apache.spark:spark-sql-kafka-0-10_2.13:{spark_version}"


def _default_parallelism(master: str) -> int:
    """Shuffle partitions = cores of a local master (local[4] -> 4, local[*] -> this machine's)."""
    if master.startswith("local"):
        inside = master[master.find("[") + 1 : master.find("]")] if "[" in master else "1"
        inside = inside.split(",")[0]
        return os.cpu_count() or 2 if inside == "*" else max(1, int(inside))
    return 8


def get_spark(master: str | None = None, app_name: str = "ksow", conf: dict[str, Any] | None = None):
    """A SparkSession with the Kafka connector, few shuffle partitions and WARN logs.

    `conf` overrides anything (e.g. spark.driver.memory, or spark.sql.shuffle.partitions for a
    cluster). An existing active session is reused by Spark, with the runtime options applied.
    """
    from pyspark.sql import SparkSession

    master = master or DEFAULT_MASTER
    options: dict[str, Any] = {
        "spark.jars.packages": kafka_package(),
        "spark.sql.shuffle.partitions": str(_default_parallelism(master)),
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.memory": os.environ.get("KSOW_SPARK_DRIVER_MEMORY", "2g"),
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
        "spark.sql.variant.allowDuplicateKeys": "true",  # as orjson: the last duplicate wins
    }
    options.update({k: str(v) for k, v in (conf or {}).items()})
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in options.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("KSOW_SPARK_LOG_LEVEL", "WARN"))
    return spark
