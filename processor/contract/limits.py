"""Bounds on what one input, one query or one read may cost, each with its environment override.

A single message or caller must not be able to stop, hang or exhaust a worker: these are the
limits that say where "too big" starts. The README's "Limits" section lists them for users.
Values are read from the environment when asked for (cheap, and tests can set them); a value
that is not a positive number is a ConfigError naming the variable. `check_environment()`
validates them all at start, so a typo fails the process at once instead of at the first use.
"""

from __future__ import annotations

import os

from processor.contract.errors import ConfigError

MAX_DELETE_KEYS = 10_000  # SowKeys in one sow_delete's sow-keys header
MAX_INDEX_LOOKUPS = 4096  # value combinations (or SowKeys) an index or key plan may look up (about 10 us each); past it, a scan
QUERY_MAX_ROWS = 100_000  # records one HTTP query may return
QUERY_MAX_SECONDS = 10.0  # time one HTTP query may take on a worker
READ_IDLE_TIMEOUT_S = 60.0  # reading a topic to its end gives up after this long without progress
MAX_RECORD_BYTES = 1_000_000  # a SOW record (or diff) larger than this once encoded is refused (the producer's message.max.bytes)
DELETE_CHUNK = 10_000  # records one sow_delete removes between two commits of the worker (its memory and transaction stay bounded)
QUERY_THREADS = 2  # HTTP queries a worker runs at once (threads beside its loop); the others wait
QUERY_SHARE = 0.25  # of a worker's time its queries together may take while its loop has work (they share one GIL)
# A worker answers a query within this many times its time limit: a wait for a thread, the query's
# own work, and the turns it gave a busy loop (each at most the limit).
QUERY_SPAN = 3
DELETE_FILTER_SECONDS = 30.0  # time one sow_delete's filter may spend testing the records of the partitions one worker owns
# How far ahead of the clock a publisher's timestamp may be: input topics ksow creates with publisher
# stamps refuse later ones (message.timestamp.after.max.ms), and a worker takes one (on any input) as
# the clock plus this. A partition sorts by its largest stamp so far, so one stamp an hour ahead would otherwise put
# every later input of its partition after an hour of the other inputs (README "Ordering").
MAX_FUTURE_STAMP_MS = 10_000
# RocksDB memory of one worker process, all its stores together: the block cache, with the memtables
# charged to it and held to half of it. Unbounded, each store took up to 128 MiB of memtables and
# its own block cache, and a worker's stores are its topics times its partitions.
ROCKSDB_MEMORY_MB = 512
# Decoded records the stores of one process keep between batches, together (each its share): ~850
# bytes each for a record of six short fields. Each store kept 50,000: 40 MiB of them a partition.
CACHE_RECORDS = 200_000

_ENV = {
    "KSOW_MAX_DELETE_KEYS": (int, MAX_DELETE_KEYS),
    "KSOW_QUERY_MAX_ROWS": (int, QUERY_MAX_ROWS),
    "KSOW_QUERY_MAX_SECONDS": (float, QUERY_MAX_SECONDS),
    "KSOW_READ_IDLE_TIMEOUT": (float, READ_IDLE_TIMEOUT_S),
    "KSOW_MAX_RECORD_BYTES": (int, MAX_RECORD_BYTES),
    "KSOW_DELETE_CHUNK": (int, DELETE_CHUNK),
    "KSOW_QUERY_THREADS": (int, QUERY_THREADS),
    "KSOW_QUERY_SHARE": (float, QUERY_SHARE),
    "KSOW_DELETE_FILTER_SECONDS": (float, DELETE_FILTER_SECONDS),
    "KSOW_ROCKSDB_MEMORY_MB": (int, ROCKSDB_MEMORY_MB),
    "KSOW_CACHE_RECORDS": (int, CACHE_RECORDS),
}


def _env(name: str) -> int | float:
    kind, default = _ENV[name]
    return positive_env(name, kind, default)


def positive_env(name: str, kind: type = int, default=None, zero: bool = False):
    """A positive number (or zero, with `zero`) from environment variable `name` (default when unset
    or blank); anything else is a ConfigError naming the variable."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not (value >= 0 if zero else value > 0) or value == float("inf"):
        what = "a non-negative" if zero else "a positive"
        raise ConfigError(f"{name} must be {what} {'integer' if kind is int else 'number'}, got {raw!r}")
    return value


def delete_chunk() -> int:
    """Records one sow_delete removes between two commits of a worker (env KSOW_DELETE_CHUNK)."""
    return int(_env("KSOW_DELETE_CHUNK"))


def delete_filter_seconds() -> float:
    """Time one sow_delete's filter may spend testing the records of a worker's partitions, all of
    them together (env KSOW_DELETE_FILTER_SECONDS). A filter costs about a microsecond a record, but a LIKE with large
    counted repetitions can cost RE2 ~10 us a byte: one such delete held a worker's loop for hours."""
    return float(_env("KSOW_DELETE_FILTER_SECONDS"))


def max_delete_keys() -> int:
    """SowKeys one sow_delete may list (env KSOW_MAX_DELETE_KEYS); more is an input error."""
    return int(_env("KSOW_MAX_DELETE_KEYS"))


def rocksdb_memory_bytes() -> int:
    """RocksDB memory of one process's stores together (env KSOW_ROCKSDB_MEMORY_MB): block cache and
    memtables, the memtables at most half."""
    return int(_env("KSOW_ROCKSDB_MEMORY_MB")) << 20


def cache_records() -> int:
    """Decoded records the SOW stores of one process keep between batches, all together (env
    KSOW_CACHE_RECORDS): updates of records in it read nothing from RocksDB."""
    return int(_env("KSOW_CACHE_RECORDS"))


def query_max_rows() -> int:
    """Default row limit of one worker HTTP query (env KSOW_QUERY_MAX_ROWS)."""
    return int(_env("KSOW_QUERY_MAX_ROWS"))


def query_max_seconds() -> float:
    """Default time limit of one worker HTTP query (env KSOW_QUERY_MAX_SECONDS)."""
    return float(_env("KSOW_QUERY_MAX_SECONDS"))


def query_threads() -> int:
    """HTTP queries one worker runs at once (env KSOW_QUERY_THREADS): a query waits for a thread at
    most its time limit, then is answered 503, so slow queries cannot hold up every caller."""
    return int(_env("KSOW_QUERY_THREADS"))


def query_share() -> float:
    """The share of a worker's time its HTTP queries together may take while its input loop has
    work (env KSOW_QUERY_SHARE, at most 1): query threads and the loop share one GIL, so queries
    that never paused would take most of it (processor.query.engine.QueryPacer)."""
    share = float(_env("KSOW_QUERY_SHARE"))
    if share > 1:
        raise ConfigError(f"KSOW_QUERY_SHARE must be at most 1 (all of the worker's time), got {share:g}")
    return share


def read_idle_timeout() -> float:
    """Seconds without progress after which reading a topic to its end fails (env KSOW_READ_IDLE_TIMEOUT)."""
    return float(_env("KSOW_READ_IDLE_TIMEOUT"))


def max_record_bytes() -> int:
    """Largest encoded record or diff a write may produce (env KSOW_MAX_RECORD_BYTES); a write over it
    is refused with the reason on `.errors`, and the SOW keeps the record as it was."""
    return int(_env("KSOW_MAX_RECORD_BYTES"))


def check_environment() -> None:
    """Raise ConfigError if any limit's environment variable is set to something unusable."""
    for name in _ENV:
        _env(name)
    query_share()
