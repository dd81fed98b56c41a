"""`ksow sql`: Spark SQL over the current SOW of the topics a query names.

Each SOW topic of the topology that the query mentions becomes a temporary view named like the
topic with dots as underscores (`orders` -> orders, `eu.orders` -> eu_orders). A view is the
latest record per SowKey of `<topic>.sow` (the compacted changelog the workers write; the
highest offset wins; tombstones, and records past their instant that no worker has removed yet,
leave), with the records' fields as columns: Spark infers the schema from the JSON values (nested
objects become structs), plus `_sow_key` and `_expires_at`.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

from processor.batch.snapshot import live_expr
from processor.contract import headers as H
from processor.topology import MessageType, SowTopic, Topology

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def view_name(spec: SowTopic) -> str:
    return spec.topic.replace(".", "_").replace("-", "_")


def named_topics(topology: Topology, query: str) -> list[SowTopic]:
    """The SOW topics whose view name appears in the query as a word (case-insensitive)."""
    return [s for s in topology.sow if re.search(rf"(?<![\w.]){re.escape(view_name(s))}(?![\w])", query, re.IGNORECASE)]


def current_sow(spark: SparkSession, bootstrap: str, spec: SowTopic) -> DataFrame:
    """The SOW as `<topic>.sow` holds it now: one row per SowKey, fields as columns."""
    from pyspark.sql import functions as F

    from processor.kafka.config import spark_kafka_options

    if spec.message_type is not MessageType.JSON:
        raise ValueError(f"{spec.topic}: ksow sql reads JSON topics (message_type {spec.message_type.value})")
    raw = (
        spark.read.format("kafka")
        .options(**spark_kafka_options(bootstrap))
        .option("subscribe", spec.sow_topic)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .option("includeHeaders", "true")
        .option("failOnDataLoss", "false")
        .load()
        .where(F.col("key").isNotNull())
    )
    expires = F.expr(f"try_element_at(filter(headers, h -> h.key = '{H.EXPIRES_AT}'), -1).value").cast("string").cast("long")
    latest = raw.groupBy("key").agg(F.max_by(F.struct(F.col("value").cast("string").alias("json"), expires.alias("expires_at")), F.struct("offset", "partition")).alias("last"))
    now = time.time_ns() // 1_000_000
    current = latest.where(F.col("last.json").isNotNull() & live_expr(spec, F.col("last.expires_at"), now)).select(
        F.col("key").cast("string").alias("_sow_key"), F.col("last.expires_at").alias("_expires_at"), F.col("last.json").alias("json")
    ).cache()
    if current.isEmpty():
        return current.select("_sow_key", "_expires_at")
    schema = spark.read.json(current.select("json")).schema  # inferred over every record
    return current.select("_sow_key", "_expires_at", F.from_json("json", schema).alias("r")).select("r.*", "_sow_key", "_expires_at")


def run_sql(spark: SparkSession, bootstrap: str, topology: Topology, query: str) -> DataFrame:
    """Register a view per SOW topic the query names, then run it."""
    topics = named_topics(topology, query)
    if not topics:
        names = ", ".join(view_name(s) for s in topology.sow)
        raise ValueError(f"the query names no SOW topic of the topology (views: {names})")
    for spec in topics:
        current_sow(spark, bootstrap, spec).createOrReplaceTempView(view_name(spec))
    return spark.sql(query)
