"""`ksow up --engine spark`: the SOW maintained by Spark Structured Streaming.

One streaming query per SOW topic: read `<topic>` and `<topic>.delta`, route each input to the SOW
partition(s) it concerns (a Python UDF over the core's parse_command), then `transformWithState`
grouped by SOW partition, with RocksDB state and processing-time timers for expiry. A group holds
its partition's records in a MapState, as a Faust worker's store holds them, and the
StatefulProcessor applies that partition's inputs in history order with the core (apply_write /
removal / render). So it writes the same `.sow`, `.diff`, `EXP.<topic>` / `.dead` and `.errors`
records as the Faust worker, straight to Kafka; tests/integration/test_conformance.py holds both
engines to the same output streams.

Routing: a publish, delta or delete by data goes to the partition that owns its SowKey
(`murmur2(SowKey) mod partitions`, as everywhere); a delete by SowKeys to the owners of those keys;
a delete by filter to every partition, where it tests the records of that moment, the ones written
earlier in the same micro-batch included.

Differences from the Faust worker, by design of the engine:
- Spark shuffles inputs to their partition group itself, so `<topic>.repartition` is not used.
- Delivery is at least once (Spark's Kafka sink): after a crash a micro-batch may be written twice
  (same records, so the compacted `.sow` is unaffected; `.diff` may repeat events).
- Expiry runs on processing-time timers, so at most one trigger interval late; and every trigger
  runs a micro-batch even with no input (Spark does so for processing-time timers).
- Capacity limits (`capacity`, `capacity_policy`) are not enforced by this engine, views are not
  maintained, and the state lives in the checkpoint whatever the topic's `persistence`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterator

from processor.contract.types import Command, InputError, Op, SowCommand, SowRecord
from processor.core.codec import codec_for
from processor.contract import headers as H
from processor.core.commands import header_map, parse_command
from processor.core.expiry import is_due
from processor.core.filters import FilterError, compile_filter
from processor.core.keys import owner_partition
from processor.core.sow import Transition, apply_write, removal, render
from processor.engine.topic import SEQ_PARTITION_BITS, InputMessage
from processor.topology import SowTopic, Topology

log = logging.getLogger("ksow.spark")

ERRORS_GROUP = "!errors"  # grouping key of rejected inputs (the others are partition numbers)
KEY_SCHEMA = "sow_key string"
RECORD_SCHEMA = "data binary, seq long, expires_at long, updated_at long"  # data: the codec's bytes (JSON or Avro)
DUE_KEY_SCHEMA = "at long"
DUE_SCHEMA = "keys string"  # the SowKeys due at that instant, comma-separated (no SowKey has a comma)
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
    """Which SOW partition(s) an input concerns (a delete by SowKeys or by filter may concern
    several), or the error group with the reason the worker would give."""

    def __init__(self, spec: SowTopic, base: Path | None = None):
        self.spec = spec
        self.base = base
        self.defaults = {spec.topic: Command.PUBLISH, spec.delta_topic: Command.DELTA_PUBLISH}

    def __call__(self, topic: str, value, headers) -> list[tuple[str, str | None]]:
        codec = codec_for(self.spec.message_type.value, self.spec.schema_, self.base)
        try:
            cmd = parse_command(self.spec.key_spec, codec, self.defaults[topic], None if value is None else bytes(value), header_map(_headers(headers)))
        except (InputError, FilterError) as exc:
            return [(ERRORS_GROUP, str(exc))]
        n = self.spec.partitions
        if cmd.sow_key is not None:
            return [(str(owner_partition(cmd.sow_key, n)), None)]
        if cmd.keys:
            return [(str(p), None) for p in sorted({owner_partition(k, n) for k in cmd.keys})]
        return [(str(p), None) for p in range(n)]


def make_processor(spec: SowTopic, base: Path | None = None):
    """The StatefulProcessor class for one SOW topic (built lazily: pyspark is optional). `base`
    is the folder a relative Avro schema path is relative to (as for the Faust worker)."""
    from pyspark.sql import Row
    from pyspark.sql.streaming import StatefulProcessor

    codec = codec_for(spec.message_type.value, spec.schema_, base)
    policy = spec.expiry
    key_paths = spec.key_spec.split
    defaults = {spec.topic: Command.PUBLISH, spec.delta_topic: Command.DELTA_PUBLISH}
    streams = {"sow": spec.sow_topic, "diff": spec.diff_topic, "expired": spec.expired_topic, "dead": spec.dead_topic}

    def out_rows(t: Transition) -> Iterator[Any]:
        for event in render(t, codec, spec.expired_topic is not None):
            yield Row(topic=streams[event.stream], key=event.key, value=event.value, headers=[Row(key=k, value=v) for k, v in event.headers])

    class Processor(StatefulProcessor):
        """One SOW partition: its records, an index of their expiry instants, its event counter."""

        def init(self, handle) -> None:
            self.handle = handle
            self.records = handle.getMapState("records", KEY_SCHEMA, RECORD_SCHEMA)
            self.due = handle.getMapState("due", DUE_KEY_SCHEMA, DUE_SCHEMA)
            self.counter = handle.getValueState("counter", COUNTER_SCHEMA)

        # state -----------------------------------------------------------------------------
        def _get(self, key: str) -> SowRecord | None:
            row = self.records.getValue((key,))
            if row is None:
                return None
            data, seq, expires_at, updated_at = row
            return SowRecord(codec.decode(bytes(data)), seq, expires_at, updated_at)

        def _put(self, key: str, after: SowRecord | None) -> None:
            if after is None:
                self.records.removeKey((key,))  # a due entry left behind is skipped when it fires
                return
            self.records.updateValue((key,), (codec.encode(after.data), after.seq, after.expires_at, after.updated_at))
            if policy.active and after.expires_at is not None:
                at = after.expires_at
                entry = self.due.getValue((at,))
                keys = entry[0].split(",") if entry else []
                if key not in keys:
                    self.due.updateValue((at,), (",".join([*keys, key]),))
                if not entry:
                    self.handle.registerTimer(at)

        def _seq(self, p: int, now: int) -> int:
            """As the worker's: a clock-floored counter per partition << 10 | partition."""
            last = self.counter.get()[0] if self.counter.exists() else 0
            counter = max(last + 1, now * 1000)
            self.counter.update((counter,))
            return (counter << SEQ_PARTITION_BITS) | p

        # inputs ----------------------------------------------------------------------------
        def handleInputRows(self, key, rows, timerValues) -> Iterator[Any]:
            (gkey,) = key
            now = timerValues.getCurrentProcessingTimeInMs()
            ordered = sorted(rows, key=lambda r: (r["ts"], r["rank"], r["partition"], r["offset"]))
            if gkey == ERRORS_GROUP:
                for row in ordered:
                    yield self._error(row)
                return
            p = int(gkey)
            for row in ordered:
                yield from self._apply(p, message(row), now)

        def _apply(self, p: int, msg: InputMessage, now: int) -> Iterator[Any]:
            cmd = parse_command(spec.key_spec, codec, defaults[msg.topic], msg.value, header_map(msg.headers))
            if cmd.command is Command.SOW_DELETE:
                yield from self._delete(p, cmd, now)
                return
            key = cmd.sow_key
            assert key is not None
            before = self._get(key)
            if before is not None and policy.active and is_due(before.expires_at, now):
                self._put(key, None)
                yield from out_rows(removal(Op.EXPIRE, key, before, now, self._seq(p, now)))
                before = None
            t = apply_write(key, before, cmd, policy, key_paths, msg.timestamp or now, self._seq(p, now))
            self._put(key, t.after)
            yield from out_rows(t)

        def _delete(self, p: int, cmd: SowCommand, now: int) -> Iterator[Any]:
            n = spec.partitions
            if cmd.sow_key is not None:
                keys: list[str] = [cmd.sow_key]
            elif cmd.keys:
                keys = [k for k in cmd.keys if owner_partition(k, n) == p]
            else:
                predicate = compile_filter(cmd.filter or "1=1")
                keys = [k for (k,), (data, *_) in self.records.iterator() if predicate.matches(codec.decode(bytes(data)))]
            for key in keys:
                before = self._get(key)
                if before is None:
                    continue
                # A record whose instant has passed was gone before the delete came: it expires.
                op = Op.EXPIRE if policy.active and is_due(before.expires_at, now) else Op.DELETE
                self._put(key, None)
                yield from out_rows(removal(op, key, before, now, self._seq(p, now)))

        def _error(self, row) -> Any:
            headers = [Row(key=k, value=v) for k, v in _headers(row["headers"])]
            headers += [
                Row(key=H.ERROR, value=row["reason"].encode()),
                Row(key=H.ERROR_TOPIC, value=row["topic"].encode()),
                Row(key=H.ERROR_PARTITION, value=str(row["partition"]).encode()),
                Row(key=H.ERROR_OFFSET, value=str(row["offset"]).encode()),
            ]
            return Row(topic=spec.errors_topic, key=row["kafka_key"], value=row["value"], headers=headers)

        # expiry ----------------------------------------------------------------------------
        def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[Any]:
            (gkey,) = key
            p = int(gkey)
            at = expiredTimerInfo.getExpiryTimeInMs()
            entry = self.due.getValue((at,))
            self.due.removeKey((at,))
            now = max(at, timerValues.getCurrentProcessingTimeInMs())
            for k in entry[0].split(",") if entry else ():
                record = self._get(k)
                if record is None or record.expires_at != at:
                    continue  # updated or deleted since
                self._put(k, None)
                yield from out_rows(removal(Op.EXPIRE, k, record, now, self._seq(p, now)))

        def close(self) -> None:
            pass

    return Processor


