"""Expiry benchmark (issue 3): N records whose instants fall in one 60 s window, expired by a worker
while it also ingests a concurrent publish stream; the same stream again with nothing expiring.

    python bench/expiry.py [--records 1000000] [--window 60] [--stream 100000] [--passes 3] [--workers 1] [--loaded-control] [--plain]

Phase 1 loads N records into the `exp` SOW topic with per-message lifetimes chosen so that their
instants spread uniformly over [W, W + window] (W: a moment after the load is applied). At W a
backlog of `--stream` records is published to a second topic `load` (no expiration) and the worker
drains it while the expiries fall due; then another, `--passes` times in all, each timed from its
first message to its last `.diff` event (the stream's rate: the median of theirs). Lateness is
`sow-actual-expiry - sow-expires-at` from every message on `EXP.exp`. The same stream with no
expiring records runs first (its rate also sizes the time left for the load). `--workers N` runs
`ksow up --workers N` (N processes in one group). While the stream runs, the workers'
`ksow_loop_seconds_total` (from their /metrics) says where their loop threads' time went, by step,
in seconds a second, and what of it expiry took (each working step with expiry less the same step
without, scaled by the ratio; while the loop thread limits the stream, the ratio is about 1 less
that). From the stream's end to the window's, only expiries run: the bench prints the
cores the worker's processes and the local Kafka broker (a `kafka.Kafka` JVM on this machine, if
there is one) used then, and the CPU an expiry cost each over what they use idle (measured for 5 s
after run 1's stream): what expiry asks of a deployment. After the window the bench reads the
workers' `ksow_expiry_lateness_seconds` too, the histogram an operator watches, and prints the
bucket 99% of their sweeps fall in beside the events' own p99.

`--loaded-control` runs the stream once more over the same N records, loaded the same way and
waited for as long, but with instants an hour later, so that none expires while it runs: it tells
what expiring costs the stream from what holding N more records in the SOW does (the stores
larger, RocksDB's background work after the load). The last line keeps counting from the stream
with nothing loaded, as issue 3 asks.

`--plain` runs both phases again with a plain loop in place of the worker, in the same run: one
process, confluent-kafka + orjson + rocksdict, a transaction a cycle (200 ms) with the input
offsets, each input (full publishes here) written to rocksdict and told on `.sow` and on `.diff`
(its diff), and each expiry found by a range scan of an expiry index and told by the three
messages of the contract with their headers (`.sow` tombstone, `.diff`, `EXP.`), deleted by two
deletes. No ordering, no event-ID floor, no views,
errors or capacity: what these libraries cost on this machine for the same outputs, so the worker's
ratio can be read against the ratio a Python process reaches at all here.

With `--workers N` (N > 1) the stream with nothing expiring also runs on one worker process: N
processes that share the cores with a local broker may apply it slower than one, and the ratio
then counts from the faster of the two, so that it cannot rise by slowing its baseline.

Last line: `expiry: p99 lateness X ms, throughput ratio R` (R = stream rec/s with expiration / the
best without; with --plain, the plain loop's pair is on the line before it).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import random
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import orjson
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    admin, create_topics, kafka_bootstrap, local_broker_cpu_seconds, log, publish, publisher, tree_cpu_seconds, unique_name, wait_for_count,
    wait_for_topic)
from processor.core.keys import KeySpec  # noqa: E402
from processor.kafka.clients import make_consumer, topic_configs  # noqa: E402
from processor.runners.faust.metrics import LOOP_STEPS as STEPS  # noqa: E402
from processor.topology import parse_topology  # noqa: E402

PARTITIONS = 4
PASSES = 3  # times the stream goes in each run (its rate: their median)


def start_worker(bootstrap: str, topo: Path, tmp: Path, workers: int, web_port: int, group: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "processor.cli", "up", "--bootstrap", bootstrap, "--topology", str(topo),
            "--group", group, "--data-dir", str(tmp / "data"), "--loglevel", "warning", "--workers", str(workers),
            "--web-port", str(web_port)]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(tmp / "worker.log", "wb"))


def free_ports(n: int) -> int:
    """The first of n consecutive free ports (worker i of `ksow up --workers n` listens on port + i)."""
    rnd = random.Random()
    while True:
        base = rnd.randrange(20000, 60000)
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + n):
                    held.enter_context(socket.create_server(("127.0.0.1", port)))
            return base
        except OSError:
            continue


def scrape(port: int, workers: int) -> list[str]:
    """The lines of every worker's /metrics (a worker that does not answer is warned about)."""
    lines: list[str] = []
    for i in range(workers):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port + i}/metrics", timeout=10) as response:
                lines += response.read().decode().splitlines()
        except OSError as exc:
            log(f"warning: no metrics from worker {i}: {exc}")
    return lines


