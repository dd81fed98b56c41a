"""The per-record path of a worker, in-process: what one input and one expiry cost the loop thread.

    python bench/hotpath.py [-n 200000] [-k 20000] [--deltas 0.3] [--expiries 100000] [--produce] [--sow N]

No broker unless --produce: the engine applies bench/ingest.py's workload (already in the order a
worker applies it) over RocksDB stores in a temporary folder, in the worker's chunks, committing
the stores after each cycle, and sends its messages to the worker's output buffer (the loop's
`_Batch`) over a producer that does nothing (`--produce`: a real one, $KAFKA_BOOTSTRAP or the
embedded broker; `--sow N`: N records of other keys are in the SOW first, flushed to RocksDB's
table files and not in the stores' caches, as in a worker after a restart or with a SOW larger than
its memtable). Then it expires `--expiries` records of a second topic (lifetime 60 s) through
the same buffer. Baseline, in the same run: the plain loop of bench/ingest.py's limit (orjson,
rocksdict get and WriteBatch, merge and diff, both outputs encoded; nothing produced) over the
same inputs.

Figures are thread CPU time per record, the median of 20,000-record chunks (this machine's
run-to-run noise is 10-30%). For figures that do not move with the machine's load, count
instructions: `valgrind --tool=cachegrind --cache-sim=no python bench/hotpath.py --only ingest -n N`
and `--only setup -n N` (making the inputs alone) for two values of N; the growth of the first
less that of the second, over the growth of N, is instructions an input (docs/benchmarks.md).
Also in the same run, the least an expiry costs in Python (`plain_expiry`: a range scan, three
messages, two deletes). Last line: `hotpath: input X us, expiry Y us, plain loop Z us, plain expiry
W us, ratio R, expiry ratio E` (R = plain loop / input, E = plain expiry / expiry: the share of the
plain loops' speed the engine keeps).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson  # noqa: E402

from bench.ingest import KEY_PATHS, PARTITIONS, workload  # noqa: E402
from processor.contract.types import InputMessage, SowRecord  # noqa: E402
from processor.core.keys import owner_partition  # noqa: E402
from processor.engine.topic import SowTopicEngine  # noqa: E402
from processor.runners.faust.loop import _Batch  # noqa: E402
from processor.state.base import open_partition_store  # noqa: E402
from processor.topology import parse_topology  # noqa: E402

CHUNK = 2000  # inputs a worker applies between two looks at its expiry clock
CYCLE = 20000  # inputs a worker applies between two commits


def _nothing(*args, **kwargs) -> None:
    pass


def output_buffer(producer) -> SimpleNamespace:
    """What the loop's `_Batch` needs of its loop, inside an open transaction."""
    return SimpleNamespace(producer=producer or SimpleNamespace(produce=_nothing), eos=True, _in_txn=True, _oldest_stamps=dict,
                           settings=SimpleNamespace(max_message_bytes=1_000_000))


def serve_reports(loop) -> None:
    """Serve the producer's delivery reports between chunks, untimed, as the worker's commit does
    each cycle. Left unserved, each message produced stays in memory until the end (300,000 for 100,000
    expiries), and the expiry figure swung from 11.3 to 19.8 us across five runs here, against
    10.3-10.9 us with the reports served."""
    poll = getattr(loop.producer, "poll", None)
    if poll is not None:
        poll(0)