def build_query(spark, bootstrap: str, spec: SowTopic, checkpoint_dir: str | Path, trigger: str = "1 second", starting_offsets: str = "earliest", base: Path | None = None):
    """Start the streaming query that maintains one SOW topic; returns the StreamingQuery."""
    from pyspark.sql import functions as F

    from processor.batch.snapshot import history_columns

    route = F.udf(Router(spec, base), ROUTE_SCHEMA, useArrow=True)
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
        *history_columns(spec),
        F.col("key").alias("kafka_key"),
        "value",
        "headers",
        F.explode(route("topic", "value", "headers")).alias("route"),
    ).select("*", "route.gkey", "route.reason").drop("route")
    outputs = inputs.groupBy("gkey").transformWithState(
        statefulProcessor=make_processor(spec, base)(),
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
    topology_dir: Path | None = None,
):
    """Maintain every SOW topic of the topology with Spark until stopped (Ctrl-C).

    The checkpoint directory holds the input offsets and the RocksDB state of each topic: restart
    with the same directory to carry on where it stopped. With `block=False`, returns the
    (SparkSession, queries) for the caller to watch and stop.
    """
    from confluent_kafka.admin import AdminClient

    from processor.kafka.clients import ensure_topics, topic_configs
    from processor.batch.session import get_spark

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for spec in topology.sow:
        ensure_topics(admin, topic_configs(spec))
    spark = get_spark(master, "ksow-stream", conf)
    queries = [build_query(spark, bootstrap, spec, checkpoint_dir, trigger, base=topology_dir) for spec in topology.sow]
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
