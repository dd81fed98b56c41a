"""Where the workers are: each worker announces its HTTP address and the SOW partitions it serves
on the compacted topic `__ksow_workers`, so clients can fan a query out to all of them.

An entry is refreshed every few seconds and removed (tombstone) when the worker stops; readers
ignore entries older than STALE_MS, which covers workers that died without saying so.
"""

from __future__ import annotations

import time

import orjson
from confluent_kafka import KafkaException, TopicPartition

from processor.kafka.clients import end_offsets, ensure_topics, make_consumer, read_until

REGISTRY_TOPIC = "__ksow_workers"
REFRESH_S = 3.0
STALE_MS = 12_000


def ensure_registry(admin, replication_factor: int | None = None, min_insync_replicas: int | None = None) -> None:
    ensure_topics(
        admin,
        {REGISTRY_TOPIC: (1, {"cleanup.policy": "compact", "min.compaction.lag.ms": "0"})},
        replication_factor=replication_factor,
        min_insync_replicas=min_insync_replicas,
    )


def announcement(group: str, url: str, served: dict[str, list[int]]) -> tuple[bytes, bytes]:
    key = f"{group}|{url}".encode()
    value = orjson.dumps({"group": group, "url": url, "topics": served, "at": int(time.time() * 1000)})
    return key, value


def live_workers(bootstrap: str, group: str) -> list[dict]:
    """The workers of a group that announced themselves recently."""
    consumer = make_consumer(bootstrap)
    try:
        try:
            ((_, high),) = end_offsets(consumer, REGISTRY_TOPIC, [0], timeout=3).values()
        except KafkaException:  # no worker ever announced itself on this cluster
            return []
        consumer.assign([TopicPartition(REGISTRY_TOPIC, 0, 0)])
        latest: dict[bytes, dict | None] = {}
        for msg in read_until(consumer, {(REGISTRY_TOPIC, 0): high}):
            latest[msg.key()] = None if msg.value() is None else orjson.loads(msg.value())
    finally:
        consumer.close()
    now = time.time() * 1000
    return [w for w in latest.values() if w and w["group"] == group and now - w["at"] < STALE_MS]
