"""The worker pool of `ksow up --workers N`, with real processes standing in for workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from processor.runners.faust import pool as pool_module
from processor.runners.faust.pool import WorkerPool
from processor.testing import children, running


def _python(code: str):
    return lambda i: [sys.executable, "-c", code, str(i)]


def test_a_worker_that_keeps_failing_at_start_stops_the_pool(monkeypatch):
    monkeypatch.setattr(pool_module, "QUICK_EXIT_S", 5.0)
    said: list[str] = []
    status = WorkerPool(2, _python("import sys, time; sys.exit(3) if sys.argv[1] == '1' else time.sleep(30)"), say=said.append).run()
    assert status == 1
    assert said.count("worker 1 exited with status 3: restarting it in 1s") == 1
    assert said.count("worker 1 exited with status 3: restarting it in 2s") == 1
    assert said[-1] == "worker 1 exited 3 times within 5s of its start, or without getting going: stopping"
    assert sum("worker 0 exited" in line for line in said) == 0


def test_a_worker_that_never_gets_going_stops_the_pool_however_long_it_tried(monkeypatch):
    """Audit: with the broker unreachable each worker gave up after ~30 s, past the quick-exit
    window, so `ksow up --workers 2` restarted them forever. A worker that could not get going
    exits with STARTUP_FAILED, and that counts as failing at its start whenever it comes."""
    monkeypatch.setattr(pool_module, "QUICK_EXIT_S", 0.3)
    said: list[str] = []
    code = f"import sys, time; time.sleep(0.6); sys.exit({pool_module.STARTUP_FAILED})"
    assert WorkerPool(1, _python(code), say=said.append).run() == 1
    assert said[-1].startswith("worker 0 exited 3 times")
    other: list[str] = []
    code = "import sys, time; time.sleep(0.6); sys.exit(1)"  # an ordinary failure after a while: restarted

    # SIGTERM once it was restarted three times. (A SIGTERM at a fixed 6 s fitted three cycles of a
    # start, 0.6 s, the exit seen, a 1 s back-off, only while the interpreter started quickly.)
    def say(line: str) -> None:
        other.append(line)
        if sum("restarting it in 1s" in x for x in other) == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    pool = WorkerPool(1, _python(code), say=say)
    backstop = threading.Timer(60.0, lambda: os.kill(os.getpid(), signal.SIGTERM))  # if it never gets there
    backstop.start()
    try:
        assert pool.run() == 0
    finally:
        backstop.cancel()
    assert sum("restarting it in 1s" in line for line in other) >= 3 and "stopping" not in other[-1]


def test_a_worker_whose_settings_the_cluster_refused_stops_the_pool_at_once():
    """Audit: with a wrong password each worker was restarted twice more (58 s) before the pool
    stopped; a refused login or certificate is refused again."""
    said: list[str] = []
    code = f"import sys, time; sys.exit({pool_module.SETTINGS_REFUSED}) if sys.argv[1] == '1' else time.sleep(30)"
    assert WorkerPool(2, _python(code), say=said.append).run() == 1
    assert said[-1] == "worker 1: the cluster refused its client settings: stopping"
    assert not any("restarting" in line for line in said)


def test_sigterm_stops_every_worker_and_a_dead_one_is_restarted(tmp_path):
    marks = tmp_path / "starts"
    code = f"import sys, time; open({str(marks)!r}, 'a').write(sys.argv[1] + '\\n'); time.sleep(60)"
    said: list[str] = []
    pool = WorkerPool(2, _python(code), say=said.append)

    def drive():
        for _ in range(100):  # both started
            if marks.exists() and len(marks.read_text().split()) == 2:
                break
            threading.Event().wait(0.1)
        os.kill(pool.members[1].proc.pid, signal.SIGKILL)
        for _ in range(100):  # restarted
            if marks.read_text().split().count("1") == 2:
                break
            threading.Event().wait(0.1)
        os.kill(os.getpid(), signal.SIGTERM)

    driver = threading.Thread(target=drive)
    driver.start()
    procs = []
    original = pool._start

    def start(member):
        original(member)
        procs.append(member.proc)

    pool._start = start  # type: ignore[method-assign]
    assert pool.run() == 0
    driver.join()
    assert marks.read_text().split().count("1") == 2
    assert "worker 1 exited with status -9: restarting it in 1s" in said
    # worker 0, worker 1 (killed), worker 1 again: the pool's SIGTERM ended the two left
    assert [p.poll() for p in procs] == [-signal.SIGTERM, -signal.SIGKILL, -signal.SIGTERM]


def test_a_pool_has_workers():
    with pytest.raises(ValueError):
        WorkerPool(0, _python("pass"))


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_pool_killed_with_sigkill_takes_its_workers_with_it():
    """A killed pool cannot stop its workers: Linux sends each SIGTERM when the pool dies, so none
    is left holding its data folder for the next `ksow up`."""
    pool = ("import sys, time\n"
            "from processor.runners.faust.pool import WorkerPool\n"
            "WorkerPool(2, lambda i: [sys.executable, '-c', 'import time; time.sleep(120)'], say=lambda line: None).run()\n")
    parent = subprocess.Popen([sys.executable, "-c", pool])
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(kids := children(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(kids) == 2
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(running(pid) for pid in kids)
    finally:
        parent.kill()
        for pid in filter(running, kids):
            os.kill(pid, signal.SIGKILL)

