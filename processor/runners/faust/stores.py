"""Where a worker keeps its partitions' RocksDB stores on disk.

Every worker on a data folder keeps its stores in one tree, `<data-dir>/sow/<topic>/p<N>`: a single
`ksow up` and each worker of `ksow up --workers N` alike. A partition that moves between the workers
of a host (a rebalance; a restart, after which the range assignment orders the members by new random
IDs) or a pool scaled from N workers to M finds its store where its last owner on the host left it,
and replays only the changelog written since, not the whole log. RocksDB's lock keeps a store to one
process at a time; a worker lets go of a revoked partition's store as soon as its new assignment
leaves it out (`SowLoop._on_assign`), so the next owner waits at most for that.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import time
from pathlib import Path

from processor.contract.errors import ConfigError
from processor.state.base import IndexSpec, PartitionStore, StoreInUse, open_partition_store
from processor.state.rocksdb import destroy

log = logging.getLogger("ksow.loop")

STORE_WAIT_S = 30.0  # how long a new owner waits for another local process to let go of a store
_PARTITION = re.compile(r"p\d+")


def hold_data_dir(path: Path):
    """Lock a worker's data folder for the life of the process (the open file holds the lock): two
    workers on one folder would share RocksDB stores, which RocksDB refuses only when a partition
    opens, with a traceback, after the second worker joined the group and moved partitions."""
    lock = open(path / ".lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise ConfigError(f"the data folder {path} is in use by another worker on this host: give each worker "
                          "its own --data-dir (KSOW_DATA_DIR), or run them with --workers N") from None
    return lock


def store_path(root: Path, topic: str, p: int) -> Path:
    return root / "sow" / topic / f"p{p}"


def open_store(root: Path, topic: str, p: int, indexes: IndexSpec, owner: str, wait_s: float = STORE_WAIT_S) -> PartitionStore:
    """The partition's store under `root`. One another process still holds after `wait_s` (a
    stalled worker of this host, evicted from the group) is left to it: this worker restores into a
    spare of its own beside it (`p<N>.spare-<owner>`), which the next open of the shared store
    deletes."""
    path = store_path(root, topic, p)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            store = open_partition_store("rocksdb", str(path), indexes)
        except StoreInUse:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        else:
            _remove_spares(path)
            return store
    spare = path.with_name(f"{path.name}.spare-{owner}")
    log.warning("the store of %s partition %d (%s) is still open in another process after %.0f s: "
                "restoring into %s instead", topic, p, path, wait_s, spare)
    return open_partition_store("rocksdb", str(spare), indexes)


def _remove_spares(path: Path) -> None:
    for spare in path.parent.glob(f"{path.name}.spare-*"):
        try:
            destroy(spare)
        except StoreInUse:
            continue  # its worker still restores or runs on it
        shutil.rmtree(spare, ignore_errors=True)
        log.info("removed the spare store %s", spare)


def adopt_worker_stores(root: Path) -> None:
    """Move the stores that workers of an earlier release kept apart (`<root>/worker-<i>/sow/...`,
    one tree each) into the shared tree. Of two copies of a partition's store the one written last
    stays (it belonged to the partition's latest owner, so it has the least changelog to replay; any
    copy would be made current by the replay); the others are deleted. A worker folder still locked
    by a running worker is left alone."""
    copies: dict[tuple[str, str], list[Path]] = {}
    for worker in sorted(root.glob("worker-*/")):
        if (worker / "sow").is_dir() and not _in_use(worker):
            for store in (worker / "sow").glob("*/p*"):
                if _PARTITION.fullmatch(store.name) and store.is_dir():
                    copies.setdefault((store.parent.name, store.name), []).append(store)
    for (topic, name), found in copies.items():
        shared = root / "sow" / topic / name
        candidates = ([shared] if shared.is_dir() else []) + found
        latest = max(candidates, key=_written_at)
        for stale in candidates:
            if stale is not latest:
                shutil.rmtree(stale, ignore_errors=True)
                log.warning("deleted %s: an older copy of the store of %s %s", stale, topic, name)
        if latest is not shared:
            shared.parent.mkdir(parents=True, exist_ok=True)
            os.rename(latest, shared)
            log.warning("moved %s to %s: the workers of a data folder share one tree of stores", latest, shared)
    for worker in root.glob("worker-*/sow"):  # emptied above
        if not any(worker.glob("*/*")):
            shutil.rmtree(worker, ignore_errors=True)


def _in_use(folder: Path) -> bool:
    """Whether a running worker holds the folder's lock (`hold_data_dir`)."""
    if not (folder / ".lock").exists():
        return False
    try:
        hold_data_dir(folder).close()
    except ConfigError:
        return True
    return False


def _written_at(store: Path) -> float:
    return max((f.stat().st_mtime for f in store.iterdir() if f.is_file()), default=0.0)
