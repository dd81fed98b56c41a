"""Fan-out benchmark (issue 5): 100 filtered delta subscriptions over a live stream of updates.

    python bench/fanout.py [--subscriptions 100] [--keys 1000] [--rate 1000] [--seconds 20]

A worker keeps the SOW; a publisher sends full-record updates at a fixed rate (each carrying its
publish time); one client holds all subscriptions over one shared consumer (Client.subscribe_many),
each a sow_and_delta_subscribe with its own filter. Printed: publish -> delivery latency p50/p99
over every delivered event; in the same run, the baseline latency of a bare consumer of
`<topic>.sow` (no subscription logic); and the bytes the deltas carried against the full records
the same events would have carried. Last line: `fanout: p50 X ms, p99 Y ms, delta bytes Z% of full`.
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import kafka_bootstrap, log, unique_name  # noqa: E402
from processor.client.sow_client import Client, ClientError
from processor.kafka.clients import make_consumer
from processor.topology import load_topology  # noqa: E402

SYMBOLS = [f"S{i}" for i in range(20)]
NOTES = "standing instruction: work the order passively, no crossing with internal flow, report fills hourly " * 2


def full(i: int, rnd: random.Random) -> dict:
    return {"id": i, "sym": SYMBOLS[i % len(SYMBOLS)], "px": round(rnd.uniform(90, 110), 2), "qty": rnd.randrange(1, 1000) * 100,
            "desk": f"desk{i % 7}", "notes": NOTES, "ts": time.time()}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _loaded(client: Client, topic: str, keys: int) -> bool:
    try:
        return len(client.query(topic)) >= keys
    except ClientError:  # its topics are not there yet
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--subscriptions", type=int, default=100)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=1000.0, help="updates per second")
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()

    with kafka_bootstrap() as bootstrap:
        topic = unique_name("fan")
        tmp = Path(tempfile.mkdtemp(prefix="ksow-bench-fanout-"))
        path = tmp / "t.yaml"
        path.write_text(yaml.safe_dump({"sow": [{"topic": topic, "key": ["/id"], "partitions": 4}]}))
        worker = subprocess.Popen([sys.executable, "-m", "processor.cli", "up", "--bootstrap", bootstrap, "--topology", str(path),
                                   "--group", f"g-{topic}", "--data-dir", str(tmp / "d"), "--loglevel", "warning"],
                                  stdout=subprocess.DEVNULL, stderr=open(tmp / "worker.log", "wb"))
        try:
            client = Client(bootstrap, load_topology(path))
            rnd = random.Random(1)
            while not _loaded(client, topic, 0):  # the worker creates the topics as it starts
                time.sleep(0.5)
            for i in range(args.keys):
                client.publish(topic, full(i, rnd))
            client.flush()
            while not _loaded(client, topic, args.keys):
                time.sleep(0.5)
            log(f"SOW loaded with {args.keys} records; subscribing {args.subscriptions} filtered delta subscriptions")
            subs = []
            for n in range(args.subscriptions):
                flt = [f"/sym = '{SYMBOLS[n % 20]}'", f"/qty > {(n % 10) * 10_000}", f"/desk IN ('desk{n % 7}', 'desk{(n + 1) % 7}')"][n % 3]
                subs.append({"filter": flt, "delta": True, "no_empties": True})
            feed = client.subscribe_many(topic, subs, sow=True, timeout=5)  # ends 5 s after the stream does
            bare = make_consumer(bootstrap)
            from confluent_kafka import TopicPartition

            from processor.kafka.clients import end_offsets

            bare.assign([TopicPartition(f"{topic}.sow", p, high) for p, (_, high) in end_offsets(bare, f"{topic}.sow", range(4)).items()])

            latencies: list[float] = []
            bare_latencies: list[float] = []
            delta_bytes = full_bytes = events = 0
            state: dict = {}
            done = threading.Event()

            def publish() -> None:
                pub = Client(bootstrap, load_topology(path))
                prng = random.Random(2)
                interval = 1.0 / args.rate
                t_next = time.perf_counter()
                end = time.time() + args.seconds
                while time.time() < end:
                    i = prng.randrange(args.keys)
                    rec = dict(state_full[i], px=round(prng.uniform(90, 110), 2), ts=time.time())
                    if prng.random() < 0.2:
                        rec["qty"] = prng.randrange(1, 1000) * 100
                    state_full[i] = rec
                    pub.publish(topic, rec)
                    t_next += interval
                    delay = t_next - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                pub.flush()
                done.set()

            def bare_reader() -> None:
                while True:
                    msgs = bare.consume(500, 0.2)
                    now = time.time()
                    for m in msgs:
                        if m.error() is None and m.value() is not None:
                            bare_latencies.append((now - orjson.loads(m.value())["ts"]) * 1000)
                    if done.is_set() and not msgs:
                        return

            state_full = {e.record["id"]: e.record for e in client.query(topic)}
            snapshot_events = 0
            threading.Thread(target=publish, daemon=True).start()
            reader = threading.Thread(target=bare_reader, daemon=True)
            reader.start()
            for i, event in feed:
                now = time.time()
                rec = event["record"]
                if event["op"] == "sow":
                    snapshot_events += 1
                    state[rec["id"]] = rec
                    continue
                events += 1
                if "ts" in rec:
                    latencies.append((now - rec["ts"]) * 1000)
                key_id = rec["id"]
                if key_id in state:
                    state[key_id] = {**state[key_id], **rec}
                delta_bytes += len(orjson.dumps(rec))
                full_bytes += len(orjson.dumps(state.get(key_id, rec)))
            reader.join(30)
            bare.close()
            saved = 1 - delta_bytes / full_bytes if full_bytes else 0
            print(f"{args.subscriptions} filtered delta subscriptions on one shared consumer, {args.rate:.0f} updates/s for {args.seconds:.0f}s, {args.keys} keys")
            print(f"  snapshot events {snapshot_events:,}, live events delivered {events:,}")
            print(f"  publish -> delivery latency   p50 {pct(latencies, .5):7.1f} ms   p99 {pct(latencies, .99):7.1f} ms")
            print(f"  baseline: bare .sow consumer  p50 {pct(bare_latencies, .5):7.1f} ms   p99 {pct(bare_latencies, .99):7.1f} ms"
                  f"   (ratio p50 {pct(latencies, .5) / pct(bare_latencies, .5):.2f})")
            print(f"  bytes: deltas {delta_bytes:,} vs full records {full_bytes:,} ({100 * saved:.0f}% saved)")
            print(f"fanout: p50 {pct(latencies, .5):.1f} ms, p99 {pct(latencies, .99):.1f} ms, delta bytes {100 * (1 - saved):.0f}% of full")
        finally:
            worker.terminate()
            worker.wait(60)
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
