"""A topic's encoding changed under an existing SOW: the changelog is written again in the new one."""

from __future__ import annotations

import shutil
import time

import orjson
import pytest

from processor.client.sow_client import Client
from processor.topology import load_topology

from .workers import Worker, producer, set_topic_config, wait_until, write_topology

pytestmark = pytest.mark.integration


def schema(path, *fields: dict) -> None:
    path.write_text(orjson.dumps({"type": "record", "name": "Order", "fields": [
        {"name": "id", "type": "long"}, {"name": "status", "type": "string"}, *fields]}).decode())


def test_a_store_rebuilt_after_a_schema_change_keeps_the_records_written_before_it(kafka_bootstrap, unique_name, tmp_path):
    """A field added with a default to a topic's Avro schema: the values its `.sow` held no longer
    read under the new schema, and a store rebuilt from it (a worker on a new machine) passed them
    over, as did a client reading `.sow` without workers. The first worker with the new schema
    writes its records to `.sow` again, and holds them as the new schema reads them back."""
    topic = unique_name
    schema(tmp_path / "v1.avsc")
    schema(tmp_path / "v2.avsc", {"name": "qty", "type": "long", "default": 0})
    path = write_topology(tmp_path, topic, message_type="avro", schema=str(tmp_path / "v1.avsc"))
    group, data = f"g-{topic}", tmp_path / "d"

    def ids(source: str = "workers") -> list:
        client = Client(kafka_bootstrap, load_topology(path), group if source == "workers" else None)
        found = sorted(e.record["id"] for e in client.query(topic))
        return found if client.last_query_source == source else []

    w = Worker(kafka_bootstrap, path, group, data).start()
    try:
        client = Client(kafka_bootstrap, load_topology(path))
        for i in range(8):
            client.publish(topic, {"id": i, "status": "new"})
        client.flush()
        wait_until(lambda: ids() == list(range(8)), 60, "8 records")
    finally:
        w.stop()
    path.write_text(path.read_text().replace("/v1.avsc", "/v2.avsc"))
    w = Worker(kafka_bootstrap, path, group, data, "v2").start()
    try:
        client = Client(kafka_bootstrap, load_topology(path))
        client.publish(topic, {"id": 8, "status": "new", "qty": 3})
        client.flush()
        wait_until(lambda: ids() == list(range(9)), 60, "9 records")
        # The worker's own store holds what `.sow` now says: the new field with its default.
        kept = {e.record["id"]: e.record for e in Client(kafka_bootstrap, load_topology(path), group).query(topic)}
        assert kept[2] == {"id": 2, "status": "new", "qty": 0} and kept[8]["qty"] == 3
    finally:
        w.stop()
    rewritten = w.log()
    shutil.rmtree(data)  # the store is lost: rebuilt from `.sow`
    w = Worker(kafka_bootstrap, path, group, data, "rebuilt").start()
    try:
        wait_until(lambda: ids() == list(range(9)), 60, "the 9 records rebuilt from the changelog")
        records = {e.record["id"]: e.record for e in Client(kafka_bootstrap, load_topology(path), group).query(topic)}
        assert records[2] == {"id": 2, "status": "new", "qty": 0} and records[8]["qty"] == 3
    finally:
        w.stop()
    assert ids("changelog") == list(range(9))  # what a client reads without workers
    assert "the topic's encoding changed since its records were written to" in rewritten
    # A field added without a default: the records cannot be written in the new schema; the worker
    # stops in one line before it writes anything.
    schema(tmp_path / "v3.avsc", {"name": "qty", "type": "long", "default": 0}, {"name": "venue", "type": "string"})
    path.write_text(path.read_text().replace("/v2.avsc", "/v3.avsc"))
    refused = Worker(kafka_bootstrap, path, group, data, "refused").start(wait=False)
    try:
        assert refused.proc.wait(90) == 1
    finally:
        refused.kill()
    assert "the topic's encoding changed (avro, schema" in refused.log() and "cannot be written in the new one" in refused.log()
    assert "Traceback" not in refused.log()


def test_a_reseed_of_records_older_than_the_changelog_takes_is_not_refused(kafka_bootstrap, unique_name, tmp_path, admin):
    """`.sow` set to take timestamps of at most a day ago (message.timestamp.before.max.ms): a
    re-seed wrote each record with its last-change instant, two days ago here (a publisher's stamp,
    `timestamps: publisher`), which the broker refused, and the batch each time it was redone: the
    worker applied nothing more. The re-seed now writes such an instant as the oldest the topic takes."""
    topic = unique_name
    schema(tmp_path / "v1.avsc")
    path = write_topology(tmp_path, topic, timestamps="publisher")
    group, data = f"g-{topic}", tmp_path / "d"
    day = 86_400_000
    w = Worker(kafka_bootstrap, path, group, data).start()
    try:
        p = producer(kafka_bootstrap)
        two_days_ago = int(time.time() * 1000) - 2 * day
        for i in range(4):
            p.produce(topic, orjson.dumps({"id": i, "status": "old"}), b"k", timestamp=two_days_ago + i)
        p.flush(30)
        wait_until(lambda: len(Client(kafka_bootstrap, load_topology(path), group).query(topic)) == 4, 60, "4 records")
    finally:
        w.stop()
    set_topic_config(admin, f"{topic}.sow", "message.timestamp.before.max.ms", str(day))
    write_topology(tmp_path, topic, timestamps="publisher", message_type="avro", schema=str(tmp_path / "v1.avsc"))  # the same file
    w = Worker(kafka_bootstrap, path, group, data, "avro").start()
    try:
        client = Client(kafka_bootstrap, load_topology(path))
        client.publish(topic, {"id": 9, "status": "new"})
        client.flush()  # else the producer may be closed before it sends
        wait_until(lambda: len(Client(kafka_bootstrap, load_topology(path), group).query(topic)) == 5, 60, "the 5th record applied")
        assert "batch not committed" not in w.log()
    finally:
        w.stop()

