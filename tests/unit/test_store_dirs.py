"""Where workers keep their stores: one tree per data folder, shared by the workers of a pool
(processor/runners/faust/stores.py), with RocksDB itself, in other processes where it matters."""

import fcntl
import os
import subprocess
import sys
import time

from processor.contract.types import SowRecord
from processor.runners.faust.stores import adopt_worker_stores, open_store, store_path
from processor.state import IndexSpec, open_partition_store

NO_INDEXES = IndexSpec((), track_age=False)


def write_store(path, records: dict) -> None:
    store = open_partition_store("rocksdb", str(path), NO_INDEXES)
    for key, data in records.items():
        store.stage(key, SowRecord(data, 1, None, 0))
    store.commit()
    store.close()


def keys_in(path) -> list[str]:
    store = open_partition_store("rocksdb", str(path), NO_INDEXES)
    try:
        return sorted(k for k, _ in store.records())
    finally:
        store.close()


def hold(path, seconds: float) -> subprocess.Popen:
    """Another process with the store at `path` open for `seconds`, as a worker that owns it."""
    code = ("import sys, time; from rocksdict import Rdict, Options; db = Rdict(sys.argv[1], Options(raw_mode=True)); "
            "print('open', flush=True); time.sleep(float(sys.argv[2])); db.close()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "open"
    return proc


def test_a_store_another_process_lets_go_of_is_opened_where_it_is(tmp_path):
    path = store_path(tmp_path, "t", 0)
    write_store(path, {"a": {"id": "a"}})
    holder = hold(path, 1.0)
    began = time.monotonic()
    store = open_store(tmp_path, "t", 0, NO_INDEXES, "me", wait_s=30)
    try:
        assert time.monotonic() - began >= 0.5  # it waited for the holder
        assert [k for k, _ in store.records()] == ["a"]
        assert not list(path.parent.glob("p0.spare-*"))
    finally:
        store.close()
        holder.wait(10)


def test_a_store_held_past_the_wait_is_left_to_its_holder_and_a_spare_serves(tmp_path):
    path = store_path(tmp_path, "t", 0)
    write_store(path, {"a": {"id": "a"}})
    holder = hold(path, 60)
    try:
        spare = open_store(tmp_path, "t", 0, NO_INDEXES, "me", wait_s=0.3)
        assert list(spare.records()) == []  # a new store: the caller restores it from the changelog
        spare.stage("b", SowRecord({"id": "b"}, 1, None, 0))
        spare.commit()
        # The spare's owner runs on it; the shared store is still held: nothing is deleted.
        again = open_store(tmp_path, "t", 1, NO_INDEXES, "me", wait_s=0)  # another partition opens fine
        again.close()
        assert (path.parent / "p0.spare-me").is_dir()
    finally:
        holder.kill()
        holder.wait(10)
    # The next open of the shared store (its holder gone) takes it back and deletes the spare, once
    # no one has it open.
    store = open_store(tmp_path, "t", 0, NO_INDEXES, "other", wait_s=0)
    assert [k for k, _ in store.records()] == ["a"]
    assert (path.parent / "p0.spare-me").is_dir()  # still open here
    store.close()
    spare.close()
    store = open_store(tmp_path, "t", 0, NO_INDEXES, "other", wait_s=0)
    store.close()
    assert not (path.parent / "p0.spare-me").exists()


def test_stores_kept_apart_by_earlier_pools_move_into_the_shared_tree(tmp_path):
    write_store(tmp_path / "worker-0" / "sow" / "t" / "p0", {"old": {}})
    write_store(tmp_path / "worker-1" / "sow" / "t" / "p0", {"new": {}})
    write_store(tmp_path / "worker-0" / "sow" / "t" / "p1", {"one": {}})
    write_store(tmp_path / "worker-0" / "sow" / "u" / "p0", {"u": {}})
    past = time.time() - 3600
    for f in (tmp_path / "worker-0" / "sow" / "t" / "p0").iterdir():
        os.utime(f, (past, past))  # worker-1 wrote its copy of t/p0 last: it owned it last
    write_store(tmp_path / "worker-2" / "sow" / "t" / "p2", {"busy": {}})
    running = open(tmp_path / "worker-2" / ".lock", "a")  # a worker that still runs there
    fcntl.flock(running, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        adopt_worker_stores(tmp_path)
    finally:
        running.close()
    assert keys_in(store_path(tmp_path, "t", 0)) == ["new"]
    assert keys_in(store_path(tmp_path, "t", 1)) == ["one"]
    assert keys_in(store_path(tmp_path, "u", 0)) == ["u"]
    assert not (tmp_path / "worker-0" / "sow").exists() and not (tmp_path / "worker-1" / "sow").exists()
    assert keys_in(tmp_path / "worker-2" / "sow" / "t" / "p2") == ["busy"] and not store_path(tmp_path, "t", 2).exists()


def test_an_older_copy_does_not_replace_the_shared_store(tmp_path):
    write_store(tmp_path / "worker-0" / "sow" / "t" / "p0", {"old": {}})
    past = time.time() - 3600
    for f in (tmp_path / "worker-0" / "sow" / "t" / "p0").iterdir():
        os.utime(f, (past, past))
    write_store(store_path(tmp_path, "t", 0), {"shared": {}})
    adopt_worker_stores(tmp_path)
    assert keys_in(store_path(tmp_path, "t", 0)) == ["shared"]
    assert not (tmp_path / "worker-0" / "sow").exists()


def test_a_data_folder_serves_one_worker_or_pool_at_a_time(tmp_path):
    """`hold_data_dir`: the lock a worker (or a pool's parent) holds for its life; a second one is
    refused with what to do, and the folder is free again once the first lets go."""
    import pytest

    from processor.contract.errors import ConfigError
    from processor.runners.faust.stores import hold_data_dir

    held = hold_data_dir(tmp_path)
    with pytest.raises(ConfigError, match="in use by another worker on this host: give each worker its own --data-dir"):
        hold_data_dir(tmp_path)
    held.close()
    hold_data_dir(tmp_path).close()
