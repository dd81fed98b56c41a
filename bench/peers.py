"""Peers benchmark (issue 11): ksow against the Python stream processors on one SOW workload.

    python bench/peers.py [-n 200000] [-k 20000] [--deltas 0.3] [--runs 1] [--only plain,quix,bytewax,ksow]

One broker ($KAFKA_BOOTSTRAP, else the embedded one) and one workload per run: bench/ingest.py's N
inputs over K keys keyed by SowKey, a share of them deltas on `<topic>.delta`, 4 partitions. Then,
one after another, each processor reads the same inputs from the earliest offset, applies them in
the worker's order (by broker timestamp, `<topic>` before `<topic>.delta` on a tie, waiting for an
input not read to its end: bench.common.OrderedInputs), keeps the SOW keyed by SowKey, merges
deltas with processor.core.merge.merge, diffs with processor.core.merge.diff, and writes the merged
record and the diff to two topics of its own:

  plain    bench/ingest.py's limit loop, ordered: confluent-kafka -> orjson -> rocksdict (one
           WriteBatch per batch) -> two produces. No transactions, no changelog.
  quix     Quix Streams 3.x: the two input topics concatenated (Quix then consumes them aligned by
           timestamp), a stateful apply on RocksDB state with its changelog topic, two to_topic
           outputs; Quix's defaults otherwise (at-least-once, commit every 5 s).
  bytewax  Bytewax 0.21: a Kafka source that merges each partition's two inputs in order (its own
           KafkaSource has no alignment across topics), stateful_map keyed by SowKey (in-memory
           state, no recovery configured), two KafkaSink outputs.
  ksow     `python -m processor.cli up` as a subprocess, exactly-once (its default).

Each runs in a child process (its own session): rec/s from the first to the N-th diff seen by a
read_committed reader (steady state; n/a when the first diffs seen are already half of N, as in
tiny runs with a transaction per batch) and from spawn to the N-th diff (wall, with startup), CPU
time of its process tree per record over the steady span, peak RSS of its tree. Then its merged-record
topic is read (read_committed) and the last value of each key compared with the expected SOW, the
fold of the inputs read back from the broker in the same order: a processor whose SOW differs is
FAILED and gets no figures. With --runs R each run has fresh topics, figures are medians, ratios
the median of per-run ratios. Quix Streams and Bytewax come with `pip install -e .[bench]`; a peer
whose package is missing is n/a.
Last line: `peers: ksow X rec/s, quix Q rec/s, bytewax B rec/s, limit L rec/s, ksow/quix R1, ksow/limit R2`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson  # noqa: E402
from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition  # noqa: E402

from bench.common import (  # noqa: E402
    REPO, OrderedInputs, add_workload_arguments, admin, create_topics, delete_topics, fmt, kafka_bootstrap, log, median, publish, ratio,
    tree_cpu_seconds, tree_peak_rss_mb, unique_name,
)
from bench.ingest import (  # noqa: E402
    KEY_PATHS, PARTITIONS, limit_loop, output_topics, topology_yaml, worker_command, workload, workload_topics,
)
from processor.core.merge import diff, merge  # noqa: E402
from processor.kafka.clients import end_offsets, make_consumer, read_until  # noqa: E402

PEERS = ("plain", "quix", "bytewax", "ksow")  # the order they run in
LABELS = {
    "plain": "plain loop (confluent-kafka + orjson + rocksdict)",
    "quix": "Quix Streams (RocksDB state + changelog)",
    "bytewax": "Bytewax (stateful_map, in-memory state)",
    "ksow": "ksow up (exactly-once)",
}
PACKAGES = {"quix": "quixstreams", "bytewax": "bytewax"}


def outputs_of(peer: str, topic: str) -> str:
    """The prefix of a peer's `.sow` and `.diff` topics (the limit loop's are fixed by bench/ingest.py)."""
    return {"plain": f"{topic}.limit", "ksow": topic}.get(peer, f"{topic}.{peer}")


class PeerFailed(Exception):
    """A peer died, stalled or left a wrong SOW: reported as FAILED, the other peers still run."""


# the expected SOW and the verification -----------------------------------------------------------
def expected_sow(bootstrap: str, topic: str) -> dict[bytes, dict]:
    """The fold of the inputs as the broker holds them, in the worker's order: (timestamp, `<topic>`
    before `<topic>.delta`, offset); keys are SowKeys, so each key lives in one partition of each."""
    delta_topic = f"{topic}.delta"
    consumer = make_consumer(bootstrap)
    try:
        ends = {(t, p): high for t in (topic, delta_topic) for p, (_, high) in end_offsets(consumer, t, range(PARTITIONS)).items()}
        consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t, p in ends])
        inputs = [
            (msg.timestamp()[1], msg.topic() == delta_topic, msg.offset(), msg.key(), msg.value())
            for msg in read_until(consumer, ends)
        ]
    finally:
        consumer.close()
    inputs.sort(key=lambda entry: entry[:3])
    sow: dict[bytes, dict] = {}
    for _, is_delta, _, key, value in inputs:
        record = orjson.loads(value)
        sow[key] = merge(sow.get(key), record) if is_delta else record
    return sow


def last_values(bootstrap: str, topic: str) -> dict[bytes, dict]:
    """The last committed value of each key on `topic` (a tombstone removes the key)."""
    consumer = make_consumer(bootstrap, **{"isolation.level": "read_committed"})
    try:
        ends = {(topic, p): high for p, (_, high) in end_offsets(consumer, topic, range(PARTITIONS)).items()}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for _, p in ends])
        out: dict[bytes, dict] = {}
        for msg in read_until(consumer, ends, idle_timeout=300):
            value = msg.value()
            if value is None:
                out.pop(msg.key(), None)
            else:
                out[msg.key()] = orjson.loads(value)
        return out
    finally:
        consumer.close()


def check_sow(expected: dict[bytes, dict], got: dict[bytes, dict]) -> None:
    missing = expected.keys() - got.keys()
    extra = got.keys() - expected.keys()
    wrong = [key for key in expected.keys() & got.keys() if got[key] != expected[key]]
    if missing or extra or wrong:
        example = wrong[0] if wrong else None
        detail = f"; e.g. {example.decode()}: {got[example]} instead of {expected[example]}" if example else ""
        raise PeerFailed(f"wrong SOW: {len(wrong)} keys differ, {len(missing)} missing, {len(extra)} extra "
                         f"of {len(expected)}{detail}")


# measuring one peer -----------------------------------------------------------------------------
def watch(bootstrap: str, diff_topic: str, n: int, process: subprocess.Popen, began: float, timeout: float) -> dict:
    """Count `diff_topic` (read_committed) until it holds n messages, sampling the process tree's
    CPU time when the first and the n-th appear, and its peak RSS at the end."""
    consumer = make_consumer(bootstrap, **{"isolation.level": "read_committed", "enable.partition.eof": False})
    consumer.assign([TopicPartition(diff_topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
    deadline = time.monotonic() + timeout
    count = 0
    first: tuple[float, int, float | None] | None = None
    try:
        while count < n:
            for msg in consumer.consume(10000, 0.05):
                err = msg.error()
                if err is None:
                    count += 1
                elif err.code() != KafkaError._PARTITION_EOF:
                    raise KafkaException(err)
            if count and first is None:
                first = (time.time(), count, tree_cpu_seconds(process.pid))
            if count >= n:
                break
            if process.poll() is not None:
                raise PeerFailed(f"exited with code {process.returncode} after {count} of {n} diffs")
            if time.monotonic() > deadline:
                raise PeerFailed(f"{count} of {n} diffs after {timeout:.0f}s")
        last, cpu_last, rss = time.time(), tree_cpu_seconds(process.pid), tree_peak_rss_mb(process.pid)
    finally:
        consumer.close()
    assert first is not None
    t_first, count_first, cpu_first = first
    steady_records = n - count_first
    # The first diffs a reader sees can be a large share of a small run (a transaction per batch
    # makes a whole batch visible at once): the steady span then measures nothing.
    steady = steady_records >= n / 2 and last > t_first
    return {
        "rate_steady": steady_records / (last - t_first) if steady else None,
        "rate_total": n / (last - began),
        "startup_s": t_first - began,
        "cpu_us": (cpu_last - cpu_first) / steady_records * 1e6 if steady and None not in (cpu_first, cpu_last) else None,
        "rss_mb": rss,
    }


def stop(process: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the peer's session (it was started in its own), SIGKILL it after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def run_peer(peer: str, command: list[str], bootstrap: str, topic: str, n: int, expected: dict, log_path: Path) -> dict:
    """Spawn one peer, measure it until the n-th diff, stop it, verify its SOW."""
    prefix = outputs_of(peer, topic)
    began = time.time()
    with open(log_path, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True,
                                   env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        result = watch(bootstrap, f"{prefix}.diff", n, process, began, timeout=max(300.0, n / 500))
    except PeerFailed as exc:
        log(f"  {peer}: {exc}; its log ({log_path}) ends with:\n{log_path.read_text(errors='replace')[-2000:]}")
        return {"failed": str(exc)}
    finally:
        stop(process)
    try:
        check_sow(expected, last_values(bootstrap, f"{prefix}.sow"))
    except PeerFailed as exc:
        return {"failed": str(exc)}
    return result


def peer_command(peer: str, bootstrap: str, topic: str, n: int, tmp: Path) -> list[str]:
    if peer == "ksow":
        topology = tmp / "topology.yaml"
        topology.write_text(topology_yaml(topic, PARTITIONS))
        return worker_command(bootstrap, topology, unique_name("ksow-bench-peers"), tmp / "ksow-data", None)
    spec = {"bootstrap": bootstrap, "topic": topic, "n": n, "data_dir": str(tmp / f"{peer}-data"), "group": f"{topic}-{peer}"}
    return [sys.executable, str(Path(__file__).resolve()), "--child", peer, "--spec", json.dumps(spec)]


def missing_package(peer: str) -> str | None:
    package = PACKAGES.get(peer)
    if package and importlib.util.find_spec(package) is None:
        return f"{package} is not installed (pip install -e .[bench])"
    return None


# the peers, each run as `peers.py --child NAME --spec JSON` ---------------------------------------
def child_plain(spec: dict) -> None:
    """bench/ingest.py's limit loop in the worker's input order; then idle until stopped, so the
    parent can still read this process's CPU time and peak RSS when it sees the last diff."""
    limit_loop(spec["bootstrap"], spec["topic"], PARTITIONS, spec["n"], spec["data_dir"], ordered=True)
    signal.pause()


