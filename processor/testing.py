"""What tests and benchmarks share: a SOW topic applied locally over real stores (no Kafka), worker
subprocesses, and reading a topic to its end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

from confluent_kafka import TopicPartition

from processor.contract.types import InputMessage, Output
from processor.engine.topic import SowTopicEngine
from processor.kafka.clients import end_offsets, make_consumer, read_until
from processor.state.base import PartitionStore, open_partition_store
from processor.topology import Persistence, SowTopic, View


class LocalTopic:
    """One SOW topic's engine over partition stores (RocksDB under `data_dir`, else memory), applied
    and committed by hand: the worker's semantics without Kafka, for tests and benchmarks."""

    def __init__(self, spec: SowTopic, data_dir: Path | None = None, topology_dir: Path | None = None, views: Iterable[View] = ()):
        self.spec = spec
        self.engine = SowTopicEngine(spec, topology_dir, views)
        self.data_dir = data_dir
        self.stores: dict[int, PartitionStore] = {}

    def open(self, p: int) -> PartitionStore:
        store = self.stores.get(p)
        if store is None:
            if self.data_dir is not None and self.spec.persistence is Persistence.PERSISTENT:
                store = open_partition_store("rocksdb", str(self.data_dir / self.spec.topic / f"p{p}"), self.engine.indexes)
            else:
                store = open_partition_store("memory", None, self.engine.indexes)
            self.stores[p] = store
            self.engine.attach(p, store)
        return store

    def handle(self, messages: Iterable[InputMessage], now: int) -> list[Output]:
        messages = list(messages)
        for msg in messages:
            self.open(msg.partition)
        out: list[Output] = []
        self.engine.handle(messages, now, out)
        return out

    def expire_due(self, p: int, now: int) -> list[Output]:
        out: list[Output] = []
        if p in self.stores:
            self.engine.expire_due(p, now, out)
        return out

    def restore(self, p: int, key: bytes | None, value: bytes | None, headers, timestamp: int) -> None:
        self.engine.restore(p, self.open(p), key, value, headers, timestamp)

    def commit(self, p: int | None = None) -> None:
        for q, store in self.stores.items():
            if (p is None or q == p) and store.dirty:
                store.commit()

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        self.stores.clear()


def read_topic(bootstrap: str, topic: str, partitions: Iterable[int] | None = None, committed: bool = True) -> list:
    """Every message of a topic up to its current end (`read_committed` unless told otherwise)."""
    consumer = make_consumer(bootstrap, **({"isolation.level": "read_committed"} if committed else {"isolation.level": "read_uncommitted"}))
    try:
        if partitions is None:
            partitions = list(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        ends = end_offsets(consumer, topic, list(partitions))
        consumer.assign([TopicPartition(topic, p, low) for p, (low, _) in ends.items()])
        return list(read_until(consumer, {(topic, p): high for p, (_, high) in ends.items()}))
    finally:
        consumer.close()


class WorkerProcess:
    """A `ksow up` subprocess whose log is kept for assertions and failure reports."""

    def __init__(self, bootstrap: str, topology: Path, group: str, data_dir: Path, name: str = "w", extra_args: Iterable[str] = (), env: dict | None = None):
        self.args = [sys.executable, "-m", "processor.cli", "up", "--bootstrap", bootstrap, "--topology", str(topology),
                     "--group", group, "--data-dir", str(data_dir), "--loglevel", "info", *extra_args]
        self.log_path = data_dir.parent / f"{name}-{data_dir.name}.log"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self._offset = 0

    def start(self, wait: bool = True, timeout: float = 90) -> "WorkerProcess":
        self._offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        if wait:
            self.wait_for("Worker]: Ready", timeout)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[self._offset:] if self.log_path.exists() else ""

    def wait_for(self, text: str, timeout: float, count: int = 1) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.log().count(text) >= count:
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"worker exited ({self.proc.returncode}):\n{self.log()[-4000:]}")
            time.sleep(0.1)
        raise AssertionError(f"{text!r} not in the worker log after {timeout}s:\n{self.log()[-4000:]}")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self, timeout: float = 30) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def running(pid: int) -> bool:
    """True while the process exists and is not a zombie awaiting its (dead) parent (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[1] == str(pid):
                    found.append(int(entry))
        except FileNotFoundError:  # ended meanwhile
            continue
    return found


def wait_until(check: Callable[[], object], timeout: float = 60, what: str = "condition", interval: float = 0.3):
    """Call `check` until it returns something truthy, and return that; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} not reached in {timeout}s (last: {last!r})")
