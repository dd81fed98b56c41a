"""Benchmark: the point-in-time SOW rebuilt by Spark vs the plain Python fold over the core.

    /tmp/venv/bin/python bench/snapshot.py [--events 5000000] [--keys 500000] [--master local[2]]

A deterministic history (70% full publishes on `<topic>`, 30% nested deltas on `<topic>.delta`,
1% deletes by data, 5% with a `sow-expiration` header, 0.1% malformed) is produced once with
confluent-kafka (lz4, big batches, explicit timestamps 1 ms apart) into topics named after its
size, and reused by later runs. Then, over the same history and the same instant (the end of it):
  - spark: `processor.spark.snapshot.snapshot` from the Kafka read to the SOW written as Parquet
    (what `ksow snapshot --out` does), the SparkSession already started (printed separately);
  - loop: confluent-kafka reads everything, sorts it into history order and folds it with
    `processor.spark.history.SowFold` (the core's parse_command + merge, one message at a time).
Both SOWs are compared (same keys, same records) before the figures are printed.
Last line: `snapshot: spark E events/s, loop L events/s, ratio R`.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import orjson  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from confluent_kafka import TopicPartition  # noqa: E402

from bench.common import kafka_bootstrap, log  # noqa: E402
from processor.kafka.clients import end_offsets, ensure_topics, make_consumer, make_producer, produce, read_until
from processor.engine.topic import InputMessage
from processor.engine.fold import SowFold, in_order
from processor.topology import SowTopic  # noqa: E402

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z: event i has timestamp T0 + i
STATUSES = ("open", "filled", "cancelled", "pending")
REGIONS = ("eu", "us", "apac")


def bench_spec(events: int, keys: int, partitions: int) -> SowTopic:
    return SowTopic(timestamps="publisher", topic=f"bench_snap_{events}_{keys}_p{partitions}", key=["/order_id"], expiration="enabled", partitions=partitions)


def history(spec: SowTopic, events: int, keys: int, seed: int = 7):
    """(topic, kafka key, value, headers, timestamp) of the scripted history, deterministic."""
    rng = random.Random(seed)
    key_of = spec.key_spec.sow_key
    for i in range(events):
        k = rng.randrange(keys)
        ts = T0 + i
        roll = rng.random()
        headers = None
        if roll < 0.30:  # delta: a scalar, a nested object merged field by field, or an array
            which = rng.randrange(3)
            if which == 0:
                record = {"order_id": k, "qty": rng.randrange(1, 5000), "status": rng.choice(STATUSES)}
            elif which == 1:
                record = {"order_id": k, "detail": {"notes": {f"n{i % 5}": i}, "region": rng.choice(REGIONS)}}
            else:
                record = {"order_id": k, "detail": {"tags": [rng.randrange(100) for _ in range(2)]}}
            topic = spec.delta_topic
        else:
            topic = spec.topic
            if roll < 0.31:
                record = {"order_id": k}
                headers = [("sow-command", b"sow_delete")]
            else:
                record = {
                    "order_id": k,
                    "customer": f"c{k % 10_000}",
                    "status": rng.choice(STATUSES),
                    "qty": rng.randrange(1, 5000),
                    "price": round(rng.random() * 100, 2),
                    "detail": {"region": rng.choice(REGIONS), "tags": [rng.randrange(100)], "notes": {"n0": i}},
                }
                if roll > 0.95:
                    headers = [("sow-expiration", b"10m" if roll < 0.99 else b"0")]
        if roll > 0.999:
            value = b'{"order_id": ' + str(k).encode() + b", oops"
        else:
            value = orjson.dumps(record)
        yield topic, key_of(record).encode(), value, headers, ts


def ensure_history(bootstrap: str, spec: SowTopic, events: int, keys: int) -> None:
    """Produce the history unless its topics already hold it (a previous run made them)."""
    keep = {"retention.ms": "-1"}  # the timestamps are in the past: time retention would drop them
    admin = _admin(bootstrap)
    ensure_topics(admin, {n: (spec.partitions, keep) for n in (spec.topic, spec.delta_topic)})
    keep_history(admin, [spec.topic, spec.delta_topic])
    have = sum(high - low for (low, high) in _marks(bootstrap, spec).values())
    if have == events:
        log(f"history: reusing {events:,} events in {spec.topic} and {spec.delta_topic}")
        return
    if have:
        raise SystemExit(f"{spec.topic} holds {have} messages, not {events}: delete the bench topics and rerun")
    producer = make_producer(bootstrap, **{"linger.ms": 100, "batch.size": 4_000_000, "enable.idempotence": False, "acks": "1"})
    began = time.perf_counter()
    for n, (topic, key, value, headers, ts) in enumerate(history(spec, events, keys), 1):
        produce(producer, topic, value, key, headers=headers, timestamp=ts)
        if n % 50_000 == 0:
            producer.poll(0)
    producer.flush(300)
    took = time.perf_counter() - began
    log(f"history: produced {events:,} events in {took:.1f}s ({events / took:,.0f}/s)")


def keep_history(admin, topics: list[str]) -> None:
    """retention.ms=-1 on topics that may exist already (created by another run or auto-created)."""
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource

    entry = ConfigEntry("retention.ms", "-1", incremental_operation=AlterConfigOpType.SET)
    resources = [ConfigResource("topic", t, incremental_configs=[entry]) for t in topics]
    for future in admin.incremental_alter_configs(resources).values():
        future.result()


def _admin(bootstrap: str):
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": bootstrap})


def _marks(bootstrap: str, spec: SowTopic) -> dict[tuple[str, int], tuple[int, int]]:
    """Watermarks of the input partitions (retried while new topics elect their leaders)."""
    consumer = make_consumer(bootstrap)
    try:
        return {(t, p): marks for t in (spec.topic, spec.delta_topic)
                for p, marks in end_offsets(consumer, t, range(spec.partitions)).items()}
    finally:
        consumer.close()


def loop_snapshot(bootstrap: str, spec: SowTopic, as_of: int) -> tuple[dict, dict[str, float]]:
    """The plain Python path: read with confluent-kafka, sort into history order, fold."""
    stages: dict[str, float] = {}
    began = time.perf_counter()
    consumer = make_consumer(bootstrap)
    ends = {tp: high for tp, (low, high) in _marks(bootstrap, spec).items()}
    consumer.assign([TopicPartition(t, p, 0) for (t, p) in ends])
    messages = [
        InputMessage(m.topic(), m.partition(), m.offset(), None, m.value(), m.headers(), m.timestamp()[1])
        for m in read_until(consumer, ends)
    ]
    consumer.close()
    stages["read"] = time.perf_counter() - began
    t = time.perf_counter()
    ordered = in_order(spec, messages, as_of)
    stages["sort"] = time.perf_counter() - t
    t = time.perf_counter()
    fold = SowFold(spec)
    for msg in ordered:
        fold.apply(msg)
    result = fold.as_of(as_of)
    stages["fold"] = time.perf_counter() - t
    stages["total"] = time.perf_counter() - began
    return result, stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=5_000_000)
    parser.add_argument("--keys", type=int, default=500_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--skip-loop", action="store_true", help="Only the Spark job (no comparison).")
    args = parser.parse_args()
    spec = bench_spec(args.events, args.keys, args.partitions)
    as_of = T0 + args.events  # the end of the history
    with kafka_bootstrap() as bootstrap:
        ensure_history(bootstrap, spec, args.events, args.keys)

        from processor.batch.session import get_spark
        from processor.batch.snapshot import write_snapshot

        t = time.perf_counter()
        spark = get_spark(args.master, "ksow-bench-snapshot")
        log(f"spark: session started in {time.perf_counter() - t:.1f}s ({args.master})")
        out = Path(tempfile.mkdtemp(prefix="ksow-bench-snapshot-")) / "sow.parquet"
        t = time.perf_counter()
        passes = write_snapshot(spark, bootstrap, spec, as_of, str(out))
        spark_s = time.perf_counter() - t
        spark_rate = args.events / spark_s
        rows = pq.read_table(out).to_pylist()
        shutil.rmtree(out.parent)
        log(f"spark: {len(rows):,} records written as Parquet in {spark_s:.1f}s ({passes} pass) = {spark_rate:,.0f} events/s")
        if args.skip_loop:
            print(f"snapshot: spark {spark_rate:,.0f} events/s")
            return
        spark.stop()

        expected, stages = loop_snapshot(bootstrap, spec, as_of)
        loop_rate = args.events / stages["total"]
        log("loop: " + ", ".join(f"{k} {v:.1f}s" for k, v in stages.items()) + f" = {loop_rate:,.0f} events/s")
        got = {r["sow_key"]: (orjson.loads(r["record"]), r["expires_at"]) for r in rows}
        want = {k: (v.data, v.expires_at) for k, v in expected.items()}
        if got != want:
            diff = [k for k in set(got) | set(want) if got.get(k) != want.get(k)]
            raise SystemExit(f"MISMATCH: {len(diff)} of {len(want)} keys differ, e.g. {diff[:3]}")
        log(f"compare: identical SOWs ({len(want):,} records)")
        print(f"snapshot: spark {spark_rate:,.0f} events/s, loop {loop_rate:,.0f} events/s, ratio {spark_rate / loop_rate:.1f}")


if __name__ == "__main__":
    main()