def sow_step(old: dict | None, record: dict, is_delta: bool) -> tuple[dict, dict]:
    """One input applied to its key's record: (the new record, its diff)."""
    new = merge(old, record) if is_delta else record
    return new, diff(old, new, KEY_PATHS)


def child_quix(spec: dict) -> None:
    from quixstreams import Application, State, message_context

    topic, delta_topic = spec["topic"], f"{spec['topic']}.delta"
    prefix = outputs_of("quix", topic)
    app = Application(
        broker_address=spec["bootstrap"],
        consumer_group=spec["group"],
        auto_offset_reset="earliest",
        state_dir=spec["data_dir"],
        loglevel="WARNING",
    )
    inputs = [app.topic(name, key_deserializer="bytes", value_deserializer="json") for name in (topic, delta_topic)]
    sow_out = app.topic(f"{prefix}.sow", key_serializer="bytes", value_serializer="json")
    diff_out = app.topic(f"{prefix}.diff", key_serializer="bytes", value_serializer="json")

    def apply(record: dict, state: State) -> tuple[dict, dict]:
        new, changes = sow_step(state.get("record"), record, message_context().topic == delta_topic)
        state.set("record", new)
        return new, changes

    sdf = app.dataframe(inputs[0]).concat(app.dataframe(inputs[1]))
    sdf = sdf.apply(apply, stateful=True)
    sdf.apply(lambda pair: pair[0]).to_topic(sow_out)
    sdf.apply(lambda pair: pair[1]).to_topic(diff_out)
    app.run()


