"""`ksow up --engine spark`: the SOW maintained by Spark Structured Streaming.

One streaming query per SOW topic: read `<topic>` and `<topic>.delta`, route each input to the
SowKey it concerns (a Python UDF over the core's parse_command), then `transformWithState` per
SowKey with RocksDB state and processing-time timers for expiry. The StatefulProcessor applies
inputs with the core (apply_write / removal / render), so it writes the same `.sow`, `.diff`,
`EXP.<topic>` / `.dead` and `.errors` records as the Faust worker, straight to Kafka.

Differences from the Faust worker, by design of the engine:
- Spark groups by SowKey itself, so `<topic>.repartition` is not used.
- A delete by filter is fanned out to the keys `<topic>.sow` holds when it is routed; each key then
  tests the filter against its own state. A record created in the same micro-batch is missed.
- Delivery is at least once (Spark's Kafka sink): after a crash a micro-batch may be written twice
  (same records, so the compacted `.sow` is unaffected; `.diff` may repeat events).
- sow-seq: increasing per key, built like the worker's (clock-floored counter << 10 | owner
  partition), but the counter is per key, so two keys may share a value.
- Capacity limits are not enforced (neither does the Faust worker yet).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterator

from ..api.types import Command, InputError, Op, SowRecord
from ..core.codec import codec_for
from ..core.commands import H_ERROR, header_map, parse_command
from ..core.expiry import is_due
from ..core.filters import FilterError, compile_filter
from ..core.keys import owner_partition
from ..core.sow import Transition, apply_write, removal, render
from ..runner.topic_processor import SEQ_PARTITION_BITS, InputMessage
from ..topology import SowTopic, Topology

log = logging.getLogger("ksow.spark")

ERRORS_GROUP = "!errors"  # grouping key of rejected inputs ('!' is not a SowKey character)
RECORD_SCHEMA = "data string, seq long, expires_at long, updated_at long"
COUNTER_SCHEMA = "counter long"
OUTPUT_SCHEMA = "topic string, key binary, value binary, headers array<struct<key: string, value: binary>>"
ROUTE_SCHEMA = "array<struct<gkey: string, reason: string>>"


def _headers(raw) -> list[tuple[str, bytes | None]]:
    return [(h["key"], None if h["value"] is None else bytes(h["value"])) for h in raw or ()]


def message(row) -> InputMessage:
    """An input row of the stream as the core's InputMessage."""
    value = None if row["value"] is None else bytes(row["value"])
    key = None if row["kafka_key"] is None else bytes(row["kafka_key"])
    return InputMessage(row["topic"], row["partition"], row["offset"], key, value, _headers(row["headers"]), row["ts"])


class Router:
    """Which SowKey(s) an input concerns (a delete by SowKeys or by filter concerns several), or
    the error group with the reason the worker would give."""

    def __init__(self, spec: SowTopic, bootstrap: str):
        self.spec = spec
        self.bootstrap = bootstrap
        self.defaults = {spec.topic: Command.PUBLISH, spec.delta_topic: Command.DELTA_PUBLISH}

    def __call__(self, topic: str, value, headers) -> list[tuple[str, str | None]]:
        codec = codec_for(self.spec.message_type.value, self.spec.schema_)
        try:
            cmd = parse_command(self.spec.key_spec, codec, self.defaults[topic], None if value is None else bytes(value), header_map(_headers(headers)))
            if cmd.filter is not None:
                compile_filter(cmd.filter)
        except (InputError, FilterError) as exc:
            return [(ERRORS_GROUP, str(exc))]
        if cmd.sow_key is not None:
            return [(cmd.sow_key, None)]
        if cmd.keys:
            return [(k, None) for k in cmd.keys]
        return [(k, None) for k in self.live_keys()]

    def live_keys(self) -> list[str]:
        """SowKeys `<topic>.sow` holds now: the records a delete by filter may concern."""
        from ..client import Client

        client = Client(self.bootstrap, Topology(sow=[self.spec]))
        return [entry.sow_key for entry in client.query(self.spec.topic)]