def loop_seconds(port: int, workers: int) -> Counter:
    """Seconds the workers' loop threads spent in each step so far (`ksow_loop_seconds_total`)."""
    total: Counter = Counter()
    for line in scrape(port, workers):
        if line.startswith('ksow_loop_seconds_total{step="'):
            labels, value = line.rsplit(" ", 1)
            total[labels.split('"')[1]] += float(value)
    return total


def sweep_lateness(port: int, workers: int, topic: str) -> Counter:
    """Sweeps of `topic` by upper bound of their lateness, cumulative, over the workers: the
    buckets of `ksow_expiry_lateness_seconds`, what an operator would see."""
    buckets: Counter = Counter()
    for line in scrape(port, workers):
        if line.startswith("ksow_expiry_lateness_seconds_bucket{") and f'topic="{topic}"' in line:
            labels, value = line.rsplit(" ", 1)
            buckets[float(labels.split('le="')[1].split('"')[0])] += float(value)
    return buckets


def bucket_of(buckets: Counter, share: float) -> float:
    """The smallest upper bound under which `share` of the observations lie."""
    total = buckets[float("inf")]
    return next(le for le in sorted(buckets) if buckets[le] >= share * total)


def wait_for_group(bootstrap: str, group: str, members: int, alive, timeout: float = 120) -> None:
    """The workers of a pool join one by one, and each join moves partitions between them (seconds
    without inputs applied): wait until the group is stable with all of them before anything is timed."""
    from confluent_kafka import ConsumerGroupState, KafkaException

    client = admin(bootstrap)
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = client.describe_consumer_groups([group])[group].result()
            if found.state == ConsumerGroupState.STABLE and len(found.members) == members:
                return
        except KafkaException:  # the group may not exist yet
            pass
        if not alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the workers did not settle in group {group}")
        time.sleep(0.5)


def records(topic: str, n: int, offset: int = 0):
    keys = KeySpec(topic, ("/id",))
    for i in range(offset, offset + n):
        rec = {"id": i, "px": i * 0.5, "side": "BS"[i % 2], "desk": f"d{i % 40}"}
        yield keys.sow_key(rec).encode(), orjson.dumps(rec)


# the plain loop ----------------------------------------------------------------------------------
_BE64 = struct.Struct(">Q")
CYCLE_S = 0.2  # a transaction a cycle, as the worker's while records expire (KSOW_TIMED_CYCLE_MS)
CHUNK = 250  # inputs between two looks at the expiry clock, as the worker's


