"""The memory allocator of a worker process.

glibc's malloc took about a fifth of a busy worker's CPU (perf, expiring 16,667 records a second:
malloc_consolidate, _int_malloc, _int_free, unlink_chunk and the arena locks). librdkafka allocates
each message and its headers on the loop thread and frees them on its broker threads, RocksDB's
write batches grow past the size at which glibc consolidates its free lists, and Python's objects
over 512 bytes go to malloc too. RocksDB's own tuning guide recommends a modern allocator for the
same reason. So a worker runs with mimalloc (the `cmeel-mimalloc` wheel, a dependency on Linux)
preloaded: `ksow up` executes itself again, once, with it in LD_PRELOAD, before it starts anything.

KSOW_ALLOCATOR chooses: `mimalloc` (default), `system` (glibc's malloc), or the path of another
allocator's shared library (e.g. jemalloc's libjemalloc.so.2).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

from processor.contract.errors import ConfigError

ENV = "KSOW_ALLOCATOR"
_LOADED = "KSOW_ALLOCATOR_LOADED"  # set for the process executed again: it must not do so once more
_PRELOAD_BEFORE = "KSOW_LD_PRELOAD_BEFORE"  # LD_PRELOAD as it was, given back to the children


def allocator_library(choice: str | None) -> Path | None:
    """The shared library to preload for KSOW_ALLOCATOR's value (None: the system's malloc)."""
    choice = (choice or "mimalloc").strip()
    if choice == "system":
        return None
    if choice == "mimalloc":
        return bundled_mimalloc()
    path = Path(choice).expanduser()
    if not path.is_file():
        raise ConfigError(f"{ENV}={choice}: neither mimalloc, system, nor the path of a shared library")
    return path.resolve()


def bundled_mimalloc() -> Path | None:
    """mimalloc's library from the cmeel-mimalloc wheel, if it is installed (Linux)."""
    try:
        files = importlib.metadata.files("cmeel-mimalloc") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = sorted((f for f in files if f.name.startswith("libmimalloc.so")), key=lambda f: len(f.name))
    return Path(found[0].locate()).resolve() if found else None


def run_with_allocator() -> None:
    """Execute this process again with the chosen allocator preloaded (same PID, same arguments),
    unless it is the system's or this process is that execution already: then give LD_PRELOAD back
    as it was, so what the worker starts (the embedded broker's JVM, a pool's workers, which make
    their own choice) starts without it. Linux only; a failure leaves the process as it is."""
    if sys.platform != "linux" or not _started_as_ksow():
        return
    if os.environ.pop(_LOADED, None) is not None:
        before = os.environ.pop(_PRELOAD_BEFORE, "")
        if before:
            os.environ["LD_PRELOAD"] = before
        else:
            os.environ.pop("LD_PRELOAD", None)
        return
    library = allocator_library(os.environ.get(ENV))
    if library is None:
        return
    before = os.environ.get("LD_PRELOAD", "")
    env = {**os.environ, _LOADED: str(library), _PRELOAD_BEFORE: before, "LD_PRELOAD": f"{library} {before}".strip()}
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        return


def _started_as_ksow() -> bool:
    """Whether this process was started to run the ksow command (its script, or `python -m
    processor.cli`), and not, say, a test runner calling the command in its own process."""
    started = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    return started is not None and (started.name == "ksow" or started == Path(__file__).resolve().parents[2] / "cli" / "__main__.py")


def allocator_in_use() -> str:
    """What this process allocates with: the preloaded library's name if it is mapped, else `system`."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    for name in ("mimalloc", "jemalloc", "tcmalloc"):
        if f"/lib{name}" in maps:
            return name
    return "system"
