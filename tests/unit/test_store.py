"""The store contract, run against every backend (RocksDB for real, and memory)."""

import pytest

from processor.api.types import SowRecord
from processor.state import IndexSpec, open_partition_store


@pytest.fixture(params=["rocksdb", "memory"])
def store(request, tmp_path):
    s = open_partition_store(request.param, str(tmp_path / "p0"), IndexSpec((("/status",), ("/region", "/desk")), track_age=True))
    yield s
    s.close()


def rec(data, seq=1, exp=None, upd=0):
    return SowRecord(data, seq, exp, upd)


def test_staged_writes_are_visible_then_durable(store):
    store.stage("a", rec({"status": "open"}, 1, 500, 10))
    assert store.get("a").data == {"status": "open"}
    assert list(store.records()) == []  # not committed yet
    store.set_meta("changelog", 7)
    store.commit()
    assert [k for k, _ in store.records()] == ["a"]
    assert store.meta("changelog") == 7 and store.count() == 1


def test_indexes_follow_updates_and_deletes(store):
    store.stage("a", rec({"status": "open", "region": "EU", "desk": 1}, 1, 500, 10))
    store.stage("b", rec({"status": "open"}, 2, 700, 11))
    store.commit()
    assert sorted(store.lookup(0, ("open",))) == ["a", "b"]
    assert list(store.lookup(1, ("EU", 1))) == ["a"]
    assert list(store.due(600)) == [(500, "a")]
    store.stage("a", rec({"status": "done", "region": "EU", "desk": 1}, 3, 900, 20))
    store.commit()
    assert list(store.lookup(0, ("open",))) == ["b"]
    assert list(store.lookup(0, ("done",))) == ["a"]
    assert list(store.due(800)) == [(700, "b")]
    assert list(store.oldest()) == [(11, "b"), (20, "a")]
    store.stage("b", None)
    store.commit()
    assert list(store.lookup(0, ("open",))) == [] and list(store.due(10_000)) == [(900, "a")]
    assert store.count() == 1


def test_rollback_and_clear(store):
    store.stage("a", rec({"x": 1}))
    store.rollback()
    assert store.get("a") is None
    store.stage("a", rec({"x": 1}))
    store.commit()
    store.clear()
    assert store.get("a") is None and store.count() == 0


def test_same_key_staged_twice_in_a_batch(store):
    store.stage("a", rec({"status": "open"}, 1, 100))
    store.commit()
    store.stage("a", rec({"status": "x"}, 2, 200))
    store.stage("a", None)
    store.commit()
    assert store.get("a") is None and list(store.due(10_000)) == [] and store.count() == 0


def test_rocksdb_survives_reopen(tmp_path):
    path = str(tmp_path / "p1")
    s = open_partition_store("rocksdb", path, IndexSpec())
    s.stage("k", rec({"v": 1}, 9, None, 5))
    s.set_meta("changelog", 3)
    s.commit()
    s.close()
    s = open_partition_store("rocksdb", path, IndexSpec())
    assert s.get("k") == rec({"v": 1}, 9, None, 5) and s.meta("changelog") == 3
    s.close()
