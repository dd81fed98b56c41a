"""The worker's allocator (processor/runners/faust/allocator.py): `ksow up` runs with mimalloc
preloaded unless told otherwise, in its own process only."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from processor.contract.errors import ConfigError
from processor.runners.faust.allocator import allocator_library, bundled_mimalloc

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD is Linux's")


def test_the_choices():
    assert allocator_library("system") is None
    assert allocator_library(None) == allocator_library("mimalloc") == bundled_mimalloc()
    assert bundled_mimalloc().is_file()
    assert allocator_library(str(bundled_mimalloc())) == bundled_mimalloc()
    with pytest.raises(ConfigError, match="KSOW_ALLOCATOR=jemalloc: neither"):
        allocator_library("jemalloc")


def _worker_maps(tmp_path: Path, allocator: str | None) -> tuple[str, str]:
    """Start `ksow up` against a port nothing listens on (it waits 15 s to reach it) and read what
    its process, same PID after the execution again, has mapped and in its environment when
    librdkafka first shows in its maps: the execution again comes before librdkafka loads, which
    the process executed would otherwise load twice, so the maps read then are the worker's."""
    topology = tmp_path / "t.yaml"
    topology.write_text("sow:\n  - topic: t\n    key: [/id]\n")
    env = {k: v for k, v in os.environ.items() if k != "KSOW_ALLOCATOR"}
    if allocator:
        env["KSOW_ALLOCATOR"] = allocator
    proc = subprocess.Popen([sys.executable, "-m", "processor.cli", "up", "--bootstrap", "127.0.0.1:9", "--topology", str(topology),
                             "--data-dir", str(tmp_path / "d")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.005)
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
            if "confluent_kafka" in maps:
                return maps, Path(f"/proc/{proc.pid}/environ").read_bytes().decode(errors="replace")
        raise AssertionError("the worker did not get going")
    finally:
        proc.kill()
        proc.wait(10)


def test_a_worker_runs_with_mimalloc_and_what_it_starts_without_it(tmp_path):
    maps, environ = _worker_maps(tmp_path, None)
    assert str(bundled_mimalloc()) in maps
    # /proc/<pid>/environ is the environment the process was executed with: the preload is there;
    # the process itself drops it (os.environ), so the broker JVM or pool workers it starts make
    # their own choice.
    assert "LD_PRELOAD=" in environ


def test_system_keeps_glibc_malloc(tmp_path):
    maps, environ = _worker_maps(tmp_path, "system")
    assert "mimalloc" not in maps and "LD_PRELOAD=" not in environ


@pytest.mark.parametrize("before", ["", "/opt/other.so"])
def test_the_executed_process_gives_ld_preload_back_as_it_was(monkeypatch, before):
    """What the worker starts (the embedded broker's JVM, a pool's workers) gets the environment the
    worker was started with."""
    import processor.runners.faust.allocator as allocator

    monkeypatch.setattr(sys, "argv", [str(Path(allocator.__file__).resolve().parents[2] / "cli" / "__main__.py"), "up"])
    monkeypatch.setenv("KSOW_ALLOCATOR_LOADED", str(bundled_mimalloc()))
    monkeypatch.setenv("KSOW_LD_PRELOAD_BEFORE", before)
    monkeypatch.setenv("LD_PRELOAD", f"{bundled_mimalloc()} {before}".strip())
    allocator.run_with_allocator()  # would execute this process again if it took itself for the first
    assert os.environ.get("LD_PRELOAD") == (before or None)
    assert "KSOW_ALLOCATOR_LOADED" not in os.environ and "KSOW_LD_PRELOAD_BEFORE" not in os.environ
