"""Several worker processes on one host (`ksow up --workers N`), supervised.

A worker's input loop is one Python thread: the GIL keeps it to one core whatever the host has. The
way a consumer group scales out is more members, so a host with several cores runs several worker
processes, each an ordinary `ksow up` worker of the same group with its own stores (RocksDB locks
a store's folder: two processes must never share one), its own transactional.id (it derives from
the data folder) and its own HTTP endpoint, announced in the registry like any worker's.

The pool restarts a worker that dies (its partitions move to the others meanwhile, and come back
with a rebalance), gives up when one keeps dying right after its start (a setting every worker
refuses), and stops them all on SIGTERM or SIGINT.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from processor.processes import die_with_parent_hook

QUICK_EXIT_S = 15.0  # a worker that exits this soon after its start did not get going
STARTUP_FAILED = 3  # the exit status of a worker that could not get going (the cluster did not answer), however long it tried
SETTINGS_REFUSED = 4  # the exit status of a worker whose login or TLS handshake the cluster refused: the pool stops
MAX_QUICK_EXITS = 3  # in a row, for one worker: the pool stops with an error
STOP_TIMEOUT_S = 60.0  # after SIGTERM, how long a worker may take to commit and leave the group


@dataclass
class _Member:
    index: int
    proc: subprocess.Popen | None = None
    started: float = 0.0
    quick_exits: int = 0
    restart_at: float = 0.0
    backoff: float = 1.0
    status: int | None = None  # of its last exit


class WorkerPool:
    """`argv(i)` is the command line of worker i (0 <= i < n)."""

    def __init__(self, n: int, argv: Callable[[int], Sequence[str]], env: dict[str, str] | None = None,
                 say: Callable[[str], None] = print):
        if n < 1:
            raise ValueError("a pool has at least one worker")
        self.argv = argv
        self.env = env
        self.say = say
        self.members = [_Member(i) for i in range(n)]
        self._stopping = False

    def run(self) -> int:
        """Run until SIGTERM/SIGINT (exit status 0) or until a worker keeps failing (1)."""
        previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for member in self.members:
                self._start(member)
            while not self._stopping:
                failed = self._watch()
                if failed is not None:
                    if failed.status == SETTINGS_REFUSED:
                        self.say(f"worker {failed.index}: the cluster refused its client settings: stopping")
                    else:
                        self.say(f"worker {failed.index} exited {MAX_QUICK_EXITS} times within {QUICK_EXIT_S:.0f}s of its start, or without getting going: stopping")
                    return 1
                time.sleep(0.2)
            return 0
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop(self, signum, frame) -> None:
        self._stopping = True

    def _start(self, member: _Member) -> None:
        member.proc = subprocess.Popen(list(self.argv(member.index)), env=self.env, preexec_fn=die_with_parent_hook())
        member.started = time.monotonic()
        self.say(f"worker {member.index} started (pid {member.proc.pid})")

    def _watch(self) -> _Member | None:
        """Restart the workers that exited (after a backoff); the one that keeps failing, if any."""
        now = time.monotonic()
        for member in self.members:
            proc = member.proc
            if proc is not None:
                status = proc.poll()
                if status is None:
                    continue
                member.proc, member.status = None, status
                if status == SETTINGS_REFUSED:
                    return member  # the same settings would be refused again
                quick = now - member.started < QUICK_EXIT_S or status == STARTUP_FAILED
                member.quick_exits = member.quick_exits + 1 if quick else 0
                if member.quick_exits >= MAX_QUICK_EXITS:
                    return member
                member.restart_at = now + member.backoff
                member.backoff = min(member.backoff * 2, 30.0) if quick else 1.0
                self.say(f"worker {member.index} exited with status {status}: restarting it in {member.restart_at - now:.0f}s")
            elif now >= member.restart_at:
                self._start(member)
        return None

    def _stop_all(self) -> None:
        running = [m.proc for m in self.members if m.proc is not None and m.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in running:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
