"""A view added to a topic that already has records, or whose filter changed: `<view>.sow` is seeded
from the SOW, on the worker's own store or on one rebuilt from the changelog, and only once."""

from __future__ import annotations

import shutil

import pytest
import yaml

from processor.client.sow_client import Client
from processor.topology import load_topology

from .workers import Worker, compacted, read_all, wait_until, write_topology

pytestmark = pytest.mark.integration


def test_a_view_added_or_changed_is_seeded_from_the_records_the_sow_holds(kafka_bootstrap, unique_name, tmp_path):
    topic, view = unique_name, f"{unique_name}-open"
    path = write_topology(tmp_path, topic)
    group, data = f"g-{topic}", tmp_path / "d"
    w = Worker(kafka_bootstrap, path, group, data).start()
    try:
        client = Client(kafka_bootstrap, load_topology(path))
        for i in range(20):
            client.publish(topic, {"id": i, "status": "open" if i % 2 == 0 else "filled", "qty": i})
        client.flush()
        wait_until(lambda: len(Client(kafka_bootstrap, load_topology(path), group).query(topic)) == 20, 60, "20 records")
    finally:
        w.stop()
    keys = {i: load_topology(path).topic(topic).key_spec.sow_key({"id": i}).encode() for i in range(20)}

    def with_view(filter_text: str) -> None:
        topology = yaml.safe_load(path.read_text())
        topology["views"] = [{"name": view, "topic": topic, "filter": filter_text}]
        path.write_text(yaml.safe_dump(topology))

    # Added: the records it matches are written to `<view>.sow`, the worker keeping its store.
    with_view("/status = 'open'")
    w = Worker(kafka_bootstrap, path, group, data, "added").start()
    try:
        wait_until(lambda: set(compacted(kafka_bootstrap, f"{view}.sow")) == {keys[i] for i in range(0, 20, 2)}, 60, "the 10 open records in the view")
    finally:
        w.stop()
    assert "to the views new or changed since it was last committed" in w.log()
    # Changed, on a new machine (the store rebuilt from `.sow`): the records it matches now are
    # written, those it matched before and does not now are tombstoned.
    with_view("/qty >= 10")
    shutil.rmtree(data)
    w = Worker(kafka_bootstrap, path, group, data, "changed").start()
    try:
        wait_until(lambda: set(compacted(kafka_bootstrap, f"{view}.sow")) == {keys[i] for i in range(10, 20)}, 60, "records 10-19 in the view")
        client = Client(kafka_bootstrap, load_topology(path))
        client.publish(topic, {"id": 3, "status": "filled", "qty": 30})  # the view goes on from there
        client.flush()
        wait_until(lambda: keys[3] in compacted(kafka_bootstrap, f"{view}.sow"), 60, "record 3 in the view")
    finally:
        w.stop()
    written = len(read_all(kafka_bootstrap, f"{view}.sow"))
    # Unchanged, on yet another machine: nothing is seeded again.
    shutil.rmtree(data)
    w = Worker(kafka_bootstrap, path, group, data, "unchanged").start()
    try:
        wait_until(lambda: len(Client(kafka_bootstrap, load_topology(path), group).query(view)) == 11, 60, "the view answered")
    finally:
        w.stop()
    assert "to the views new or changed" not in w.log()
    assert len(read_all(kafka_bootstrap, f"{view}.sow")) == written
