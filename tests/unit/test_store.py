"""The store contract, run against every backend (RocksDB for real, and memory)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processor.contract.types import SowRecord
from processor.state import IndexSpec, open_partition_store


@pytest.fixture(params=["rocksdb", "memory"])
def store(request, tmp_path):
    s = open_partition_store(request.param, str(tmp_path / "p0"), IndexSpec((("/status",), ("/region", "/desk")), track_age=True))
    yield s
    s.close()


def rec(data, seq=1, exp=None, upd=0):
    return SowRecord(data, seq, exp, upd)


def write_all(backend, values: dict) -> None:
    """Put raw entries straight into a backend (stores as an earlier release left them)."""
    batch = backend.batch()
    for key, value in values.items():
        batch.put(key, value)
    backend.write(batch)


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
    assert list(store.oldest()) == [(2, "b"), (3, "a")]
    store.stage("b", None)
    store.commit()
    assert list(store.lookup(0, ("open",))) == [] and list(store.due(10_000)) == [(900, "a")]
    assert store.count() == 1


@pytest.mark.parametrize("value, text", [
    ([0, False], "/status = FALSE"),
    ([0, False], "/status = 0"),
    (True, "/status IN (1, TRUE)"),
    (1, "/status IN (TRUE, 1)"),
    (False, "/status IN (0, FALSE)"),
    (2.0**60, "/status IN (1152921504606846976)"),  # the int and the float it equals: one Python value, two keys
])
def test_an_index_finds_values_python_takes_for_one(store, value, text):
    """True and 1 (False and 0) are one key to a Python set but two to the index: neither may hide
    the other when a record is indexed or a filter's values are looked up."""
    from processor.core.filters import compile_filter
    from processor.state.base import choose_index

    store.stage("a", rec({"status": value}, 1))
    store.commit()
    f = compile_filter(text)
    assert f.matches({"status": value})
    no, combos = choose_index(f, store.indexes.hash_indexes)
    assert no == 0 and {k for combo in combos for k in store.lookup(no, combo)} == {"a"}


def test_hash_indexes_are_rebuilt_when_the_topology_changes_them(tmp_path):
    """A store opened with other hash indexes than it was written with (an index added to the
    topology, or entries of an older INDEX_FORMAT) indexes every record again: none may be hidden
    from an equality query or delete, and no stale entry may stay."""
    path = str(tmp_path / "p0")
    s = open_partition_store("rocksdb", path, IndexSpec((("/status",),)))
    s.stage("a", rec({"status": "open", "region": "EU"}, 1))
    s.stage("b", rec({"status": [0, False], "region": "US"}, 2))
    s.commit()
    s.close()
    s = open_partition_store("rocksdb", path, IndexSpec((("/region",), ("/status",))))
    assert list(s.lookup(0, ("EU",))) == ["a"] and list(s.lookup(0, ("open",))) == []
    assert list(s.lookup(1, ("open",))) == ["a"] and list(s.lookup(1, (False,))) == ["b"]
    s.close()
    s = open_partition_store("rocksdb", path, IndexSpec((("/region",), ("/status",))))  # the same: nothing to redo
    assert s.meta("indexes") != 0 and list(s.lookup(1, (0,))) == ["b"]
    s.close()


def test_a_prepared_commit_changes_nothing_until_applied(store):
    """A runner builds the batch while its transaction commits: until `commit(prepared)` the store
    is as committed, and a rollback (the transaction failed) drops the batch whole."""
    store.stage("a", rec({"status": "open"}, 1, 500, 10))
    store.commit()
    store.stage("a", rec({"status": "done"}, 2, 900, 20))
    store.stage("b", rec({"status": "open"}, 3, 700, 21))
    prepared = store.prepare()
    assert [k for k, _ in store.records()] == ["a"] and store.count() == 1
    assert list(store.due(10_000)) == [(500, "a")] and list(store.lookup(0, ("done",))) == []
    store.rollback()
    assert store.get("a").data == {"status": "open"} and store.get("b") is None and store.count() == 1
    store.stage("b", rec({"status": "open"}, 3, 700, 21))
    prepared = store.prepare()
    store.set_meta("changelog", 9)  # learnt once the transaction committed: goes with the batch
    store.commit(prepared)
    assert sorted(k for k, _ in store.records()) == ["a", "b"] and store.count() == 2
    assert store.meta("changelog") == 9 and list(store.due(10_000)) == [(500, "a"), (700, "b")]


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


