"""Every benchmark in bench/ runs end to end on the session broker, on a tiny workload, and prints
its documented last line. The figures of a run this small mean nothing; what is checked is that the
scripts behind docs/benchmarks.md still run against the code they measure (two of them had stopped:
restore's stand-in for the loop lacked a method the replay came to call, and query published before
its worker had created the topic). bench/peers.py has its own test (test_bench_peers)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
NUMBER = r"[\d,.]+"

_NO_SPARK = pytest.mark.skipif(importlib.util.find_spec("pyspark") is None, reason="bench/snapshot.py needs the spark extra")

# (bench script, its arguments, its last line), one case each
BENCHES = [
    pytest.param("ingest", ["-n", "3000", "-k", "300"], rf"ingest: worker {NUMBER} rec/s, limit {NUMBER} rec/s, ratio {NUMBER}", id="ingest"),
    pytest.param("restore", ["-n", "3000"], rf"restore: ksow {NUMBER} rec/s, limit {NUMBER} rec/s, ratio {NUMBER}", id="restore"),
    pytest.param("restore", ["-n", "3000", "--indexes", "--avro"], rf"restore: ksow {NUMBER} rec/s, limit {NUMBER} rec/s, ratio {NUMBER}",
                 id="restore --indexes --avro"),
    pytest.param("restore", ["-n", "3000", "--alongside", "200"], rf"restore alongside: {NUMBER} records in {NUMBER} s; partition 0 meanwhile: "
                 rf"{NUMBER} records, p99 applied after {NUMBER} ms, p99 expired {NUMBER} ms late", id="restore --alongside"),
    pytest.param("query", ["--records", "3000", "--queries", "5"], rf"query: indexed p50 {NUMBER} ms, scan {NUMBER} rec/s", id="query"),
    pytest.param("query_load", ["--records", "2000", "--inputs", "2000", "--callers", "0,2", "--shares", "1"],
                 rf"query_load: share 1: ingest {NUMBER} rec/s alone, with 2 callers {NUMBER} rec/s \(ratio {NUMBER}, {NUMBER} queries/s\)",
                 id="query_load"),
    pytest.param("fanout", ["--subscriptions", "3", "--keys", "50", "--rate", "200", "--seconds", "3"],
                 rf"fanout: p50 {NUMBER} ms, p99 {NUMBER} ms, delta bytes {NUMBER}% of full", id="fanout"),
    pytest.param("hotpath", ["-n", "3000", "-k", "300", "--expiries", "3000"],
                 rf"hotpath: input {NUMBER} us, expiry {NUMBER} us, plain loop {NUMBER} us, plain expiry {NUMBER} us, ratio {NUMBER}, "
                 rf"expiry ratio {NUMBER}", id="hotpath"),
    pytest.param("produce_cost", ["-n", "3000"], rf"produce: {NUMBER} us a message with headers, {NUMBER} us without, .*", id="produce_cost"),
    pytest.param("expiry", ["--records", "2000", "--window", "5", "--stream", "2000", "--passes", "1", "--loaded-control"],
                 rf"expiry: p99 lateness {NUMBER} ms, throughput ratio {NUMBER}", id="expiry"),
    pytest.param("snapshot", ["--events", "5000", "--keys", "500"], rf"snapshot: spark {NUMBER} events/s, loop {NUMBER} events/s, ratio {NUMBER}",
                 id="snapshot", marks=[pytest.mark.spark, _NO_SPARK]),
]


@pytest.mark.parametrize("script,args,last_line", BENCHES)
def test_bench_runs_and_prints_its_last_line(script: str, args: list[str], last_line: str, kafka_bootstrap: str):
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / f"{script}.py"), *args], cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
        env=dict(os.environ, KAFKA_BOOTSTRAP=kafka_bootstrap, PYTHONPATH=str(REPO)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines and re.fullmatch(last_line, lines[-1]), (done.stdout[-2000:], done.stderr[-2000:])
