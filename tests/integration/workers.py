"""Helpers for integration tests: real `ksow up` worker processes, topologies, reading topics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import orjson
import yaml
from confluent_kafka import Producer, TopicPartition

from processor.kafka.clients import end_offsets, make_consumer, read_until


def write_topology(tmp_path: Path, topic: str, **options) -> Path:
    entry = {"topic": topic, "key": ["/id"], "partitions": 4, **options}
    path = tmp_path / f"{topic}.yaml"
    path.write_text(yaml.safe_dump({"sow": [entry]}))
    return path


class Worker:
    """A `ksow up` subprocess; its log is kept for assertions and for failure reports."""

    def __init__(self, bootstrap: str, topology: Path, group: str, data_dir: Path, name: str = "w", extra_args: tuple[str, ...] = ()):
        self.args = [sys.executable, "-m", "processor.cli", "up", "--bootstrap", bootstrap, "--topology", str(topology),
                     "--group", group, "--data-dir", str(data_dir), "--loglevel", "info", *extra_args]
        self.log_path = data_dir.parent / f"{name}-{data_dir.name}.log"
        self.proc: subprocess.Popen | None = None
        self._offset = 0

    def start(self, wait: bool = True) -> "Worker":
        self._offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if wait:
            self.wait_for("Worker]: Ready", 90)
        return self

    def log(self) -> str:
        return self.log_path.read_bytes()[self._offset:].decode(errors="replace")

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log():
                return
            if self.proc and self.proc.poll() is not None:
                raise AssertionError(f"worker exited ({self.proc.returncode}):\n{self.log()[-4000:]}")
            time.sleep(0.2)
        raise AssertionError(f"worker log never showed {text!r}:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def producer(bootstrap: str) -> Producer:
    return Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})


def send(p: Producer, topic: str, value, key: bytes | None = None, headers=None) -> None:
    raw = value if isinstance(value, (bytes, type(None))) else orjson.dumps(value)
    p.produce(topic, raw, key, headers=headers or [])


def read_all(bootstrap: str, topic: str, partitions: int = 4) -> list:
    """Every message of a topic up to its current end, per partition in offset order."""
    consumer = make_consumer(bootstrap)
    try:
        ends = {(topic, p): high for p, (_, high) in end_offsets(consumer, topic, range(partitions)).items()}
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        return list(read_until(consumer, ends))
    finally:
        consumer.close()


def wait_until(check: Callable[[], object], timeout: float = 60, interval: float = 0.3):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"condition not met in {timeout}s (last: {last!r})")


def headers_of(msg) -> dict[str, str]:
    return {k: v.decode() for k, v in (msg.headers() or [])}