@pytest.mark.parametrize("instant,stored", [(2**63, 2**63 - 1), (2**70, 2**63 - 1), (-5, 0)])
def test_expiry_instants_beyond_64_bits_are_clamped_not_fatal(store, instant, stored):
    """A record restored from a foreign changelog may carry any instant: the commit must succeed."""
    store.stage("a", rec({"status": "open"}, 1, instant, 10))
    store.commit()
    assert store.get("a").expires_at == stored
    assert list(store.due(2**63 - 2)) == ([] if stored > 0 else [(0, "a")])
    store.stage("a", None)  # the index entry is found again and removed
    store.commit()
    assert list(store.due(2**63 - 1)) == [] and store.count() == 0


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


def test_a_store_written_without_bloom_filters_reads_the_same(tmp_path):
    """Stores of earlier releases have table files without filters: opened with them, their records,
    and keys they lack, read as before (in table files, not only in the memtable)."""
    from rocksdict import Options, Rdict

    from processor.state.base import encode_record

    path = str(tmp_path / "old")
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    old = Rdict(path, options)
    for i in range(1000):
        old[b"r%d" % i] = encode_record(rec({"v": i}, i + 1, None, 5))
    old.flush()
    old.close()
    s = open_partition_store("rocksdb", path, IndexSpec())
    try:
        assert s.get("500") == rec({"v": 500}, 501, None, 5)
        assert s.get("1000") is None and s.get("x") is None
        s.stage("1000", rec({"v": 1000}, 1001, None, 6))
        s.commit()
        s.backend._db.flush()  # a new table file, with a filter, beside the old one
        s._committed.clear()
        assert s.get("1000") == rec({"v": 1000}, 1001, None, 6) and s.get("999") == rec({"v": 999}, 1000, None, 5)
    finally:
        s.close()


def test_due_finds_records_committed_behind_the_last_sweep(store):
    """due() resumes where the last sweep ended, yet a record written later with an earlier instant
    (a replayed or long-delayed input) is still due."""
    for i, at in enumerate((100, 200, 300)):
        store.stage(f"k{i}", rec({"i": i}, i, at))
    store.commit()
    for at, key in store.due(250):
        store.stage(key, None)
    store.commit()
    store.stage("late", rec({"i": 9}, 9, 50))
    store.commit()
    assert list(store.due(1_000)) == [(50, "late"), (300, "k2")]


def test_due_after_a_partial_sweep_or_a_rollback(store):
    for i in range(5):
        store.stage(f"k{i}", rec({"i": i}, i, 100 + i))
    store.commit()
    for n, (at, key) in enumerate(store.due(1_000)):
        if n == 2:
            break  # a sweep that stops at its batch limit
        store.stage(key, None)
    store.commit()
    assert [k for _, k in store.due(1_000)] == ["k2", "k3", "k4"]
    for _, key in store.due(1_000):
        store.stage(key, None)
    store.rollback()  # the removals were not delivered: the records are due again
    assert [k for _, k in store.due(1_000)] == ["k2", "k3", "k4"]


def test_pop_due_removes_what_it_hands_out_and_passes_over_changed_records(store):
    """pop_due() is due(), get() and remove() in one pass: each record it hands out is removed (a
    sweep that stops at its limit loses nothing), one updated or deleted since its entry was written
    is passed over, and a commit makes the removals durable."""
    for i in range(5):
        store.stage(f"k{i}", rec({"i": i}, i, 100 + i))
    store.commit()
    store.stage("k1", rec({"i": 1, "v": 2}, 9, 900))  # updated: due later
    store.stage("k3", None)  # deleted
    popped = []
    for at, key, record in store.pop_due(1_000):
        popped.append((at, key, record.data))
        if len(popped) == 2:
            break  # the sweep's limit: what it took is gone, the rest waits
    assert popped == [(100, "k0", {"i": 0}), (102, "k2", {"i": 2})]
    assert store.get("k0") is None and store.get("k2") is None and store.size() == 2
    assert [(at, key) for at, key, _ in store.pop_due(1_000)] == [(104, "k4")]  # k1's new entry is not committed yet
    store.commit()
    assert [k for k, _ in store.records()] == ["k1"] and store.count() == 1 and list(store.due(10_000)) == [(900, "k1")]