def child_bytewax(spec: dict) -> None:
    import bytewax.operators as op
    from bytewax.connectors.kafka import KafkaSink, KafkaSinkMessage
    from bytewax.dataflow import Dataflow
    from bytewax.inputs import FixedPartitionedSource, StatefulSourcePartition
    from bytewax.testing import run_main

    bootstrap, topic = spec["bootstrap"], spec["topic"]
    delta_topic, prefix = f"{topic}.delta", outputs_of("bytewax", topic)

    class OrderedPartition(StatefulSourcePartition):
        """Partition p of `<topic>` and `<topic>.delta`, merged in order: (SowKey, (is_delta, bytes))."""

        def __init__(self, p: int) -> None:
            self._consumer = make_consumer(bootstrap)
            self._consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t in (topic, delta_topic)])
            self._inputs = OrderedInputs((topic, delta_topic), [p])
            self._idle = False

        def next_batch(self) -> list:
            self._inputs.add(self._consumer.consume(2000, 0))  # never block: Bytewax polls its sources
            batch = [(m.key().decode(), (m.topic() == delta_topic, m.value())) for m in self._inputs.drain(2000)]
            self._idle = not batch
            return batch

        def next_awake(self) -> datetime | None:
            return datetime.now(UTC) + timedelta(milliseconds=5) if self._idle else None

        def snapshot(self) -> None:
            return None  # no recovery configured: nothing to resume from

        def close(self) -> None:
            self._consumer.close()

    class OrderedKafkaSource(FixedPartitionedSource):
        def list_parts(self) -> list[str]:
            return [str(p) for p in range(PARTITIONS)]

        def build_part(self, step_id: str, for_part: str, resume_state: None) -> OrderedPartition:
            return OrderedPartition(int(for_part))

    def apply(old: dict | None, item: tuple[bool, bytes]) -> tuple[dict, tuple[dict, dict]]:
        is_delta, value = item
        new, changes = sow_step(old, orjson.loads(value), is_delta)
        return new, (new, changes)

    flow = Dataflow("ksow_peers")
    inputs = op.input("inputs", flow, OrderedKafkaSource())
    results = op.stateful_map("sow", inputs, apply)
    sow = op.map("sow_messages", results, lambda kv: KafkaSinkMessage(kv[0].encode(), orjson.dumps(kv[1][0])))
    diffs = op.map("diff_messages", results, lambda kv: KafkaSinkMessage(kv[0].encode(), orjson.dumps(kv[1][1])))
    op.output("sow_out", sow, KafkaSink([bootstrap], f"{prefix}.sow"))
    op.output("diff_out", diffs, KafkaSink([bootstrap], f"{prefix}.diff"))
    run_main(flow)


