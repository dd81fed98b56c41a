"""Helpers for integration tests: real `ksow up` worker processes, topologies, reading topics."""

from __future__ import annotations

from pathlib import Path

import orjson
import yaml
from confluent_kafka import Producer

from processor.testing import WorkerProcess, read_topic, wait_until  # noqa: F401 (used by the tests)


def write_topology(tmp_path: Path, topic: str, views: list[dict] | None = None, **options) -> Path:
    entry = {"topic": topic, "key": ["/id"], "partitions": 4, **options}
    path = tmp_path / f"{topic}.yaml"
    path.write_text(yaml.safe_dump({"sow": [entry], **({"views": views} if views else {})}))
    return path


Worker = WorkerProcess


def set_topic_config(admin, topic: str, name: str, value: str) -> None:
    """Set one setting of a topic, as an operator would under running workers."""
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

    resource = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)])
    admin.incremental_alter_configs([resource])[resource].result(30)


def producer(bootstrap: str) -> Producer:
    return Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})


def send(p: Producer, topic: str, value, key: bytes | None = None, headers=None) -> None:
    raw = value if isinstance(value, (bytes, type(None))) else orjson.dumps(value)
    p.produce(topic, raw, key, headers=headers or [])


def read_all(bootstrap: str, topic: str, partitions: int = 4) -> list:
    """Every message of a topic up to its current end (read_committed), per partition in offset order."""
    return read_topic(bootstrap, topic, range(partitions))


def compacted(bootstrap: str, topic: str, partitions: int = 4) -> dict:
    """A compacted topic as a reader ends with it: the last value per key, tombstones removing."""
    found: dict = {}
    for msg in read_all(bootstrap, topic, partitions):
        if msg.value() is None:
            found.pop(msg.key(), None)
        else:
            found[msg.key()] = msg.value()
    return found


def headers_of(msg) -> dict[str, str]:
    return {k: v.decode() for k, v in (msg.headers() or [])}