def test_a_sweep_clears_the_entries_it_went_past_and_keeps_those_written_in_its_batch(store):
    """The commit after a sweep deletes the expiry entries the sweep went past; entries the same
    batch writes among them (a record updated meanwhile, a new one) stay, the rest of the index too,
    and the next sweep finds what was written before the last entry it went past."""
    for i in range(4):
        store.stage(f"k{i}", rec({"i": i}, i, 100 + i))
    store.commit()
    for n, (at, key) in enumerate(store.due(1_000)):
        if n == 3:
            break  # the sweep's limit: k3 is not handled
        if key == "k1":
            store.stage(key, rec({"i": 1, "v": 2}, 9, 50))  # updated meanwhile: due again, earlier
        else:
            store.stage(key, None)
    store.stage("k9", rec({"i": 9}, 10, 101))  # new, its instant inside what the sweep went past
    store.commit()
    assert list(store.due(1_000)) == [(50, "k1"), (101, "k9"), (103, "k3")]
    assert sorted(k for k, _ in store.records()) == ["k1", "k3", "k9"] and store.count() == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "sweep", "rollback"]), st.integers(0, 7), st.integers(0, 50)), max_size=40))
def test_due_agrees_with_a_model(steps):
    """Whatever the order of writes, sweeps and rollbacks, due(now) lists exactly the committed
    records whose instant is at or before now."""
    store = open_partition_store("memory", None, IndexSpec())
    model: dict[str, int] = {}
    for action, k, t in steps:
        if action == "put":
            store.stage(f"k{k}", rec({"k": k}, 1, t))
            store.commit()
            model[f"k{k}"] = t
        elif action == "sweep":
            for n, (at, key) in enumerate(store.due(t)):
                if n == k:
                    break
                store.stage(key, None)
                model.pop(key)
            store.commit()
        else:
            for _, key in store.due(t):
                store.stage(key, None)
            store.rollback()
        now = t + 3
        assert list(store.due(now)) == sorted((at, key) for key, at in model.items() if at <= now)
        store.rollback()  # a look that handled nothing: due() counts what it handed out as handled


def test_least_recently_updated_follows_the_order_of_updates_within_a_millisecond(store):
    """The age index is keyed by event ID: records updated in the same millisecond are evicted in
    the order they were updated, not in SowKey order."""
    for seq, key in enumerate(["z", "a", "m"], start=1):
        store.stage(key, rec({"k": key}, seq, None, 100))
    store.commit()
    store.stage("z", rec({"k": "z", "again": True}, 4, None, 100))  # staged: the most recent
    assert [k for k, _ in store.least_recently_updated()] == ["a", "m", "z"]
    store.commit()
    assert [k for k, _ in store.least_recently_updated()] == ["a", "m", "z"]


def test_an_age_index_by_instant_is_moved_to_event_ids(tmp_path):
    """Stores of earlier releases keyed the age index by update instant; opening one moves it."""
    import struct

    from processor.state.base import IndexSpec, PartitionStore, encode_record
    from processor.state.rocksdb import RocksDBBackend

    backend = RocksDBBackend(tmp_path / "old")
    writes = {}
    for seq, key in [(5, "b"), (9, "a")]:
        writes[b"r" + key.encode()] = encode_record(rec({"k": key}, seq, None, 100))
        writes[b"u" + struct.pack(">Q", 100) + key.encode()] = b""
    write_all(backend, writes)
    store = PartitionStore(backend, IndexSpec(track_age=True))
    assert list(store.oldest()) == [(5, "b"), (9, "a")]
    assert list(backend.scan(b"u", b"v")) == []


