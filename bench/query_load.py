"""What queries cost a worker's ingest: one worker drains a backlog while callers ask it, without
pause, a filter no index answers (every record scanned, none returned).

    python bench/query_load.py [--records 200000] [--inputs 200000] [--callers 0,2,4] [--shares 1,0.25]

A worker (`ksow up`, one process, 4 partitions) first holds `--records` records. Then, for each
value of `--callers`, that many client processes start querying it, `--inputs` updates are
published at once, and the bench times the worker from the first of them to the last on `.sow`.
The whole series runs once for each `--shares` value (the worker's KSOW_QUERY_SHARE: 1 is no
pacing, the baseline, measured in the same run), each with a worker of its own. The queries run in
processes of their own, so they share nothing with the publisher but the worker they ask.

Last line: `query_load: share S: ingest X rec/s alone, with N callers Y rec/s (ratio R), ...` for
each share, ratio being the rate with callers over the rate alone.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import sys
import tempfile
import time
from pathlib import Path

import orjson
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import count_messages, kafka_bootstrap, log, publish, unique_name, wait_for_count  # noqa: E402
from processor.testing import WorkerProcess  # noqa: E402

PARTITIONS = 4
FILTER = "/v < 0"  # matches nothing, answered by no index: a scan of every record
_SPAWN = multiprocessing.get_context("spawn")  # callers start clean, not forked from a process with Kafka client threads


def _caller(bootstrap: str, topology: str, group: str, topic: str, stop, asked) -> None:
    """One client asking the worker the same query until told to stop."""
    from processor.client.sow_client import Client
    from processor.topology import load_topology

    client = Client(bootstrap, load_topology(topology), group)
    while not stop.is_set():
        try:
            client.query(topic, filter=FILTER)
        except Exception as exc:  # a 503 under load: ask again, as a caller would
            log(f"  caller: {exc}")
            time.sleep(0.2)
            continue
        if client.last_query_source != "workers":
            raise SystemExit("the query was not answered by the worker")
        with asked.get_lock():
            asked.value += 1


def _inputs(topic: str, n: int, keys: int, start: int):
    for i in range(n):
        key = (start + i) % keys
        yield topic, str(key).encode(), orjson.dumps({"id": key, "v": start + i, "pad": "x" * 60})


def run_share(bootstrap: str, tmp: Path, share: str, records: int, inputs: int, callers: list[int]) -> dict[int, tuple[float, float]]:
    """{callers: (ingest rec/s, queries/s)} for one worker with KSOW_QUERY_SHARE=share."""
    topic = unique_name("qload")
    topology = tmp / f"{topic}.yaml"
    topology.write_text(yaml.safe_dump({"sow": [{"topic": topic, "key": ["/id"], "partitions": PARTITIONS}]}))
    group = f"g-{topic}"
    worker = WorkerProcess(bootstrap, topology, group, tmp / topic, env={"KSOW_QUERY_SHARE": share}).start()
    out: dict[int, tuple[float, float]] = {}
    try:
        publish(bootstrap, _inputs(topic, records, records, 0))
        wait_for_count(bootstrap, f"{topic}.sow", PARTITIONS, records, 300, alive=lambda: worker.proc.poll() is None)
        sent = records
        for n in callers:
            stop, asked = _SPAWN.Event(), _SPAWN.Value("i", 0)
            procs = [_SPAWN.Process(target=_caller, args=(bootstrap, str(topology), group, topic, stop, asked)) for _ in range(n)]
            for p in procs:
                p.start()
            time.sleep(2 if n else 0)  # the callers are asking before the inputs come
            base = count_messages(bootstrap, f"{topic}.sow", PARTITIONS)
            asked_before = asked.value
            began = time.time()
            publish(bootstrap, _inputs(topic, inputs, records, sent))
            ended = wait_for_count(bootstrap, f"{topic}.sow", PARTITIONS, base + inputs, 600, alive=lambda: worker.proc.poll() is None)
            stop.set()
            for p in procs:
                p.join(60)
            seconds = ended - began
            out[n] = (inputs / seconds, (asked.value - asked_before) / seconds)
            sent += inputs
            log(f"  share {share}, {n} callers: {inputs:,} inputs in {seconds:.1f}s = {out[n][0]:,.0f} rec/s, {out[n][1]:.1f} queries/s")
    finally:
        worker.kill()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=200_000, help="records in the SOW before the callers start")
    parser.add_argument("--inputs", type=int, default=200_000, help="updates the worker drains under each load")
    parser.add_argument("--callers", default="0,2,4", help="comma-separated numbers of querying processes (0 first: the rate alone)")
    parser.add_argument("--shares", default="1,0.25", help="KSOW_QUERY_SHARE values, one worker each (1: no pacing)")
    args = parser.parse_args()
    callers = sorted({int(x) for x in args.callers.split(",")} | {0})
    tmp = Path(tempfile.mkdtemp(prefix="ksow-qload-"))
    lines = []
    try:
        with kafka_bootstrap() as bootstrap:
            for share in args.shares.split(","):
                rates = run_share(bootstrap, tmp, share.strip(), args.records, args.inputs, callers)
                alone = rates[0][0]
                parts = [f"with {n} callers {rates[n][0]:.0f} rec/s (ratio {rates[n][0] / alone:.2f}, {rates[n][1]:.1f} queries/s)" for n in callers if n]
                lines.append(f"query_load: share {share.strip()}: ingest {alone:.0f} rec/s alone, " + ", ".join(parts))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
