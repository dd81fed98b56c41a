"""Restore benchmark: how fast a worker rebuilds a SOW partition's store from `<topic>.sow`.

    python bench/restore.py [-n 1000000] [-k N*3/5] [--expiring 0.3] [--tombstones 0.05] [--indexes] [--avro] [--runs 1]

This is the failover time: a worker that takes over a partition on a machine without its store (or
after the store was lost) replays the partition's changelog into an empty store before it applies
any input. Each run writes N records to partition 0 of a fresh `<topic>.sow` (compacted, as the
worker creates it, but not before an hour: both sides read all N) the way a worker does: in
transactions of 20,000 records, each message with its `sow-key`, `sow-op`, `sow-seq` and, for a
share of them (--expiring), `sow-expires-at`, its timestamp the record's update instant. The records are bench/ingest.py's (id, px, qty, side, desk,
nested) over K SowKeys, so a key has one to a few versions, as a compacted log still holds them
before its cleaner runs; a share of the messages (--tombstones) are the tombstones of a delete or
an expiry of a key written before. Then, each in its own process (its CPU and memory its own):

  ksow    the loop's `SowLoop._replay_changelog` (the code a worker runs, from its own consumer to the
          store's commits) into an empty RocksDB PartitionStore, the topic's engine attached as
          the loop attaches it, the garbage collector off as in the loop's cycles. The store's
          count and event-ID counter are checked against what was written.
  limit   a plain loop: confluent-kafka (read_committed) `consume` in batches, each value put as it
          is (a tombstone deleted) into a rocksdict WriteBatch under its key, written every 20,000
          records, with the store's RocksDB options. No parsing, no checks, no indexes.

Figures: records/s (wall time of the replay, from assigning the consumer to its last commit), CPU per
record (all threads of the process, from /proc, over the same span; and the reading thread's alone:
the rest is librdkafka's and RocksDB's own threads) and peak RSS of the process
(VmHWM, its imports included). --indexes gives the topic a hash index on /desk and a capacity (so
the store keeps hash and age index entries, which cost more); --avro makes it an Avro topic (the
record's schema in a temporary file). With --runs R the two alternate, figures are medians.
Broker: $KAFKA_BOOTSTRAP, else the embedded one; --prefix names the topics (a shared broker).
Last line: `restore: ksow X rec/s, limit L rec/s, ratio R` (R = X / L).

`--alongside RATE` measures instead what a restore costs the partitions a worker serves already:
a topic of two partitions, the N records on partition 1's `.sow`, and a `ksow up` worker started
on it with an empty data folder, while records are published to partition 0 at RATE a second,
each with a lifetime of 1 s, from the worker's start to 2 s past the end of partition 1's restore.
It prints the restore's time (the worker's log, from the assignment to `restored ... partition
1`; publishing starts at the assignment), and for partition 0's records published before the
restore ended: how long each took to be
applied (its `.diff` event's timestamp, the worker's clock when it produced it, less the input's)
and how late each expired (`sow-actual-expiry - sow-expires-at` on `EXP.`); the same for the
records of the 2 s after the restore are the same-run baseline. Last line:
`restore alongside: N records in X s; partition 0 meanwhile: M records, p99 applied after A ms, p99 expired B ms late`.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    REPO, cpu_seconds, create_topics, delete_topics, kafka_bootstrap, log, median, peak_rss_mb, print_table, ratio, unique_name,
)
from bench.ingest import full_record  # noqa: E402
from processor.core.bookmarks import SEQ_PARTITION_BITS  # noqa: E402
from processor.core.keys import checksum_key  # noqa: E402
from processor.kafka.clients import make_producer, topic_configs  # noqa: E402
from processor.topology import parse_topology  # noqa: E402

CLEANER_LAG_MS = 3_600_000  # the changelog's min.compaction.lag.ms here (the worker's is 0)
TXN = 20_000  # records a transaction of the writer (a worker's cycle), and a write of the limit
AVRO_SCHEMA = {
    "type": "record", "name": "Order", "fields": [
        {"name": "id", "type": "long"},
        {"name": "px", "type": "double"},
        {"name": "qty", "type": "long"},
        {"name": "side", "type": "string"},
        {"name": "desk", "type": "string"},
        {"name": "nested", "type": {"type": "record", "name": "Nested", "fields": [
            {"name": "a", "type": "long"}, {"name": "b", "type": "string"}]}},
    ],
}


def topic_spec(topic: str, indexes: bool, schema: Path | None):
    entry: dict = {"topic": topic, "key": ["/id"], "persistence": "persistent", "partitions": 1}
    if indexes:
        entry |= {"hash_indexes": [["/desk"]], "capacity": 10**9}
    if schema is not None:
        entry |= {"message_type": "avro", "schema": str(schema)}
    return parse_topology({"sow": [entry]}).sow[0]


def changelog(spec, n: int, k: int, expiring: float, tombstones: float, seed: int = 11):
    """(key, value, headers, timestamp) of N `.sow` messages of partition 0, as a worker writes them,
    and what a restore must end with: (live records, event-ID counter)."""
    rng = random.Random(seed)
    codec = spec.codec(None)
    keys = [checksum_key(spec.topic, [i]).encode() for i in range(k)]
    live: set[int] = set()
    now = int(time.time() * 1000)
    counter = now * 1000
    messages = []
    for j in range(n):
        counter += 1
        seq = b"%d" % (counter << SEQ_PARTITION_BITS)
        stamp = now - n + j
        i = rng.randrange(k)
        if live and rng.random() < tombstones:  # the delete or expiry of a record written before
            i = rng.choice(tuple(live)) if len(live) < 64 else _some(rng, live, k)
            live.discard(i)
            op = b"expire" if rng.random() < 0.5 else b"delete"
            messages.append((keys[i], None, [("sow-key", keys[i]), ("sow-op", op), ("sow-seq", seq)], stamp))
            continue
        record = full_record(rng, i)
        headers = [("sow-key", keys[i]), ("sow-op", b"update" if i in live else b"insert"), ("sow-seq", seq)]
        if rng.random() < expiring:
            headers.append(("sow-expires-at", b"%d" % (now + rng.randrange(3_600_000, 7_200_000))))
        live.add(i)
        messages.append((keys[i], codec.encode(record), headers, stamp))
    return messages, len(live), counter


def _some(rng: random.Random, live: set[int], k: int) -> int:
    """A live key, found by probing (a choice over a large set costs a copy of it)."""
    while True:
        i = rng.randrange(k)
        if i in live:
            return i


def fill(bootstrap: str, topic: str, messages: list, partition: int = 0) -> float:
    """Write the messages to a partition in transactions of TXN, as a worker does; returns seconds."""
    producer = make_producer(bootstrap, **{"transactional.id": unique_name("ksow-bench-restore"), "linger.ms": 20})
    producer.init_transactions(30)
    began = time.perf_counter()
    for start in range(0, len(messages), TXN):
        producer.begin_transaction()
        for key, value, headers, stamp in messages[start:start + TXN]:
            while True:
                try:
                    producer.produce(topic, value, key, partition=partition, headers=headers, timestamp=stamp)
                    break
                except BufferError:
                    producer.poll(0.05)
        producer.commit_transaction(60)
    return time.perf_counter() - began


# the two sides, each in its own process -------------------------------------------------------------
def ksow_restore(bootstrap: str, topic: str, data_dir: str, indexes: bool, schema: str | None) -> dict:
    """The loop's replay of partition 0 into an empty store: `SowLoop._replay_changelog` itself, on a
    loop that is not started: a SowLoop with only the attributes the replay reads (its bootstrap,
    admin client and guarantee), and every method of its own (a stand-in object lacked a method the
    replay came to call, and the bench failed from 52b702a to e0d96c8)."""
    from processor.engine.topic import SowTopicEngine
    from processor.runners.faust.loop import SowLoop, Task
    from processor.state.base import open_partition_store

    spec = topic_spec(topic, indexes, Path(schema) if schema else None)
    engine = SowTopicEngine(spec)
    task = Task(engine, 0, ((spec.topic, 0), (spec.delta_topic, 0), (spec.repartition_topic, 0)))
    store = open_partition_store("rocksdb", data_dir, engine.indexes)
    engine.attach(0, store)
    loop = SowLoop.__new__(SowLoop)  # no __init__: no consumer, producer or stores of its own
    loop.bootstrap, loop._admin, loop.eos = bootstrap, None, True
    gc.freeze()  # as the loop runs its cycles, a restore among them (SowLoop.run)
    gc.disable()
    began, cpu, own = time.perf_counter(), cpu_seconds(), time.thread_time()
    count, reseed = SowLoop._replay_changelog(loop, task, store)
    seconds, cpu, own = time.perf_counter() - began, cpu_seconds() - cpu, time.thread_time() - own
    gc.enable()
    result = {"records": count, "seconds": seconds, "cpu_s": cpu, "thread_s": own, "rss_mb": peak_rss_mb(), "count": store.count(),
              "counter": store.counter(), "reseed": reseed}
    store.close()
    return result


def limit_restore(bootstrap: str, topic: str, data_dir: str) -> dict:
    """The least a restore of partition 0 costs in Python with these libraries."""
    from confluent_kafka import TopicPartition
    from rocksdict import Rdict, WriteBatch

    from processor.kafka.clients import end_offsets, make_consumer
    from processor.state.rocksdb import _options

    db = Rdict(data_dir, _options())
    began, cpu, own = time.perf_counter(), cpu_seconds(), time.thread_time()
    consumer = make_consumer(bootstrap, **{"isolation.level": "read_committed"})
    ((low, high),) = end_offsets(consumer, topic, [0]).values()
    consumer.assign([TopicPartition(topic, 0, low)])
    batch, pending, count, done = WriteBatch(raw_mode=True), 0, 0, False
    while not done:
        for msg in consumer.consume(1000, 0.2):
            if msg.error() is not None:  # end of partition: the markers of the last commit are past `high`
                done = done or msg.offset() >= high
                continue
            value = msg.value()
            if value is None:
                batch.delete(msg.key())
            else:
                batch.put(msg.key(), value)
            count += 1
            pending += 1
            if pending == TXN:
                db.write(batch)
                batch, pending = WriteBatch(raw_mode=True), 0
            if msg.offset() + 1 >= high:
                done = True
    db.write(batch)
    seconds, cpu, own = time.perf_counter() - began, cpu_seconds() - cpu, time.thread_time() - own
    consumer.close()
    db.close()
    return {"records": count, "seconds": seconds, "cpu_s": cpu, "thread_s": own, "rss_mb": peak_rss_mb()}


def run_side(side: str, spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--side", side, json.dumps(spec)], capture_output=True, cwd=str(REPO))
    if out.returncode:
        raise RuntimeError(f"the {side} side failed (exit {out.returncode}):\n{out.stderr.decode(errors='replace')[-3000:]}")
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


# one run ----------------------------------------------------------------------------------------------
def one_run(bootstrap: str, args, r: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="ksow-bench-restore-"))
    schema = None
    if args.avro:
        schema = tmp / "order.avsc"
        schema.write_text(json.dumps(AVRO_SCHEMA))
    topic = unique_name(args.prefix)
    spec = topic_spec(topic, args.indexes, schema)
    partitions, configs = topic_configs(spec)[spec.sow_topic]
    # As the worker creates it, but the cleaner leaves it alone for the run: each side reads the
    # same N records (the broker may compact a closed segment at any time otherwise).
    wanted = {spec.sow_topic: (partitions, configs | {"min.compaction.lag.ms": str(CLEANER_LAG_MS)})}
    try:
        create_topics(bootstrap, wanted)
        began = time.perf_counter()
        messages, live, counter = changelog(spec, args.n, args.k or args.n * 3 // 5, args.expiring, args.tombstones)
        log(f"{spec.sow_topic}: {len(messages):,} messages made in {time.perf_counter() - began:.1f}s, {live:,} records live at the end")
        seconds = fill(bootstrap, spec.sow_topic, messages)
        del messages
        log(f"  written in {seconds:.1f}s")
        side = {"bootstrap": bootstrap, "topic": topic, "indexes": args.indexes, "schema": str(schema) if schema else None}
        result = {}
        for name in (("ksow", "limit") if r % 2 == 0 else ("limit", "ksow")):  # alternated: the machine's load shifts
            result[name] = run_side(name, side | {"data_dir": str(tmp / name)})
            one = result[name]
            one["rate"] = one["records"] / one["seconds"]
            one["cpu_us"] = one["cpu_s"] / one["records"] * 1e6
            one["thread_us"] = one["thread_s"] / one["records"] * 1e6
            log(f"  {name}: {one['records']:,} records in {one['seconds']:.2f}s, {one['rate']:,.0f} rec/s, {one['cpu_us']:.2f} us CPU "
                f"a record ({one['thread_us']:.2f} us on the reading thread)")
        k = result["ksow"]
        if k["records"] != args.n or k["count"] != live or k["counter"] != counter or k["reseed"]:
            raise RuntimeError(f"the restored store is wrong: {k['records']} records read of {args.n}, {k['count']} in the SOW "
                               f"for {live}, counter {k['counter']} for {counter}, re-seed {k['reseed']}")
        return result
    finally:
        delete_topics(bootstrap, wanted)
        shutil.rmtree(tmp, ignore_errors=True)


# a restore beside served partitions ---------------------------------------------------------------------
LIFETIME_MS = 1000  # of each record published to partition 0 while partition 1 restores
_LOGGED_AT = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")


def _logged_at(line: str) -> float:
    """The epoch seconds of a worker's log line (its `[date time,ms]` prefix, local time)."""
    return datetime.strptime(_LOGGED_AT.match(line).group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def alongside(bootstrap: str, args) -> dict:
    from processor.core.keys import owner_partition
    from processor.testing import WorkerProcess, read_topic

    tmp = Path(tempfile.mkdtemp(prefix="ksow-bench-restore-"))
    topic = unique_name(args.prefix)
    topology = {"sow": [{"topic": topic, "key": ["/id"], "persistence": "persistent", "partitions": 2, "expiration": "enabled",
                         **({"hash_indexes": [["/desk"]], "capacity": 10**9} if args.indexes else {})}]}
    (tmp / "t.yaml").write_text(json.dumps(topology))  # YAML
    spec = parse_topology(topology).sow[0]
    wanted = topic_configs(spec)
    wanted[spec.sow_topic] = (wanted[spec.sow_topic][0], wanted[spec.sow_topic][1] | {"min.compaction.lag.ms": str(CLEANER_LAG_MS)})
    worker = None
    try:
        create_topics(bootstrap, wanted)
        messages, live, _ = changelog(spec, args.n, args.k or args.n * 3 // 5, args.expiring, args.tombstones)
        log(f"{spec.sow_topic}[1]: {len(messages):,} messages written in {fill(bootstrap, spec.sow_topic, messages, 1):.1f}s")
        del messages
        keyed = ((i, spec.key_spec.sow_key({"id": i})) for i in range(10**9, 2 * 10**9))
        ours = ((i, sow_key) for i, sow_key in keyed if owner_partition(sow_key, 2) == 0)  # partition 0's
        producer = make_producer(bootstrap, **{"linger.ms": 5})
        worker = WorkerProcess(bootstrap, tmp / "t.yaml", unique_name("g"), tmp / "data").start(wait=False)
        restored = f"restored {topic} partition 1:"
        # Publishing starts once the worker has its partitions: what it takes to start and join
        # the group is no part of the restore's cost to the other partition.
        worker.wait_for("] assigned ", 120)
        sent: dict[bytes, float] = {}  # partition 0's keys -> when published (epoch s)
        ended = None  # when the restore ended (epoch s, the worker's log)
        next_at = look_at = time.time()
        while ended is None or time.time() < ended + 2:
            if worker.proc.poll() is not None:
                raise RuntimeError(f"the worker exited ({worker.proc.returncode}): {worker.log()[-3000:]}")
            i, sow_key = next(ours)
            key = sow_key.encode()
            sent[key] = time.time()
            producer.produce(spec.topic, orjson.dumps(full_record(random.Random(i), i)), key, 0,
                             headers=[("sow-expiration", b"%dms" % LIFETIME_MS)], timestamp=int(sent[key] * 1000))
            producer.poll(0)
            next_at += 1 / args.alongside
            time.sleep(max(0.0, next_at - time.time()))
            if ended is None and time.time() >= look_at:
                look_at += 0.1
                if restored in (text := worker.log()):
                    ended = _logged_at(next(line for line in text.splitlines() if restored in line))
        producer.flush(30)
        text = worker.log()
        assigned = _logged_at(next(line for line in text.splitlines() if "] assigned " in line))
        during = {k for k, at in sent.items() if at < ended}
        deadline = time.time() + 120
        while True:
            diffs: dict[bytes, float] = {}  # the record's first event (its insert; the second is its expiry)
            for m in read_topic(bootstrap, spec.diff_topic, [0]):
                if m.key() in sent:
                    diffs.setdefault(m.key(), m.timestamp()[1] / 1000)
            expired = {m.key(): m for m in read_topic(bootstrap, spec.expired_topic, [0]) if m.key() in sent}
            if len(diffs) == len(expired) == len(sent) or time.time() > deadline:
                break
            time.sleep(1)
        if len(diffs) != len(sent) or len(expired) != len(sent):
            raise RuntimeError(f"partition 0: {len(sent)} published, {len(diffs)} applied, {len(expired)} expired")
        def late(m) -> int:
            headers = dict(m.headers())
            return int(headers["sow-actual-expiry"]) - int(headers["sow-expires-at"])

        # The same figures for the records published in the 2 s after the restore: the baseline.
        return {"records": args.n, "live": live, "restore_s": ended - assigned, "published": len(sent), "during": len(during),
                "applied_ms": sorted((diffs[k] - sent[k]) * 1000 for k in during),
                "late_ms": sorted(late(m) for k, m in expired.items() if k in during),
                "applied_after_ms": sorted((diffs[k] - sent[k]) * 1000 for k in sent if k not in during),
                "late_after_ms": sorted(late(m) for k, m in expired.items() if k not in during)}
    finally:
        if worker is not None:
            worker.stop()
        delete_topics(bootstrap, wanted)
        shutil.rmtree(tmp, ignore_errors=True)


def _pct(values: list, q: float) -> float:
    """The q-quantile of sorted values (0 when there are none: the restore ended before any)."""
    return values[min(len(values) - 1, int(len(values) * q))] if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=1_000_000, help="changelog records (default 1000000)")
    parser.add_argument("-k", type=int, default=0, help="distinct SowKeys (default 3/5 of N)")
    for share, default, of in (("expiring", 0.3, "records with an expiry instant"), ("tombstones", 0.05, "tombstones")):
        parser.add_argument(f"--{share}", type=float, default=default, help=f"share of {of} (default {default})")
    kind = parser.add_argument_group("the topic (default: JSON, no index, no capacity)")
    kind.add_argument("--indexes", action="store_true", help="a hash index on /desk and a capacity (age index)")
    kind.add_argument("--avro", action="store_true", help="an Avro topic instead of JSON")
    parser.add_argument("--runs", type=int, default=1, help="repeat with fresh topics; figures are medians")
    parser.add_argument("--prefix", default="bench_restore", help="topic name prefix (default bench_restore)")
    parser.add_argument("--alongside", type=float, default=0.0, metavar="RATE",
                        help="instead: a worker restores partition 1 while RATE records a second go to partition 0")
    parser.add_argument("--side", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.side:  # child mode: one side, its figures as JSON on stdout
        name, spec = args.side[0], json.loads(args.side[1])
        if name == "ksow":
            print(json.dumps(ksow_restore(spec["bootstrap"], spec["topic"], spec["data_dir"], spec["indexes"], spec["schema"])))
        else:
            print(json.dumps(limit_restore(spec["bootstrap"], f"{spec['topic']}.sow", spec["data_dir"])))
        return

    if args.alongside:
        with kafka_bootstrap() as bootstrap:
            a = alongside(bootstrap, args)
        applied, late = a["applied_ms"], a["late_ms"]
        print(f"restore alongside: {a['records']:,} changelog records of partition 1 ({a['live']:,} live) restored in {a['restore_s']:.1f}s "
              f"({a['records'] / a['restore_s']:,.0f} rec/s) from the assignment")
        print(f"  partition 0: {a['published']:,} records published at {args.alongside:g}/s from the assignment, {a['during']:,} of them "
              f"before the restore ended; of those, applied after p50 {_pct(applied, 0.5):.0f} ms, p99 {_pct(applied, 0.99):.0f} ms, "
              f"max {_pct(applied, 1):.0f} ms; expired late by p50 {_pct(late, 0.5):.0f} ms, p99 {_pct(late, 0.99):.0f} ms, max {_pct(late, 1):.0f} ms")
        base, base_late = a["applied_after_ms"], a["late_after_ms"]
        print(f"  baseline, partition 0's {len(base):,} records of the 2 s after the restore: applied after p50 {_pct(base, 0.5):.0f} ms, "
              f"p99 {_pct(base, 0.99):.0f} ms; expired late by p50 {_pct(base_late, 0.5):.0f} ms, p99 {_pct(base_late, 0.99):.0f} ms")
        print(f"restore alongside: {a['records']} records in {a['restore_s']:.1f} s; partition 0 meanwhile: {a['during']} records, p99 applied "
              f"after {_pct(applied, 0.99):.0f} ms, p99 expired {_pct(late, 0.99):.0f} ms late")
        return
    with kafka_bootstrap() as bootstrap:
        runs = []
        for r in range(args.runs):
            log(f"run {r + 1}/{args.runs}: N={args.n}")
            runs.append(one_run(bootstrap, args, r))

    def col(side: str, name: str) -> list:
        return [run[side][name] for run in runs]

    kind = ("Avro" if args.avro else "JSON") + (", a hash index and a capacity" if args.indexes else "")
    print(f"restore benchmark: N={args.n} changelog records ({kind}), {args.expiring:.0%} expiring, "
          f"{args.tombstones:.0%} tombstones, one partition, {args.runs} run(s)")
    for side, title in (("ksow", "ksow (SowLoop._replay_changelog into an empty RocksDB store):"),
                        ("limit", "limit (confluent-kafka read_committed -> rocksdict WriteBatch, raw values):")):
        print_table(title, [
            ("records/s", col(side, "rate"), " rec/s", 0),
            ("wall time", col(side, "seconds"), " s", 2),
            ("CPU per record (all threads)", col(side, "cpu_us"), " us", 2),
            ("CPU per record (the reading thread)", col(side, "thread_us"), " us", 2),
            ("peak RSS (VmHWM)", col(side, "rss_mb"), " MB", 0),
        ])
    k, lim = median(col("ksow", "rate")), median(col("limit", "rate"))
    r = median([ratio(a, b) for a, b in zip(col("ksow", "rate"), col("limit", "rate"))])
    print(f"restore: ksow {k or 0:.0f} rec/s, limit {lim or 0:.0f} rec/s, ratio {r or 0:.2f}")


if __name__ == "__main__":
    main()