def make_processor(spec: SowTopic):
    """The StatefulProcessor class for one SOW topic (built lazily: pyspark is optional)."""
    from pyspark.sql import Row
    from pyspark.sql.streaming import StatefulProcessor

    codec = codec_for(spec.message_type.value, spec.schema_)
    policy = spec.expiry
    key_paths = spec.key_spec.split
    defaults = {spec.topic: Command.PUBLISH, spec.delta_topic: Command.DELTA_PUBLISH}
    streams = {"sow": spec.sow_topic, "diff": spec.diff_topic, "expired": spec.expired_topic, "dead": spec.dead_topic}

    def out_rows(t: Transition) -> Iterator[Any]:
        for event in render(t, codec, spec.expired_topic is not None):
            yield Row(topic=streams[event.stream], key=event.key, value=event.value, headers=[Row(key=k, value=v) for k, v in event.headers])

    class Processor(StatefulProcessor):
        """One SowKey's record: the core applies each input; timers expire it."""

        def init(self, handle) -> None:
            self.handle = handle
            self.record = handle.getValueState("record", RECORD_SCHEMA)
            self.counter = handle.getValueState("counter", COUNTER_SCHEMA)

        # state -----------------------------------------------------------------------------
        def _get(self) -> SowRecord | None:
            if not self.record.exists():
                return None
            data, seq, expires_at, updated_at = self.record.get()
            return SowRecord(codec.decode(data.encode()), seq, expires_at, updated_at)

        def _put(self, before: SowRecord | None, after: SowRecord | None) -> None:
            if before is not None and before.expires_at is not None:
                self.handle.deleteTimer(before.expires_at)
            if after is None:
                self.record.clear()
                return
            self.record.update((codec.encode(after.data).decode(), after.seq, after.expires_at, after.updated_at))
            if policy.active and after.expires_at is not None:
                self.handle.registerTimer(after.expires_at)

        def _seq(self, key: str, now: int) -> int:
            last = self.counter.get()[0] if self.counter.exists() else 0
            counter = max(last + 1, now * 1000)
            self.counter.update((counter,))
            return (counter << SEQ_PARTITION_BITS) | owner_partition(key, spec.partitions)

        # inputs ----------------------------------------------------------------------------
        def handleInputRows(self, key, rows, timerValues) -> Iterator[Any]:
            (gkey,) = key
            now = timerValues.getCurrentProcessingTimeInMs()
            ordered = sorted(rows, key=lambda r: (r["ts"], r["rank"], r["partition"], r["offset"]))
            if gkey == ERRORS_GROUP:
                for row in ordered:
                    yield self._error(row)
                return
            for row in ordered:
                yield from self._apply(gkey, message(row), now)

        def _apply(self, key: str, msg: InputMessage, now: int) -> Iterator[Any]:
            cmd = parse_command(spec.key_spec, codec, defaults[msg.topic], msg.value, header_map(msg.headers))
            before = self._get()
            if before is not None and policy.active and is_due(before.expires_at, now):
                self._put(before, None)
                yield from out_rows(removal(Op.EXPIRE, key, before, now, self._seq(key, now)))
                before = None
            if cmd.command is Command.SOW_DELETE:
                if before is None:
                    return
                if cmd.filter is not None and not compile_filter(cmd.filter).matches(before.data):
                    return
                if cmd.keys and key not in cmd.keys:
                    return
                self._put(before, None)
                yield from out_rows(removal(Op.DELETE, key, before, now, self._seq(key, now)))
                return
            t = apply_write(key, before, cmd, policy, key_paths, msg.timestamp or now, self._seq(key, now))
            self._put(before, t.after)
            yield from out_rows(t)

        def _error(self, row) -> Any:
            headers = [Row(key=k, value=v) for k, v in _headers(row["headers"])]
            headers += [
                Row(key=H_ERROR, value=row["reason"].encode()),
                Row(key="sow-error-topic", value=row["topic"].encode()),
                Row(key="sow-error-partition", value=str(row["partition"]).encode()),
                Row(key="sow-error-offset", value=str(row["offset"]).encode()),
            ]
            return Row(topic=spec.errors_topic, key=row["kafka_key"], value=row["value"], headers=headers)

        # expiry ----------------------------------------------------------------------------
        def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[Any]:
            (gkey,) = key
            record = self._get()
            at = expiredTimerInfo.getExpiryTimeInMs()
            if record is None or record.expires_at != at:
                return  # updated or deleted since the timer was set
            now = max(at, timerValues.getCurrentProcessingTimeInMs())
            self.record.clear()
            yield from out_rows(removal(Op.EXPIRE, gkey, record, now, self._seq(gkey, now)))

        def close(self) -> None:
            pass

    return Processor


