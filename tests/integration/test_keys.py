"""SowKeys on a real broker: key values count by their text, and an older store is never mixed in."""

from __future__ import annotations

import hashlib
import time

import orjson
import pytest

from processor.client.sow_client import Client
from processor.core.keys import owner_partition
from processor.kafka.clients import ensure_topics, make_producer, topic_configs
from processor.topology import load_topology

from .workers import Worker, producer, read_all, send, wait_until, write_topology

pytestmark = pytest.mark.integration


def test_five_and_string_five_are_one_record(kafka_bootstrap, unique_name, tmp_path):
    """Seed 003: the SowKey comes from the key values as text, with the key domain."""
    topic = unique_name
    path = write_topology(tmp_path, topic, key=["/id", "/leg"])
    client = Client(kafka_bootstrap, load_topology(path))
    w = Worker(kafka_bootstrap, path, f"g-{topic}", tmp_path / "d1").start()
    try:
        p = producer(kafka_bootstrap)
        # Keyed alike so Kafka keeps their order; the worker computes each SowKey from the content.
        for value in ({"id": 5, "leg": True, "a": 1}, {"id": "5", "leg": "true", "b": 2}, {"id": 5.0, "leg": True, "c": 3}, {"id": 6, "leg": 1}):
            send(p, topic, value, key=b"same")
        p.flush(30)
        wait_until(lambda: len(read_all(kafka_bootstrap, f"{topic}.diff")) == 4)
        entries = client.query(topic)
        assert sorted((e.sow_key, orjson.dumps(e.record)) for e in entries) == sorted([
            (client.spec(topic).key_spec.sow_key({"id": "5", "leg": "true"}), orjson.dumps({"id": 5.0, "leg": True, "c": 3})),
            (client.spec(topic).key_spec.sow_key({"id": 6, "leg": 1}), orjson.dumps({"id": 6, "leg": 1})),
        ])
        ops = [dict(m.headers())["sow-op"] for m in read_all(kafka_bootstrap, f"{topic}.sow")]
        assert sorted(ops) == [b"insert", b"insert", b"update", b"update"]
    finally:
        w.kill()


def _format1_key(domain: str, values: list) -> str:
    payload = domain.encode() + b"\x1f" + orjson.dumps(values)
    return str(int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "big"))


def test_worker_refuses_a_changelog_of_the_older_key_format(kafka_bootstrap, unique_name, tmp_path, admin):
    """A `.sow` written by a ksow of key format 1 (number keys): the worker stops with the rebuild
    steps instead of keeping a second record beside each old one."""
    topic = unique_name
    path = write_topology(tmp_path, topic, persistence="memory")
    spec = load_topology(path).topic(topic)
    ensure_topics(admin, topic_configs(spec))
    old = _format1_key(topic, [7])
    p = make_producer(kafka_bootstrap)
    p.produce(spec.sow_topic, orjson.dumps({"id": 7}), old.encode(), owner_partition(old, spec.partitions),
              headers=[("sow-key", old.encode()), ("sow-op", b"insert"), ("sow-seq", b"%d" % (int(time.time() * 1e6) << 10))])
    assert p.flush(30) == 0
    w = Worker(kafka_bootstrap, path, f"g-{topic}", tmp_path / "d1").start(wait=False)
    try:
        assert w.proc is not None
        w.proc.wait(60)
        assert w.proc.returncode != 0
        assert "the SOW was written under an older SowKey rule" in w.log()
    finally:
        w.kill()


def test_worker_refuses_a_sow_written_under_another_key(kafka_bootstrap, unique_name, tmp_path):
    """The topology's key changed from /id to /code under an existing SOW: the worker stopped
    keeping the old records beside new ones (a publish of order 1 made a second record of it).
    It stops in one line, with the choices; with the former key back it serves the SOW as it was."""
    topic = unique_name
    path = write_topology(tmp_path, topic)
    client = Client(kafka_bootstrap, load_topology(path))
    w = Worker(kafka_bootstrap, path, f"g-{topic}", tmp_path / "d").start()
    try:
        for i in range(8):
            client.publish(topic, {"id": i, "code": f"c{i}"})
        client.flush()
        wait_until(lambda: len(client.query(topic)) == 8, 60, "8 records")
    finally:
        w.stop()
    original = path.read_text()
    path.write_text(original.replace("/id", "/code"))
    refused = Worker(kafka_bootstrap, path, f"g-{topic}", tmp_path / "d", "refused").start(wait=False)
    try:
        assert refused.proc.wait(90) == 1
    finally:
        refused.kill()
    assert "the SOW was written under another key definition than the topology's (key [/code]" in refused.log()
    assert "Traceback" not in refused.log()
    path.write_text(original)
    again = Worker(kafka_bootstrap, path, f"g-{topic}", tmp_path / "d", "again").start()
    try:
        wait_until(lambda: sorted(e.record["id"] for e in Client(kafka_bootstrap, load_topology(path)).query(topic)) == list(range(8)), 60, "the SOW as it was")
    finally:
        again.stop()
