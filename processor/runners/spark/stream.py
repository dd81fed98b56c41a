"""`ksow up --engine spark`: the SOW maintained by Spark Structured Streaming.

One streaming query per SOW topic: read `<topic>` and `<topic>.delta`, route each input to the SOW
partition(s) it concerns (a Python UDF over the engine's parser), then `transformWithState`
grouped by SOW partition, with RocksDB state and processing-time timers for expiry. A group holds
its partition's records in a MapState (`SparkState`, the engine's PartitionState), and the
StatefulProcessor applies that partition's inputs in history order with the same partition engine
as the Faust worker (processor.engine.partition). So it writes the same `.sow`, `.diff`,
`EXP.<topic>` / `.dead`, `.errors` and view records, straight to Kafka.

Routing: a publish, delta or delete by data goes to the partition that owns its SowKey
(`murmur2(SowKey) mod partitions`, as everywhere); a delete by SowKeys to the owners of those keys;
a delete by filter to every partition, where it tests the records of that moment, the ones written
earlier in the same micro-batch included.

Differences from the Faust worker, by design of the engine:
- Spark shuffles inputs to their partition group itself, so `<topic>.repartition` is not used.
- Delivery is at least once (Spark's Kafka sink): a micro-batch writes to Kafka before Spark
  commits it, and Spark's stop() interrupts one under way, so after a crash (or a stop that could
  not wait for the micro-batch under way: `stop_queries` waits up to STOP_WAIT_S) a micro-batch may be
  written twice (same records, so the compacted `.sow` is unaffected; `.diff` may repeat events).
- Expiry runs on processing-time timers, so at most one trigger interval late; and every trigger
  runs a micro-batch even with no input (Spark does so for processing-time timers).
- The state lives in the checkpoint whatever the topic's `persistence`; `simple` topics and views
  with conflation are refused at start (`check_topology`). Capacity eviction scans the partition's
  state (MapState has no order), so it costs more per eviction than in the Faust worker.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterator

from processor.contract.errors import InputError, UnsupportedByEngine
from processor.contract.types import InputMessage, Output, SowRecord
from processor.core.filters import FilterError
from processor.core.keys import owner_partition
from processor.engine.ordering import in_partition_time_order
from processor.engine.outputs import rejected
from processor.engine.partition import pop_due_by_lookup, scan_matching
from processor.engine.topic import SowTopicEngine
from processor.topology import Persistence, SowTopic, Topology

log = logging.getLogger("ksow.spark")

ERRORS_GROUP = "!errors"  # grouping key of rejected inputs (the others are partition numbers)
KEY_SCHEMA = "sow_key string"
RECORD_SCHEMA = "data binary, seq long, expires_at long, updated_at long"  # data: the codec's bytes (JSON or Avro)
DUE_KEY_SCHEMA = "at long"
DUE_SCHEMA = "keys string"  # the SowKeys due at that instant, comma-separated (no SowKey has a comma)
COUNTER_SCHEMA = "counter long"
SIZE_SCHEMA = "size long"
OUTPUT_SCHEMA = "topic string, partition int, key binary, value binary, headers array<struct<key: string, value: binary>>"
ROUTE_SCHEMA = "array<struct<gkey: string, reason: string>>"


def check_topology(topology: Topology) -> None:
    """Refuse, by name, what this engine cannot do the way the Faust worker does it."""
    for spec in topology.sow:
        if spec.persistence is Persistence.SIMPLE:
            raise UnsupportedByEngine(f"sow[{spec.topic}].persistence: simple is not supported by the spark engine (its state always survives a restart)")
        if spec.capacity and spec.expiry.active:
            # Its state sees an instant only when that instant's timer fires, so a full partition
            # could not expire its due records before evicting or refusing (the worker does).
            raise UnsupportedByEngine(f"sow[{spec.topic}].capacity with expiration is not supported by the spark engine (use the faust engine)")
    for view in topology.views:
        if view.conflation:
            raise UnsupportedByEngine(f"views[{view.name}].conflation is not supported by the spark engine (use the faust engine)")


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
        self._engine: SowTopicEngine | None = None

    def __call__(self, topic: str, value, headers) -> list[tuple[str, str | None]]:
        if self._engine is None:  # built on the executor, once per Python worker
            self._engine = SowTopicEngine(self.spec, self.base)
        msg = InputMessage(topic, 0, 0, None, None if value is None else bytes(value), _headers(headers), 0)
        try:
            cmd, _ = self._engine.parse(msg)
        except (InputError, FilterError) as exc:
            return [(ERRORS_GROUP, str(exc))]
        n = self.spec.partitions
        if cmd.sow_key is not None:
            return [(str(owner_partition(cmd.sow_key, n)), None)]
        if cmd.keys:
            return [(str(p), None) for p in sorted({owner_partition(k, n) for k in cmd.keys})]
        return [(str(p), None) for p in range(n)]


class SparkState:
    """The engine's `PartitionState` over one `transformWithState` group: records in a MapState, an
    index of expiry instants (each with a processing-time timer), the event counter and the size."""

    def __init__(self, handle, codec, expiring: bool):
        self.handle = handle
        self.codec = codec
        self.expiring = expiring
        self.records = handle.getMapState("records", KEY_SCHEMA, RECORD_SCHEMA)
        self.due_index = handle.getMapState("due", DUE_KEY_SCHEMA, DUE_SCHEMA)
        self._counter = handle.getValueState("counter", COUNTER_SCHEMA)
        self._size = handle.getValueState("size", SIZE_SCHEMA)
        self.fired: list[int] = []  # the timer instants being handled (what due() reads)

    def get(self, key: str) -> SowRecord | None:
        row = self.records.getValue((key,))
        if row is None:
            return None
        data, seq, expires_at, updated_at = row
        return SowRecord(self.codec.decode(bytes(data)), seq, expires_at, updated_at)

    def put(self, key: str, record: SowRecord) -> None:
        if not self.records.containsKey((key,)):
            self._grow(1)
        self.records.updateValue((key,), (self.codec.encode(record.data), record.seq, record.expires_at, record.updated_at))
        if self.expiring and record.expires_at is not None:
            at = record.expires_at
            entry = self.due_index.getValue((at,))
            keys = entry[0].split(",") if entry else []
            if key not in keys:
                self.due_index.updateValue((at,), (",".join([*keys, key]),))
            if not entry:
                self.handle.registerTimer(at)

    def remove(self, key: str) -> None:
        if self.records.containsKey((key,)):
            self.records.removeKey((key,))  # a due entry left behind is skipped when it fires
            self._grow(-1)

    def _grow(self, by: int) -> None:
        self._size.update((self.size() + by,))

    def size(self) -> int:
        return self._size.get()[0] if self._size.exists() else 0

    def _all(self):
        for (key,), (data, seq, expires_at, updated_at) in self.records.iterator():
            yield key, SowRecord(self.codec.decode(bytes(data)), seq, expires_at, updated_at)

    def matching(self, predicate):
        return scan_matching(lambda: iter(list(self._all())), predicate)

    def due(self, now_ms: int):
        for at in sorted(self.fired):
            if at > now_ms:
                break
            entry = self.due_index.getValue((at,))
            self.due_index.removeKey((at,))
            for key in entry[0].split(",") if entry else ():
                yield at, key

    pop_due = pop_due_by_lookup

    def least_recently_updated(self):
        return iter(sorted(self._all(), key=lambda item: item[1].seq))  # a scan: capacity is costly here

    def counter(self) -> int:
        return self._counter.get()[0] if self._counter.exists() else 0

    def set_counter(self, value: int) -> None:
        self._counter.update((value,))


def make_processor(spec: SowTopic, views=(), base: Path | None = None):
    """The StatefulProcessor class for one SOW topic (built lazily: pyspark is optional). `base`
    is the folder a relative Avro schema path is relative to (as for the Faust worker)."""
    from pyspark.sql import Row
    from pyspark.sql.streaming import StatefulProcessor

    def rows(out: list[Output]) -> Iterator[Any]:
        for o in out:
            yield Row(topic=o.topic, partition=o.partition, key=o.key, value=o.value, headers=[Row(key=k, value=v) for k, v in o.headers])

    class Processor(StatefulProcessor):
        """One SOW partition, applied by the engine over SparkState."""

        def init(self, handle) -> None:
            self.engine = SowTopicEngine(spec, base, views)
            self.state = SparkState(handle, self.engine.codec, spec.expiry.active)

        def handleInputRows(self, key, rows_in, timerValues) -> Iterator[Any]:
            (gkey,) = key
            now = timerValues.getCurrentProcessingTimeInMs()
            # As a worker merges its inputs: a partition's timestamps that go backwards keep their
            # offsets' order, and each input is judged at its sort time (what expired before it came).
            ordered = in_partition_time_order((r["ts"] or 0, r["rank"], r["partition"], r["offset"], r) for r in rows_in)
            out: list[Output] = []
            if gkey == ERRORS_GROUP:
                for *_, row in ordered:
                    out.append(rejected(message(row), row["reason"], self.engine.streams))
                return rows(out)
            p = int(gkey)
            partition = self.engine.attach(p, self.state)
            for sort, *_, row in ordered:
                msg = message(row)
                try:
                    cmd, _ = self.engine.parse(msg)
                    partition.apply(cmd, msg.timestamp or now, now, out, sort or None)
                except InputError as exc:  # refused by the partition (capacity_policy: reject)
                    out.append(rejected(msg, str(exc), self.engine.streams))
            return rows(out)

        def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[Any]:
            (gkey,) = key
            at = expiredTimerInfo.getExpiryTimeInMs()
            now = max(at, timerValues.getCurrentProcessingTimeInMs())
            out: list[Output] = []
            self.state.fired = [at]
            try:
                self.engine.attach(int(gkey), self.state).expire_due(now, out)
            finally:
                self.state.fired = []
            return rows(out)

        def close(self) -> None:
            pass

    return Processor


def build_query(spark, bootstrap: str, spec: SowTopic, checkpoint_dir: str | Path, trigger: str = "1 second", starting_offsets: str = "earliest",
                base: Path | None = None, views=()):
    """Start the streaming query that maintains one SOW topic; returns the StreamingQuery."""
    from pyspark.sql import functions as F

    from processor.batch.snapshot import history_columns
    from processor.kafka.config import spark_kafka_options

    route = F.udf(Router(spec, base), ROUTE_SCHEMA, useArrow=True)
    raw = (
        spark.readStream.format("kafka")
        .options(**spark_kafka_options(bootstrap))
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
        statefulProcessor=make_processor(spec, views, base)(),
        outputStructType=OUTPUT_SCHEMA,
        outputMode="Update",
        timeMode="ProcessingTime",
    )
    return (
        outputs.writeStream.format("kafka")
        .options(**spark_kafka_options(bootstrap))
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
    from processor.kafka.clients import ensure_topics, make_admin, topology_topic_configs
    from processor.batch.session import get_spark

    check_topology(topology)
    ensure_topics(make_admin(bootstrap), topology_topic_configs(topology),
                  replication_factor=topology.replication_factor, min_insync_replicas=topology.min_insync_replicas)
    spark = get_spark(master, "ksow-stream", conf)
    queries = [build_query(spark, bootstrap, spec, checkpoint_dir, trigger, base=topology_dir, views=topology.views_of(spec.topic)) for spec in topology.sow]
    log.info("spark streaming: %d SOW topics, checkpoints in %s", len(queries), checkpoint_dir)
    if not block:
        return spark, queries
    wait_for(queries)
    return spark, queries


class StreamError(RuntimeError):
    """A streaming query stopped with an error."""


STOP_WAIT_S = 30.0  # how long a stop waits for the micro-batches under way to finish


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
        stop_queries(queries)


def stop_queries(queries, wait_s: float = STOP_WAIT_S) -> None:
    """Stop the queries, each between two micro-batches when it can (waiting up to `wait_s` in all):
    Spark's stop() interrupts a micro-batch under way, which then runs again after a restart."""
    deadline = time.monotonic() + wait_s
    for q in queries:
        try:
            while q.isActive and q.status.get("isTriggerActive") and time.monotonic() < deadline:
                time.sleep(0.05)
            q.stop()
        except Exception:  # noqa: BLE001 - stopping is best effort when the JVM is going away
            log.debug("could not stop %s", q.name, exc_info=True)