def build_query(spark, bootstrap: str, spec: SowTopic, checkpoint_dir: str | Path, trigger: str = "1 second", starting_offsets: str = "earliest"):
    """Start the streaming query that maintains one SOW topic; returns the StreamingQuery."""
    from pyspark.sql import functions as F

    route = F.udf(Router(spec, bootstrap), ROUTE_SCHEMA, useArrow=True)
    raw = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", f"{spec.topic},{spec.delta_topic}")
        .option("includeHeaders", "true")
        .option("startingOffsets", starting_offsets)
        .option("failOnDataLoss", "false")
        .load()
    )
    inputs = raw.select(
        F.unix_millis("timestamp").alias("ts"),
        (F.col("topic") == spec.delta_topic).cast("int").alias("rank"),
        "partition",
        "offset",
        "topic",
        F.col("key").alias("kafka_key"),
        "value",
        "headers",
        F.explode(route("topic", "value", "headers")).alias("route"),
    ).select("*", "route.gkey", "route.reason").drop("route")
    outputs = inputs.groupBy("gkey").transformWithState(
        statefulProcessor=make_processor(spec)(),
        outputStructType=OUTPUT_SCHEMA,
        outputMode="Update",
        timeMode="ProcessingTime",
    )
    return (
        outputs.writeStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("checkpointLocation", str(Path(checkpoint_dir) / spec.topic))
        .option("kafka.linger.ms", "20")
        .option("kafka.compression.type", "lz4")
        .queryName(f"ksow-{spec.topic}")
        .trigger(processingTime=trigger)
        .outputMode("update")
        .start()
    )


def run_stream(
    bootstrap: str,
    topology: Topology,
    checkpoint_dir: str | Path,
    master: str | None = None,
    trigger: str = "1 second",
    block: bool = True,
    conf: dict[str, str] | None = None,
):
    """Maintain every SOW topic of the topology with Spark until stopped (Ctrl-C).

    The checkpoint directory holds the input offsets and the RocksDB state of each topic: restart
    with the same directory to carry on where it stopped. With `block=False`, returns the
    (SparkSession, queries) for the caller to watch and stop.
    """
    from confluent_kafka.admin import AdminClient

    from ..kafka import ensure_topics, topic_configs
    from ..spark.session import get_spark

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for spec in topology.sow:
        ensure_topics(admin, topic_configs(spec))
    spark = get_spark(master, "ksow-stream", conf)
    queries = [build_query(spark, bootstrap, spec, checkpoint_dir, trigger) for spec in topology.sow]
    log.info("spark streaming: %d SOW topics, checkpoints in %s", len(queries), checkpoint_dir)
    if not block:
        return spark, queries
    wait_for(queries)
    return spark, queries


class StreamError(RuntimeError):
    """A streaming query stopped with an error."""


def wait_for(queries) -> None:
    """Block until a query stops (its error raised as StreamError) or Ctrl-C; then stop them all."""
    try:
        while all(q.isActive for q in queries):
            time.sleep(1.0)
        for q in queries:
            if q.exception() is not None:
                first = str(q.exception()).strip().splitlines() or ["(no message)"]
                raise StreamError(f"streaming query {q.name} failed: {first[0]}")
    except KeyboardInterrupt:
        pass
    finally:
        for q in queries:
            try:
                q.stop()
            except Exception:  # noqa: BLE001 - stopping is best effort when the JVM is going away
                log.debug("could not stop %s", q.name, exc_info=True)