def test_sweeps_of_one_batch_do_not_read_again_what_it_expired(store):
    """Within a batch, due() resumes after the entries a sweep went past (their removal is only
    staged); a rollback forgets that, so an aborted batch's expiries are found again."""
    for i in range(6):
        store.stage(f"k{i}", rec({"i": i}, i + 1, 100 + i))
    store.commit()
    swept = []
    for at, key in store.due(1000):
        if len(swept) == 3:
            break
        store.stage(key, None)
        swept.append(key)
    assert swept == ["k0", "k1", "k2"]
    assert [k for _, k in store.due(1000)] == ["k3", "k4", "k5"]
    store.rollback()
    assert [k for _, k in store.due(1000)] == [f"k{i}" for i in range(6)]
    store.rollback()
    for _, key in store.due(102):
        store.stage(key, None)
    store.commit()
    assert [k for _, k in store.due(1000)] == ["k3", "k4", "k5"]


class _CountingBackend:
    """A backend that counts point reads (to show what a sweep reads)."""

    def __init__(self, inner):
        self.inner, self.gets = inner, 0

    def get(self, key):
        self.gets += 1
        return self.inner.get(key)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("kind", ["rocksdb", "memory"])
def test_a_sweep_reads_records_from_the_expiry_index_not_one_by_one(tmp_path, kind):
    """An expiry entry carries its record as committed, so expiring N records is one range scan,
    not N point reads; the record it hands over is the latest committed version."""
    from processor.state.base import PartitionStore

    backend = _CountingBackend(open_partition_store(kind, str(tmp_path / "p0"), IndexSpec()).backend)
    store = PartitionStore(backend, IndexSpec())
    for i in range(5):
        store.stage(f"k{i}", rec({"i": i}, i + 1, 100 + i, 7))
    store.commit()
    store.stage("k1", rec({"i": 1, "v": 2}, 9, 101, 8))  # updated, same instant: the entry is rewritten
    store.commit()
    store._committed.clear()  # a cold cache, as after a restart
    before = backend.gets
    due = [(at, key, store.get(key)) for at, key in store.due(1000)]
    assert backend.gets == before
    assert due == [(100 + i, f"k{i}", rec({"i": 1, "v": 2}, 9, 101, 8) if i == 1 else rec({"i": i}, i + 1, 100 + i, 7)) for i in range(5)]


def test_an_expiry_index_without_records_is_still_swept(tmp_path):
    """Stores of earlier releases have empty expiry entries: a sweep then reads each record."""
    import struct

    from processor.state.base import IndexSpec, PartitionStore, encode_record
    from processor.state.rocksdb import RocksDBBackend

    backend = RocksDBBackend(tmp_path / "old")
    write_all(backend, {b"r" + b"a": encode_record(rec({"k": "a"}, 3, 500, 100)), b"x" + struct.pack(">Q", 500) + b"a": b""})
    store = PartitionStore(backend, IndexSpec())
    assert [(at, key, store.get(key)) for at, key in store.due(1000)] == [(500, "a", rec({"k": "a"}, 3, 500, 100))]


@pytest.mark.parametrize("kind", ["rocksdb", "memory"])
def test_records_stored_without_a_capacity_are_in_the_age_index_once_one_is_set(tmp_path, kind):
    """Only a topic with a capacity writes age entries: a store that ran without one and is opened
    with one indexes its records by age at open, so capacity can evict them (it evicted none)."""
    from processor.state.base import PartitionStore

    store = open_partition_store(kind, str(tmp_path / "p0"), IndexSpec())
    for seq, key in [(7, "b"), (3, "c"), (5, "a")]:
        store.stage(key, rec({"k": key}, seq))
    store.commit()
    backend = store.backend
    if kind == "rocksdb":
        store.close()
        from processor.state.rocksdb import RocksDBBackend

        backend = RocksDBBackend(str(tmp_path / "p0"))
    store = PartitionStore(backend, IndexSpec(track_age=True))
    assert [k for k, _ in store.least_recently_updated()] == ["c", "a", "b"]
    store.close()


