"""bench/peers.py end to end on the session broker, on a tiny workload: the peers it can run here
reach the SOW it expects (the fold of the inputs in the worker's order, computed independently of
them), it prints the issue's summary line, and it leaves no topic behind. The ksow peer is left out:
the worker has its own tests, and this one checks the benchmark."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_peers_are_verified_and_summarised(kafka_bootstrap: str, admin: AdminClient):
    peers = ["plain"] + [peer for peer, package in (("quix", "quixstreams"), ("bytewax", "bytewax"))
                         if importlib.util.find_spec(package) is not None]
    done = subprocess.run(
        [sys.executable, "bench/peers.py", "-n", "3000", "-k", "300", "--only", ",".join(peers)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
        env=dict(os.environ, KAFKA_BOOTSTRAP=kafka_bootstrap, PYTHONPATH=str(REPO)),
    )
    assert done.returncode == 0, done.stderr[-3000:]

    for peer in peers:  # a run this small is too short for a steady rate: only the verdict counts
        assert re.search(rf"^  {peer}: .* verified$", done.stderr, re.MULTILINE), done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    rate = r"(\d+ rec/s|n/a)"
    assert re.fullmatch(
        rf"peers: ksow n/a, quix {rate}, bytewax {rate}, limit {rate}, ksow/quix n/a, ksow/limit n/a", last
    ), last

    topic = re.search(r"^(bench_peers_\w+): published", done.stderr, re.MULTILINE).group(1)
    deadline = time.monotonic() + 30  # deleted topics leave the metadata a little after the delete
    while (left := [name for name in admin.list_topics(timeout=30).topics if topic in name]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == []
