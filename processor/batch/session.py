"""One SparkSession builder for every Spark job of ksow.

Why these settings: the Kafka connector is not in the pyspark wheel (it comes from Maven Central via
`spark.jars.packages`, cached in ~/.ivy2); few shuffle partitions because SOW jobs are small per
core and the default 200 makes every stage wait on empty tasks; RocksDB is the state store that
`transformWithState` needs.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import urllib.request
from functools import lru_cache
from pathlib import Path
from typing import Any

DEFAULT_MASTER = os.environ.get("KSOW_SPARK_MASTER", "local[*]")
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


CONNECTOR = "org.apache.spark:spark-sql-kafka-0-10_2.13"
MAVEN_CENTRAL = "https://repo1.maven.org/maven2/org/apache/spark/spark-sql-kafka-0-10_2.13"
log = logging.getLogger("ksow.spark")


def _release(version: str) -> tuple[int, ...] | None:
    parts = version.split(".")
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else None


def _published_versions(timeout: float = 5.0) -> list[str]:
    """Connector releases on Maven Central (empty when it cannot be reached)."""
    try:
        with urllib.request.urlopen(f"{MAVEN_CENTRAL}/maven-metadata.xml", timeout=timeout) as resp:
            text = resp.read().decode()
    except OSError:
        return []
    return re.findall(r"<version>([^<]+)</version>", text)


def _cached_versions() -> list[str]:
    """Connector versions Ivy already holds (so no network is needed to start)."""
    found = set()
    for jars in Path.home().glob(".ivy2*/jars"):
        for jar in jars.glob("org.apache.spark_spark-sql-kafka-0-10_2.13-*.jar"):
            found.add(jar.name.rsplit("-", 1)[1].removesuffix(".jar"))
    return sorted(found)


@lru_cache(maxsize=1)
def kafka_package() -> str:
    """Maven coordinates of the Kafka connector for the installed Spark.

    The connector of the exact Spark version when Ivy has it or Maven Central lists it; otherwise
    the newest published release of the same major version below it (pyspark 4.3.0 reached PyPI
    before its connector reached Maven Central; 4.2.0's reads and writes Kafka the same way).
    $KSOW_SPARK_KAFKA_PACKAGE overrides the choice (e.g. for an offline mirror).
    """
    override = os.environ.get("KSOW_SPARK_KAFKA_PACKAGE")
    if override:
        return override
    import pyspark

    version = pyspark.__version__
    cached = _cached_versions()
    if version in cached:
        return f"{CONNECTOR}:{version}"
    published = _published_versions()
    if not published or version in published:
        return f"{CONNECTOR}:{version}"
    mine = _release(version)
    older = [v for v in published + cached if (r := _release(v)) and mine and r[0] == mine[0] and r < mine]
    if not older:
        return f"{CONNECTOR}:{version}"
    chosen = max(older, key=_release)
    log.warning("Kafka connector %s:%s is not on Maven Central; using %s", CONNECTOR, version, chosen)
    return f"{CONNECTOR}:{chosen}"


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
        # A Python worker (e.g. the one that initializes a transformWithState processor) may take
        # longer than the default 15 s to start and connect back on a loaded machine.
        "spark.python.authenticate.socketTimeout": "120s",
        "spark.kafka.consumer.cache.capacity": "256",
        # collect_list per key group: stay hash-based (the default switches to sorting at 128 keys)
        "spark.sql.objectHashAggregate.sortBased.fallbackThreshold": "10000000",
    }
    # Python workers run this interpreter (with pandas, pyarrow and ksow), not whatever `python3` is.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    options.update({k: str(v) for k, v in (conf or {}).items()})
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in options.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("KSOW_SPARK_LOG_LEVEL", "WARN"))
    return spark