def test_records_updated_while_a_store_had_no_capacity_keep_their_place_when_it_is_set_again(tmp_path):
    """Capacity set, removed, set again: the records written meanwhile are evicted in the order of
    their updates, and the entries left from before (no longer kept up) are gone."""
    from processor.state.base import PartitionStore
    from processor.state.rocksdb import RocksDBBackend

    def reopen(store, track_age):
        store.close()
        return PartitionStore(RocksDBBackend(str(tmp_path / "p0")), IndexSpec(track_age=track_age))

    store = open_partition_store("rocksdb", str(tmp_path / "p0"), IndexSpec(track_age=True))
    store.stage("a", rec({"k": "a"}, 1))
    store.stage("b", rec({"k": "b"}, 2))
    store.commit()
    store = reopen(store, False)
    store.stage("a", rec({"k": "a", "again": True}, 3))
    store.stage("c", rec({"k": "c"}, 4))
    store.commit()
    store = reopen(store, True)
    assert [k for k, _ in store.least_recently_updated()] == ["b", "a", "c"]
    assert list(store.oldest()) == [(2, "b"), (3, "a"), (4, "c")]
    store.close()


def test_rocksdb_stores_filter_memtable_reads_by_bloom(tmp_path):
    """A store's RocksDB keeps a Bloom filter over each memtable's whole keys (a read of a record the
    memtable lacks skips its skip list) and over each table file: RocksDB says so in the OPTIONS file
    it writes for the database it opened."""
    from processor.state.rocksdb import MEMTABLE_BLOOM_RATIO, RocksDBBackend

    backend = RocksDBBackend(tmp_path / "db")
    backend.close()
    written = max((tmp_path / "db").glob("OPTIONS-*")).read_text()
    assert "memtable_whole_key_filtering=true" in written
    assert f"memtable_prefix_bloom_size_ratio={MEMTABLE_BLOOM_RATIO:f}" in written
    assert "filter_policy=bloomfilter" in written


def test_rocksdb_stores_of_a_process_share_one_memory_budget(tmp_path, monkeypatch):
    """Every RocksDB store of a process charges its memtables to one budget (KSOW_ROCKSDB_MEMORY_MB,
    half of it for memtables): written past it, the stores flush to table files (alone, each would
    have held its 20 MB in a 64 MiB memtable) and, their flushes done, hold no more than it."""
    import random
    import time
    from pathlib import Path

    import processor.state.rocksdb as rocksdb

    monkeypatch.setenv("KSOW_ROCKSDB_MEMORY_MB", "64")
    monkeypatch.setattr(rocksdb, "_memory", None)
    stores = [rocksdb.RocksDBBackend(tmp_path / f"s{i}") for i in range(4)]
    _, memtables = rocksdb._memory
    assert memtables.get_buffer_size() == 32 << 20
    rng = random.Random(7)
    for _ in range(20):  # 4 stores x 20 x 1 MB: two and a half times the budget
        for store in stores:
            batch = store.batch()
            for _ in range(6000):
                batch.put(rng.randbytes(16), rng.randbytes(150))
            store.write(batch)
    assert all(list(Path(store.path).glob("*.sst")) for store in stores)
    deadline = time.monotonic() + 10
    while memtables.get_usage() > 32 << 20 and time.monotonic() < deadline:
        time.sleep(0.05)  # flushes run on RocksDB's threads
    assert memtables.get_usage() <= 32 << 20
    for store in stores:
        store.close()


def test_the_stores_of_a_process_share_one_bound_on_cached_records(monkeypatch):
    """Decoded records kept between batches are bounded for the process (KSOW_CACHE_RECORDS), each
    open store keeping its share, not per store: a worker's memory does not grow with its partitions.
    A store alone keeps the whole budget."""
    import gc

    from processor.state import base

    gc.collect()  # stores other tests left unclosed and unreferenced no longer count
    monkeypatch.setenv("KSOW_CACHE_RECORDS", "120")
    stores = [open_partition_store("memory", None, IndexSpec()) for _ in range(4)]
    share = 120 // len(base._OPEN)
    assert share <= 30
    for n, store in enumerate(stores):
        for batch in range(5):
            for i in range(20):
                store.stage(f"k{batch}-{i}", rec({"n": n, "i": i}, batch * 20 + i + 1))
            store.commit()
            assert len(store._committed) <= share
    for store in stores[1:]:
        store.close()
    alone = stores[0]
    alone._committed.clear()
    for i in range(100):
        alone.stage(f"new{i}", rec({"i": i}, 1000 + i))
    alone.commit()
    if len(base._OPEN) == 1:
        assert len(alone._committed) == 100  # within the 120 it now has alone
    alone.close()