CHILDREN = {"plain": child_plain, "quix": child_quix, "bytewax": child_bytewax}


# one run ----------------------------------------------------------------------------------------------
def one_run(bootstrap: str, args, peers: list[str]) -> dict[str, dict]:
    topic = unique_name("bench_peers")
    tmp = Path(tempfile.mkdtemp(prefix="ksow-bench-peers-"))
    wanted = workload_topics(topic)
    for peer in peers:
        wanted |= output_topics(outputs_of(peer, topic))
    try:
        create_topics(bootstrap, wanted)
        count, seconds = publish(bootstrap, workload(topic, args.n, args.k, args.deltas))
        log(f"{topic}: published {count} inputs in {seconds:.1f}s ({count / seconds:,.0f}/s)")
        expected = expected_sow(bootstrap, topic)
        log(f"{topic}: expected SOW of {len(expected)} records")
        results = {}
        for peer in peers:
            results[peer] = run_peer(peer, peer_command(peer, bootstrap, topic, args.n, tmp), bootstrap, topic, args.n,
                                     expected, tmp / f"{peer}.log")
            r = results[peer]
            log(f"  {peer}: FAILED: {r['failed']}" if "failed" in r else
                f"  {peer}: {fmt(r['rate_steady'])} rec/s steady, {fmt(r['cpu_us'], ' us', 1)} CPU per record, verified")
        return results
    finally:
        # the peers' own topics too (Quix's changelog is named after its consumer group, `<topic>-quix`)
        delete_topics(bootstrap, [name for name in admin(bootstrap).list_topics(timeout=30).topics if topic in name])
        shutil.rmtree(tmp, ignore_errors=True)