def plain_worker(bootstrap: str, exp: str, load: str, data_dir: str) -> None:
    """The plain loop (see the module docstring), until SIGTERM. A stored value is the record's
    instant (8 bytes, 0: none), its partition (a byte), then its JSON; the expiry index
    `x<instant><key>` holds the same."""
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition
    from rocksdict import Options, Rdict, ReadOptions, WriteBatch

    from processor.core.merge import diff
    from processor.kafka.clients import make_producer

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    group = unique_name("plain")
    consumer = make_consumer(bootstrap, group, **{"enable.partition.eof": False})
    consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t in (exp, load) for p in range(PARTITIONS)])
    producer = make_producer(bootstrap, **{"transactional.id": group, "linger.ms": 50})
    producer.init_transactions(60)
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    db = Rdict(data_dir, options)
    loads, dumps, produce, pack, unpack = orjson.loads, orjson.dumps, producer.produce, _BE64.pack, _BE64.unpack_from
    outputs = {t: (f"{t}.sow", f"{t}.diff") for t in (exp, load)}
    expired_topic, origin = f"EXP.{exp}", ("sow-topic", exp.encode())
    exp_sow, exp_diff = outputs[exp]
    key_paths = (("id",),)
    counters = [0] * PARTITIONS
    due_from = 0  # no committed expiry entry is older (entries swept are deleted by the commit)
    expired, sweep_s = 0, 0.0  # told on stderr at the end: what an expiry cost this loop's thread
    while not stop:
        producer.begin_transaction()
        began = time.monotonic()
        batch = WriteBatch(raw_mode=True)
        staged: dict[bytes, bytes | None] = {}  # key -> stored value (None: removed) this cycle
        offsets: dict[tuple[str, int], int] = {}
        swept_to = b""  # the last expiry entry this cycle handled
        while time.monotonic() - began < CYCLE_S and not stop:
            for msg in consumer.consume(CHUNK, 0.01):
                if msg.error():
                    continue
                topic, p, key = msg.topic(), msg.partition(), msg.key()
                record = loads(msg.value())
                old_raw = staged[key] if key in staged else db.get(b"r" + key)
                old = None if old_raw is None else loads(old_raw[9:])
                now = int(time.time() * 1000)
                instant = 0
                for name, value in msg.headers() or ():
                    if name == "sow-expiration":  # as this bench writes them: `<n>ms`
                        instant = now + int(value[:-2])
                counters[p] += 1
                headers = [("sow-key", key), ("sow-op", b"insert" if old is None else b"update"), ("sow-seq", b"%d" % (counters[p] << 10 | p))]
                if instant:
                    headers.append(("sow-expires-at", b"%d" % instant))
                value = dumps(record)
                stored = pack(instant) + bytes((p,)) + value
                if old_raw is not None and (old_instant := unpack(old_raw)[0]):
                    batch.delete(b"x" + pack(old_instant) + key)
                batch.put(b"r" + key, stored)
                if instant:
                    batch.put(b"x" + pack(instant) + key, stored)
                staged[key] = stored
                sow, diffs = outputs[topic]
                produce(sow, value, key, p, None, None, 0, headers)
                produce(diffs, dumps(diff(old, record, key_paths)), key, p, None, None, 0, headers)
                offsets[(topic, p)] = msg.offset() + 1
            # the sweep: what is due in the committed index, after what this cycle handled already
            swept_at = time.perf_counter()
            now = int(time.time() * 1000)
            read = ReadOptions()
            read.set_iterate_upper_bound(b"x" + pack(now + 1))
            for k, stored in db.items(from_key=swept_to + b"\x00" if swept_to else b"x" + pack(due_from), read_opt=read):
                swept_to = k
                key = k[9:]
                if staged.get(key, stored) != stored:
                    continue  # updated or removed this cycle
                p = stored[8]
                counters[p] += 1
                last = stored[9:]
                headers = [("sow-key", key), ("sow-op", b"expire"), ("sow-seq", b"%d" % (counters[p] << 10 | p)),
                           ("sow-expires-at", b"%d" % unpack(stored)[0]), ("sow-actual-expiry", b"%d" % now)]
                produce(exp_sow, None, key, p, None, None, 0, headers)
                produce(exp_diff, last, key, p, None, None, 0, headers)
                produce(expired_topic, last, key, p, None, None, 0, [*headers, origin])
                batch.delete(k)
                batch.delete(b"r" + key)
                staged[key] = None
                expired += 1
            sweep_s += time.perf_counter() - swept_at
        if offsets:
            producer.send_offsets_to_transaction([TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                                                 consumer.consumer_group_metadata(), 30)
        producer.commit_transaction(60)
        db.write(batch)
        if swept_to:
            due_from = unpack(swept_to, 1)[0]
    db.close()
    consumer.close()
    print(json.dumps({"expired": expired, "sweep_s": sweep_s}), file=sys.stderr)


def lateness(bootstrap: str, topic: str, n: int, timeout: float = 600) -> tuple[list[tuple[int, int]], int]:
    """(instant, lateness) of the messages on `topic` (read_committed) once n are there or the
    timeout has passed, and how many distinct keys they carry."""
    from confluent_kafka import TopicPartition

    consumer = make_consumer(bootstrap)
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        out, keys = [], set()
        deadline = time.monotonic() + timeout
        settle = None  # after the n-th: a little longer, so a repeated event would show
        while (settle is None or time.monotonic() < settle) and time.monotonic() < deadline:
            if settle is None and len(out) >= n:
                settle = time.monotonic() + 3
            for msg in consumer.consume(10_000, 0.5):
                if msg.error() is None:
                    h = dict(msg.headers())
                    instant = int(h["sow-expires-at"])
                    out.append((instant, int(h["sow-actual-expiry"]) - instant))
                    keys.add(msg.key())
        return out, len(keys)
    finally:
        consumer.close()


def start_plain(bootstrap: str, topology: dict, exp: str, load: str, tmp: Path) -> subprocess.Popen:
    """The plain loop in its own process, on the topics the worker would make for `topology`."""
    topics: dict = {}
    for spec in parse_topology(topology).sow:
        topics |= topic_configs(spec)
    create_topics(bootstrap, topics)
    spec = json.dumps({"bootstrap": bootstrap, "exp": exp, "load": load, "data_dir": str(tmp / "plain-db")})
    return subprocess.Popen([sys.executable, __file__, "--plain-worker", spec], stdout=subprocess.DEVNULL, stderr=open(tmp / "plain.log", "wb"))


def run(bootstrap: str, n: int, window: float, stream: int, workers: int, load_rate: float = 0.0, plain: bool = False,
        passes: int = PASSES, due_later: bool = False) -> dict:
    """One run: with n > 0, n expiring records loaded at about `load_rate` records a second first;
    with `plain`, by the plain loop instead of `ksow up`; with `due_later`, the same records and
    the same wait, but their instants an hour after the window (none expires in the run)."""
    with_expiry = n > 0 and not due_later
    exp, load = unique_name("exp"), unique_name("load")
    tmp = Path(tempfile.mkdtemp(prefix="ksow-bench-expiry-"))
    topology = {"sow": [
        {"topic": exp, "key": ["/id"], "partitions": PARTITIONS, "expiration": "enabled"},
        {"topic": load, "key": ["/id"], "partitions": PARTITIONS},
    ]}
    if plain:
        port = 0
        worker = start_plain(bootstrap, topology, exp, load, tmp)
    else:
        topo = tmp / "t.yaml"
        topo.write_text(yaml.safe_dump(topology))
        port = free_ports(workers)
        group = unique_name("g")
        worker = start_worker(bootstrap, topo, tmp, workers, port, group)
    alive = lambda: worker.poll() is None  # noqa: E731
    try:
        wait_for_topic(bootstrap, f"EXP.{exp}", alive)
        if not plain:
            wait_for_group(bootstrap, group, workers, alive)
        result: dict = {}
        if n:
            # Instants in [W, W + window]; W leaves time to load N records first.
            load_s = max(20.0, n / load_rate)
            start_at = time.time() + load_s
            rnd = random.Random(1)
            instants = []
            from processor.kafka.clients import produce

            producer = publisher(bootstrap)
            began = time.time()
            for key, value in records(exp, n):
                instant = start_at + rnd.uniform(0, window) + (3600 if due_later else 0)
                instants.append(instant)
                lifetime_ms = max(1, int((instant - time.time()) * 1000))
                produce(producer, exp, value, key, headers=[("sow-expiration", f"{lifetime_ms}ms".encode())])
            producer.flush(120)
            log(f"published {n:,} expiring records in {time.time() - began:.1f}s")
            wait_for_count(bootstrap, f"{exp}.sow", PARTITIONS, n, 3600, alive=alive)
            applied = time.time()
            result["load_s"] = applied - began
            if applied > start_at:
                log(f"warning: the load took {applied - began:.0f}s, past the window start: raise the margin or lower --records")
            time.sleep(max(0.0, start_at - time.time()))
        # The stream's first record goes before the clock starts, through the producer that then
        # sends the rest: it waits for the producer's ID (0.5-1 s, `publisher`), a delay that counted
        # in both runs and drew their ratio towards 1 (the rates a worker applies the stream at,
        # read from its consumer, gave 0.61-0.74 where the ratio said 0.65-0.84).
        stream_producer = publisher(bootstrap)
        publish(bootstrap, ((load, k, v) for k, v in records(load, 1)), stream_producer)
        wait_for_count(bootstrap, f"{load}.diff", PARTITIONS, 1, 60, alive=alive)
        before = loop_seconds(port, workers) if port else Counter()
        t0 = time.time()
        # The stream goes `passes` times (new records each time), one after the other, and its rate is
        # the median of theirs: one pass of 100,000 records lasts ~2 s, and a single pass's rate
        # without expiry varied by a fifth from run to run (52,672-61,858 rec/s).
        rates = []
        for i in range(passes):
            began = time.time()
            publish(bootstrap, ((load, k, v) for k, v in records(load, stream, 1 + i * stream)), stream_producer)
            done = wait_for_count(bootstrap, f"{load}.diff", PARTITIONS, 1 + (i + 1) * stream, 3600, alive=alive)
            rates.append(stream / (done - began))
        result["stream_rate"], result["stream_rates"] = statistics.median(rates), rates
        if port:  # where the loop threads' time went while the stream ran, per second of it and worker
            spent, elapsed = loop_seconds(port, workers) - before, time.time() - t0
            result["steps"] = {step: spent[step] / elapsed / workers for step in STEPS}
        if with_expiry:
            # Read once the window is over: a reader of `EXP.` running during it would take CPU from
            # the worker on this machine (the lateness comes from the events' headers either way).
            # Until then nothing but expiries runs: what they cost the worker and the broker.
            instants.sort()
            result["cpu"] = cpu_while(worker.pid, start_at + window, instants)
            events, distinct = lateness(bootstrap, f"EXP.{exp}", n, 3600)
            late = sorted(d for _, d in events)
            if len(late) != n or distinct != n:
                log(f"error: {len(late):,} expiry events for {distinct:,} distinct records, {n:,} expected")
            result.update(n=len(late), distinct=distinct, p50=late[len(late) // 2], p99=late[int(len(late) * 0.99)], max=late[-1])
            # Due while the stream ran, or after it (only expiries then): where the tail comes from.
            during = sorted(d for at, d in events if at <= done * 1000)
            after = sorted(d for at, d in events if at > done * 1000)
            result["split"] = {name: (len(part), part[int(len(part) * 0.99)], part[-1]) for name, part in (("during", during), ("after", after)) if part}
            if port:
                result["sweeps"] = sweep_lateness(port, workers, exp)
        else:
            result["cpu"] = cpu_while(worker.pid, time.time() + IDLE_S, [])  # what the same span costs idle
        if plain:  # its last line: what its sweeps cost
            stop(worker)
            result.update(json.loads((tmp / "plain.log").read_text().splitlines()[-1]))
        return result
    finally:
        stop(worker)
        shutil.rmtree(tmp, ignore_errors=True)


IDLE_S = 5.0  # the span over which run 1 measures what the worker and the broker cost with nothing to do


def cpu_while(pid: int, until: float, instants: list[float]) -> dict:
    """Cores that the process tree of `pid` and the local broker use from now until `until`, and
    how many of the sorted expiry `instants` fall in that span."""
    began, worker, broker = time.time(), tree_cpu_seconds(pid), local_broker_cpu_seconds()
    time.sleep(max(0.0, until - began))
    ended, worker_end, broker_end = time.time(), tree_cpu_seconds(pid), local_broker_cpu_seconds()
    span = ended - began
    return {"span": span, "expiries": bisect.bisect(instants, ended) - bisect.bisect(instants, began),
            "worker": (worker_end - worker) / span if span and worker is not None and worker_end is not None else None,
            "broker": (broker_end - broker) / span if span and broker is not None and broker_end is not None else None}


def cpu_line(name: str, with_exp: dict, without: dict) -> str:
    """What the expiries alone cost `name` and the local broker, over their idle cost (run 1)."""
    cpu, idle = with_exp["cpu"], without["cpu"]
    if cpu["span"] < 3 or not cpu["expiries"] or cpu["worker"] is None:
        return f"  {name}: the stream ran to the end of the window, no span with expiries alone to measure"
    per_expiry = {k: (cpu[k] - (idle[k] or 0.0)) * cpu["span"] / cpu["expiries"] * 1e6 for k in ("worker", "broker") if cpu[k] is not None}
    line = (f"  CPU while only records expired ({cpu['span']:.0f}s, {cpu['expiries']:,} expiries): {name} {cpu['worker']:.2f} cores "
            f"({idle['worker'] or 0:.2f} idle), {per_expiry['worker']:.1f} us an expiry")
    if "broker" in per_expiry:
        line += f"; local broker {cpu['broker']:.2f} cores ({idle['broker'] or 0:.2f} idle), {per_expiry['broker']:.1f} us an expiry"
    return line


def stop(worker: subprocess.Popen) -> None:
    worker.terminate()
    try:
        worker.wait(60)
    except subprocess.TimeoutExpired:
        worker.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--stream", type=int, default=100_000)
    parser.add_argument("--passes", type=int, default=PASSES, help="times the stream is sent, one after the other (the rate is their median)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes (ksow up --workers)")
    parser.add_argument("--loaded-control", action="store_true",
                        help="run the stream once more over the same N records loaded, none of them due in the run")
    parser.add_argument("--plain", action="store_true", help="run both phases with the plain loop too, after the worker")
    parser.add_argument("--plain-worker", help=argparse.SUPPRESS)  # the plain loop's own process
    args = parser.parse_args()
    if args.plain_worker:
        plain_worker(**json.loads(args.plain_worker))
        return
    with kafka_bootstrap() as bootstrap:
        log(f"run 1: the stream, nothing expiring ({args.workers} worker process(es))")
        without = run(bootstrap, 0, args.window, args.stream, args.workers, passes=args.passes)
        # N processes may apply the stream slower than one where they share the cores with the
        # broker: the ratio then counts from whichever applied it faster.
        alone = None
        if args.workers > 1:
            log("run 1b: the stream, nothing expiring (1 worker process)")
            alone = run(bootstrap, 0, args.window, args.stream, 1, passes=args.passes)
        # Loading records that carry an expiry entry runs at ~0.7x the stream's rate here (measured):
        # half of it leaves the load time to end before the window starts.
        load_rate = without["stream_rate"] / 2
        log(f"run 2: expiring records + the same stream (load margin {args.records / load_rate:.0f}s)")
        with_exp = run(bootstrap, args.records, args.window, args.stream, args.workers, load_rate, passes=args.passes)
        loaded = None
        if args.loaded_control:
            log("run 2b: the same records loaded, due an hour later, + the same stream")
            loaded = run(bootstrap, args.records, args.window, args.stream, args.workers, load_rate, passes=args.passes, due_later=True)
        if args.plain:
            log("run 3: the plain loop, the stream with nothing expiring")
            plain_without = run(bootstrap, 0, args.window, args.stream, 1, plain=True, passes=args.passes)
            log("run 4: the plain loop, expiring records + the same stream (the same load margin)")
            plain_with = run(bootstrap, args.records, args.window, args.stream, 1, load_rate, plain=True, passes=args.passes)
    r = with_exp["stream_rate"] / without["stream_rate"]
    best = max(without["stream_rate"], alone["stream_rate"] if alone else 0.0)
    print(f"{with_exp['n']:,} records expired, instants spread over {args.window:.0f}s (load took {with_exp['load_s']:.0f}s), "
          f"{args.workers} worker process(es)")
    print(f"  lateness (actual expiry - instant): p50 {with_exp['p50']} ms, p99 {with_exp['p99']} ms, max {with_exp['max']} ms")
    print("  of the records due while the stream ran | after it: " + " | ".join(
        f"{count:,} p99 {p99} ms max {top} ms" for count, p99, top in with_exp["split"].values()))
    print(f"  concurrent stream of {args.stream:,} records, {args.passes} passes (median): {with_exp['stream_rate']:,.0f} rec/s with expiry "
          f"({', '.join(f'{x:,.0f}' for x in with_exp['stream_rates'])}), {without['stream_rate']:,.0f} rec/s without "
          f"({', '.join(f'{x:,.0f}' for x in without['stream_rates'])})")
    if alone:
        print(f"  the same stream on one worker process, nothing expiring: {alone['stream_rate']:,.0f} rec/s "
              f"({', '.join(f'{x:,.0f}' for x in alone['stream_rates'])}); with expiry on {args.workers} against "
              f"without on {args.workers}: {r:.2f}, against without on one: {with_exp['stream_rate'] / alone['stream_rate']:.2f}")
    if loaded:
        print(f"  the same stream over the same {args.records:,} records loaded, none due: {loaded['stream_rate']:,.0f} rec/s "
              f"({', '.join(f'{x:,.0f}' for x in loaded['stream_rates'])}); with expiry against it: "
              f"{with_exp['stream_rate'] / loaded['stream_rate']:.2f}; it against nothing loaded: {loaded['stream_rate'] / best:.2f}")
    print(f"  the loop while the stream ran, seconds a second (without{' | loaded, none due' if loaded else ''} | with expiry): " + ", ".join(
        step + " " + " | ".join(f"{r['steps'][step]:.2f}" for r in (without, loaded, with_exp) if r) for step in STEPS))
    if loaded:
        idle, busy = without["cpu"], loaded["cpu"]
        print(f"  cores used in the {IDLE_S:.0f}s after the stream, nothing loaded | loaded: worker {idle['worker'] or 0:.2f} | "
              f"{busy['worker'] or 0:.2f}, local broker {idle['broker'] or 0:.2f} | {busy['broker'] or 0:.2f}")
    rate = args.records / args.window  # expiries a second, shared by the workers

    def per_expiry(seconds: float) -> float:
        """Microseconds an expiry, from one worker's loop seconds a second (each expires its share)."""
        return seconds * args.workers / rate * 1e6

    print(f"  the sweep step while the stream ran: {per_expiry(with_exp['steps']['sweep']):.1f} us "
          f"an expiry, at {rate:,.0f} expiries a second")
    # Each working step (all but consume, which waits for inputs) with expiry less the same step
    # without, scaled by the ratio (the inputs' own share of it at the rate they ran): the loop's time
    # that expiry took. While the loop thread is what limits the stream (busy nearly 1 s a second in
    # both runs), the ratio is about 1 less this.
    working = [step for step in STEPS if step != "consume"]
    busy = [sum(result["steps"][step] for step in working) for result in (without, with_exp)]
    share = {step: with_exp["steps"][step] - without["steps"][step] * r for step in working}
    print(f"  the loop's time that expiry took while the stream ran: {sum(share.values()):.2f} s a second, "
          f"{per_expiry(sum(share.values())):.1f} us an expiry ("
          + ", ".join(f"{step} {per_expiry(share[step]):.1f}" for step in working)
          + f"); the loop was busy {busy[0]:.2f} | {busy[1]:.2f} s a second")
    print(cpu_line("worker", with_exp, without))
    sweeps = with_exp.get("sweeps")
    if sweeps and sweeps[float("inf")]:
        print(f"  the workers' ksow_expiry_lateness_seconds: {sweeps[float('inf')]:,.0f} sweeps that expired records, "
              f"99% of them within {bucket_of(sweeps, 0.99)} s, all within {bucket_of(sweeps, 1.0)} s (its buckets)")
    if args.plain:
        print(f"  plain loop: {plain_with['n']:,} records expired, lateness p50 {plain_with['p50']} ms, p99 {plain_with['p99']} ms, "
              f"max {plain_with['max']} ms; stream {plain_with['stream_rate']:,.0f} rec/s with expiry, "
              f"{plain_without['stream_rate']:,.0f} rec/s without; its sweeps (scan, three messages, deletes staged) "
              f"{plain_with['sweep_s'] / max(1, plain_with['expired']) * 1e6:.1f} us an expiry over the whole run")
        print(cpu_line("plain loop", plain_with, plain_without))
        print(f"plain loop: p99 lateness {plain_with['p99']} ms, throughput ratio {plain_with['stream_rate'] / plain_without['stream_rate']:.2f}")
    print(f"expiry: p99 lateness {with_exp['p99']} ms, throughput ratio {with_exp['stream_rate'] / best:.2f}")


if __name__ == "__main__":
    main()