def inputs(topic: str, n: int, k: int, deltas: float, start_ms: int) -> list[InputMessage]:
    return [InputMessage(t, owner_partition(key.decode(), PARTITIONS), i, key, value, None, start_ms + i // 10)
            for i, (t, key, value) in enumerate(workload(topic, n, k, deltas))]


def ingest(messages: list[InputMessage], topic: str, folder: Path, loop, sow: int = 0) -> float:
    spec = parse_topology({"sow": [{"topic": topic, "key": ["/id"], "partitions": PARTITIONS}]}).sow[0]
    engine = SowTopicEngine(spec)
    stores = [open_partition_store("rocksdb", str(folder / f"in{p}"), engine.indexes) for p in range(PARTITIONS)]
    for p, store in enumerate(stores):
        engine.attach(p, store)
    if sow:
        fill(stores, spec, sow)
    now = messages[-1].timestamp
    chunks = []
    for start in range(0, len(messages), CYCLE):
        began = time.thread_time()
        out = _Batch(loop)
        cycle = messages[start:start + CYCLE]
        for c in range(0, len(cycle), CHUNK):
            engine.handle(cycle[c:c + CHUNK], now, out)
        for store in stores:
            store.commit()
        chunks.append((time.thread_time() - began) / len(cycle) * 1e6)
        serve_reports(loop)
    for store in stores:
        store.close()
    return statistics.median(chunks)


def fill(stores: list, spec, n: int) -> None:
    """n records of other keys already in the SOW, on disk and not in the stores' caches: a worker's
    stores after a restart, or a SOW larger than RocksDB's memtable and the stores' caches."""
    value = {"id": 0, "desk": "rates", "qty": 100, "px": 101.25, "status": "open", "nested": {"a": 1, "b": "alpha"}}
    for c in range(0, n, CYCLE):
        for i in range(c, min(n, c + CYCLE)):
            key = spec.key_spec.sow_key({"id": 10**9 + i})
            stores[owner_partition(key, PARTITIONS)].put(key, SowRecord(dict(value, id=10**9 + i), i + 1, None, 1))
        for store in stores:
            store.commit()
    for store in stores:
        store.backend._db.flush()  # to table files, as after a restart (RocksDB's own call; not in the store contract)
        store._committed.clear()


def expiry(n: int, folder: Path, loop, start_ms: int) -> float:
    spec = parse_topology({"sow": [{"topic": "hot_exp", "key": ["/id"], "expiration": "60s", "partitions": 1}]}).sow[0]
    engine = SowTopicEngine(spec)
    store = open_partition_store("rocksdb", str(folder / "exp"), engine.indexes)
    engine.attach(0, store)
    records = [InputMessage("hot_exp", 0, i, None, orjson.dumps({"id": i, "px": i * 0.5, "side": "BS"[i % 2], "desk": f"d{i % 40}"}), None,
                            start_ms + i // 10) for i in range(n)]
    for c in range(0, n, CYCLE):
        engine.handle(records[c:c + CYCLE], start_ms, [])
        store.commit()
    store._committed.clear()  # expiring records are old: not in the cache of recent ones
    now = start_ms + 60_000 + n // 10 + 1
    chunks, left = [], n
    while left:
        began = time.thread_time()
        out = _Batch(loop)
        done = sum(engine.expire_due(0, now, out, CHUNK)[0] for _ in range(CYCLE // CHUNK))
        store.commit()
        if not done:
            break
        left -= done
        chunks.append((time.thread_time() - began) / done * 1e6)
        serve_reports(loop)
    store.close()
    return statistics.median(chunks)


def plain_loop(messages: list[InputMessage], folder: Path) -> float:
    """bench/ingest.py's limit loop body, in-process, without produce."""
    from rocksdict import Options, Rdict, WriteBatch

    from processor.core.merge import diff, merge

    options = Options(raw_mode=True)
    options.create_if_missing(True)
    db = Rdict(str(folder / "plain"), options)
    loads, dumps = orjson.loads, orjson.dumps
    delta_topic = messages[0].topic.split(".")[0] + ".delta"
    chunks = []
    for start in range(0, len(messages), CYCLE):
        began = time.thread_time()
        batch, staged = WriteBatch(raw_mode=True), {}
        cycle = messages[start:start + CYCLE]
        for msg in cycle:
            key = msg.key
            record = loads(msg.value)
            old = staged.get(key)
            if old is None:
                raw = db.get(key)
                old = loads(raw) if raw is not None else None
            new = merge(old, record) if msg.topic == delta_topic else record
            changes = diff(old, new, KEY_PATHS)
            staged[key] = new
            value = dumps(new)
            batch.put(key, value)
            dumps(changes)
        db.write(batch)
        chunks.append((time.thread_time() - began) / len(cycle) * 1e6)
    db.close()
    return statistics.median(chunks)


def plain_expiry(n: int, folder: Path, producer) -> float:
    """The least an expiry can cost in Python here: rocksdict's range scan of an expiry index whose
    entries carry the record, the three messages with their five headers (`.sow` tombstone, `.diff`
    and `EXP.` with the last record, and its sow-topic), the two deletes in a WriteBatch. No event-ID counter, no
    staging, no checks."""
    from rocksdict import Options, Rdict, ReadOptions, WriteBatch

    options = Options(raw_mode=True)
    options.create_if_missing(True)
    db = Rdict(str(folder / "plain_exp"), options)
    be64 = struct.Struct(">Q")
    base = int(time.time() * 1000)
    for c in range(0, n, CYCLE):
        batch = WriteBatch(raw_mode=True)
        for i in range(c, min(n, c + CYCLE)):
            kb = b'["hot_exp",%d]' % i
            raw = struct.pack(">qqq", i, base + i, base) + orjson.dumps({"id": i, "px": i * 0.5, "side": "BS"[i % 2], "desk": f"d{i % 40}"})
            batch.put(b"r" + kb, raw)
            batch.put(b"x" + be64.pack(base + i) + kb, raw)
        db.write(batch)
    produce, poll = producer.produce, getattr(producer, "poll", None)
    upper = b"x" + be64.pack(base + n + 1)
    start, seq, chunks = b"x", 0, []
    while True:
        began = time.thread_time()
        read = ReadOptions()
        read.set_iterate_upper_bound(upper)
        batch, done = WriteBatch(raw_mode=True), 0
        for k, v in db.items(from_key=start, read_opt=read):
            kb = k[9:]
            seq += 1
            headers = [("sow-key", kb), ("sow-op", b"expire"), ("sow-seq", b"%d" % seq),
                       ("sow-expires-at", b"%d" % be64.unpack_from(k, 1)[0]), ("sow-actual-expiry", b"%d" % base)]
            last = v[24:]
            produce("hot_exp.sow", None, kb, 0, None, None, 0, headers)
            produce("hot_exp.diff", last, kb, 0, None, None, 0, headers)
            produce("EXP.hot_exp", last, kb, 0, None, None, 0, [*headers, ("sow-topic", b"hot_exp")])
            batch.delete(k)
            batch.delete(b"r" + kb)
            done += 1
            if done == CYCLE:
                start = k + b"\x00"
                break
        db.write(batch)
        if not done:
            break
        chunks.append((time.thread_time() - began) / done * 1e6)
        if poll is not None:
            poll(0)
        if done < CYCLE:
            break
    db.close()
    return statistics.median(chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=200_000, help="inputs (default 200000)")
    parser.add_argument("-k", type=int, default=20_000, help="distinct keys (default 20000)")
    parser.add_argument("--deltas", type=float, default=0.3, help="share of delta publishes (default 0.3)")
    parser.add_argument("--expiries", type=int, default=100_000, help="records expired (default 100000)")
    parser.add_argument("--produce", action="store_true", help="produce to a real broker ($KAFKA_BOOTSTRAP, else embedded)")
    parser.add_argument("--sow", type=int, default=0, help="records of other keys in the SOW, on disk, before the inputs (default 0)")
    parser.add_argument("--only", choices=["ingest", "expiry", "plain", "plain-expiry", "setup"], default=None,
                        help="one measurement, or only making the inputs (setup): for instruction counts")
    args = parser.parse_args()
    start_ms = int(time.time() * 1000) - 3_600_000
    messages = inputs("hot", args.n, args.k, args.deltas, start_ms) if args.only != "expiry" else []
    if args.only == "setup":
        return
    folder = Path(tempfile.mkdtemp(prefix="ksow-hotpath-"))
    gc.freeze()
    gc.disable()  # as in the worker's cycles
    try:
        if args.produce:
            from bench.common import create_topics, kafka_bootstrap
            from processor.kafka.clients import make_producer

            with kafka_bootstrap() as bootstrap:
                create_topics(bootstrap, {t: (PARTITIONS, {}) for t in ("hot.sow", "hot.diff", "hot_exp.sow", "hot_exp.diff", "EXP.hot_exp")})
                producer = make_producer(bootstrap, **{"linger.ms": 50})
                results = measure(args, messages, folder, output_buffer(producer), start_ms)
                producer.flush(60)
        else:
            results = measure(args, messages, folder, output_buffer(None), start_ms)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    where = "produced to Kafka" if args.produce else "producer doing nothing"
    for name, us in results.items():
        print(f"  {name:<12} {us:8.2f} us a record (thread CPU, median of {CYCLE:,}-record chunks; {where})")
    if len(results) == 4:
        print(f"hotpath: input {results['input']:.2f} us, expiry {results['expiry']:.2f} us, plain loop {results['plain']:.2f} us, "
              f"plain expiry {results['plain expiry']:.2f} us, ratio {results['plain'] / results['input']:.2f}, "
              f"expiry ratio {results['plain expiry'] / results['expiry']:.2f}")


def measure(args, messages, folder: Path, loop, start_ms: int) -> dict[str, float]:
    results: dict[str, float] = {}
    if args.only in (None, "ingest"):
        results["input"] = ingest(messages, "hot", folder, loop, args.sow)
    if args.only in (None, "expiry"):
        results["expiry"] = expiry(args.expiries, folder, loop, start_ms)
    if args.only in (None, "plain"):
        results["plain"] = plain_loop(messages, folder)
    if args.only in (None, "plain-expiry"):
        results["plain expiry"] = plain_expiry(args.expiries, folder, loop.producer)
    return results


if __name__ == "__main__":
    main()