# figures ------------------------------------------------------------------------------------------------
def summarize(peers: list[str], runs: list[dict[str, dict]], unavailable: dict[str, str]) -> dict[str, dict]:
    """Per peer: the medians over the runs, or why it has none (n/a, FAILED)."""
    out: dict[str, dict] = {}
    for peer in PEERS:
        if peer in unavailable:
            out[peer] = {"status": "n/a", "why": unavailable[peer]}
        elif peer not in peers:
            out[peer] = {"status": "n/a", "why": "not selected (--only)"}
        elif any("failed" in run[peer] for run in runs):
            out[peer] = {"status": "FAILED", "why": "; ".join(run[peer]["failed"] for run in runs if "failed" in run[peer])}
        else:
            out[peer] = {"status": "ok", **{name: median(run[peer][name] for run in runs)
                                            for name in ("rate_steady", "rate_total", "startup_s", "cpu_us", "rss_mb")}}
    return out


def per_run_ratio(runs: list[dict[str, dict]], a: str, b: str, summary: dict) -> float | None:
    if summary[a]["status"] != "ok" or summary[b]["status"] != "ok":
        return None
    return median(ratio(run[a]["rate_steady"], run[b]["rate_steady"]) for run in runs)


def print_figures(args, runs: list[dict[str, dict]], summary: dict[str, dict]) -> None:
    print(f"peers benchmark: N={args.n} inputs, K={args.k} keys, {args.deltas:.0%} deltas, {PARTITIONS} partitions, "
          f"{len(runs)} run(s), medians")
    print(f"| {'processor':<50} | {'rec/s steady':>12} | {'rec/s wall':>10} | {'startup':>7} | {'CPU/record':>10} | {'peak RSS':>8} |")
    print(f"| {'-' * 50} | {'-' * 12} | {'-' * 10} | {'-' * 7} | {'-' * 10} | {'-' * 8} |")
    for peer in PEERS:
        s = summary[peer]
        if s["status"] == "ok":
            print(f"| {LABELS[peer]:<50} | {fmt(s['rate_steady']):>12} | {fmt(s['rate_total']):>10} | "
                  f"{fmt(s['startup_s'], ' s', 1):>7} | {fmt(s['cpu_us'], ' us', 1):>10} | {fmt(s['rss_mb'], ' MB'):>8} |")
        else:
            print(f"| {LABELS[peer]:<50} | {s['status']}: {s['why']}")
    if len(runs) > 1:
        for peer in PEERS:
            if summary[peer]["status"] == "ok":
                print(f"  {peer} rec/s steady per run: {', '.join(fmt(run[peer]['rate_steady']) for run in runs)}")
    sys.stdout.flush()


def last_line(runs: list[dict[str, dict]], summary: dict[str, dict]) -> str:
    def rate(peer: str) -> str:
        s = summary[peer]
        if s["status"] != "ok":
            return s["status"]
        return "n/a" if s["rate_steady"] is None else f"{s['rate_steady']:.0f} rec/s"

    def fraction(a: str, b: str) -> str:
        r = per_run_ratio(runs, a, b, summary)
        return "n/a" if r is None else f"{r:.2f}"

    return (f"peers: ksow {rate('ksow')}, quix {rate('quix')}, bytewax {rate('bytewax')}, limit {rate('plain')}, "
            f"ksow/quix {fraction('ksow', 'quix')}, ksow/limit {fraction('ksow', 'plain')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--only", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:  # child mode: one peer, until the parent stops it
        CHILDREN[args.child](json.loads(args.spec))
        return

    selected = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = set(selected) - set(PEERS)
    if unknown or not selected:
        parser.error(f"--only takes names among {', '.join(PEERS)} (got {args.only!r})")
    unavailable = {peer: why for peer in selected if (why := missing_package(peer))}
    peers = [peer for peer in PEERS if peer in selected and peer not in unavailable]
    for peer, why in unavailable.items():
        log(f"{peer}: n/a, {why}")

    runs = []
    if peers:
        with kafka_bootstrap() as bootstrap:
            for r in range(args.runs):
                log(f"run {r + 1}/{args.runs}: N={args.n} K={args.k} deltas={args.deltas}, peers {', '.join(peers)}")
                runs.append(one_run(bootstrap, args, peers))
    summary = summarize(peers, runs, unavailable)
    print_figures(args, runs, summary)
    print(last_line(runs, summary))


if __name__ == "__main__":
    main()
