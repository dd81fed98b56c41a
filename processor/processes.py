"""Child processes that must not outlive ksow: the embedded broker's JVM and a pool's workers."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent_hook() -> Callable[[], None] | None:
    """A `preexec_fn` asking Linux to SIGTERM the child when this process dies (None elsewhere).

    A parent killed with SIGKILL cannot stop its children: without this a killed test run leaks
    brokers holding ports and memory, and a killed `ksow up --workers N` leaves workers holding
    their data folders. The signal fires when the *thread* that started the child ends, so start
    children from a long-lived thread (the main thread, normally)."""
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded before the fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return hook
