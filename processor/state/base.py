"""The store contract: one SOW partition over an ordered key-value backend.

The backend only has to keep ordered bytes and commit a batch atomically (`KeyValueBackend`).
Everything SOW-specific lives here, once, for every backend:

  r<SowKey>                        -> record (seq, expires_at, updated_at, data)
  x<expires_at:be64><SowKey>       -> record  expiry index: each tick reads only what is due, and the
                                              record with it (no point read per expiry; '' in
                                              stores written before it carried the record)
  v<seq:be64><SowKey>              -> ''      age index: capacity evicts the least recently updated (event
                                              IDs order a partition's changes; `u<updated_at>` before)
  i<index#><values hash><SowKey>   -> ''      hash indexes: equality queries without a scan
  m<name>                          -> int     metadata (changelog position and the incarnation of the
                                              changelog topic it is in, event-ID counter, count, the
                                              SowKey rule the records were checked against)

Writes are staged (read-your-writes within a batch) and committed with the metadata in one atomic
batch, so a crash leaves the store at a consistent changelog position. Records read or committed
stay in a cache for the runner's next batches: updates of the same records, the common case, then
cost no RocksDB read and no decoding. The stores of a process share one bound on it
(KSOW_CACHE_RECORDS, `cache_records`), so a worker's memory does not grow with its partitions. A record read from RocksDB is
decoded only when its data is first asked for (`StoredRecord`): expiring it needs only its bytes.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import struct
import weakref
from functools import cached_property
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import orjson

from processor.contract.limits import MAX_INDEX_LOOKUPS, cache_records
from processor.contract.types import SowRecord
from processor.core.filters import distinct_keys, index_keys, odd_key_spelling
from processor.core.keyplan import choose_keys
from processor.core.keys import KeyError_, KeySpec
from processor.core.paths import get_path, split_path

_REC = b"r"
_EXP = b"x"
_AGE = b"v"
_AGE_BY_INSTANT = b"u"  # the age index of stores written before it was keyed by event ID
_IDX = b"i"
_META = b"m"
_HEADER = struct.Struct(">qqq")
RECORD_HEADER_SIZE = _HEADER.size  # a stored record is this header, then the JSON of its data
_BE64 = struct.Struct(">Q")
_INT = struct.Struct(">q")
_NO_EXPIRY = -1
_END = b"\xff" * 9
_KEY_FORMAT = "keyformat"
_INDEXES = "indexes"  # which hash indexes, keyed which way, the `i` entries were written for
_AGE_INDEX = "ageindex"  # 1 while the `v` entries cover every record (written with every commit since)
# Whether a key value of the store is a string spelling a number or boolean otherwise than its key
# text ('05', 'TRUE': `odd_key_spelling`): 0 not known (not checked yet), 1 none, 2 some. A store is
# checked whole when opened without the mark, and each new record at commit (a removal never lowers
# 2 again: that would need the removed records' data, which an expiry does not decode).
_KEY_SPELLING = "keyspelling"
_SPELLING_UNKNOWN, _SPELLING_PLAIN, _SPELLING_ODD = 0, 1, 2
# How values become hash index keys. 2: keys told apart as hashed (`distinct_keys`), where 1 kept one
# of True and 1, False and 0, 2**60 and 2.0**60 in a record's entries.
INDEX_FORMAT = 2
_REINDEX_CHUNK = 10_000  # index entries removed or written a write (re-indexing)
_ABSENT = object()  # not in a cache (None there means: no such record)


class WriteBatch(Protocol):
    """Writes collected in order (a later one of a key wins), applied at once by `write`."""

    def put(self, key: bytes, value: bytes) -> None: ...

    def delete(self, key: bytes) -> None: ...


class KeyValueBackend(Protocol):
    """What a backend provides: point reads, ordered range scans, atomic batch commits."""

    def get(self, key: bytes) -> bytes | None: ...

    def get_many(self, keys: list[bytes]) -> list[bytes | None]: ...

    def scan(self, start: bytes, stop: bytes) -> Iterator[tuple[bytes, bytes]]: ...

    def batch(self) -> WriteBatch: ...

    def write(self, batch: WriteBatch) -> None: ...

    def clear(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class IndexSpec:
    """Secondary structures a topic needs beside its records."""

    hash_indexes: tuple[tuple[str, ...], ...] = ()
    track_age: bool = False  # only topics with a capacity pay for the age index
    # The topic's key fields, when it has any: a filter's equality on each of them names the SowKeys
    # it can match (`choose_keys`). The records, keyed by SowKey, are that index; it costs no entry.
    keys: KeySpec | None = None

    @cached_property
    def split(self) -> tuple[tuple[tuple[str, ...], ...], ...]:
        return tuple(tuple(split_path(p) for p in index) for index in self.hash_indexes)

    @cached_property
    def plain(self) -> bool:
        """No hash index and no age index: a record without an expiry instant has no entries."""
        return not self.hash_indexes and not self.track_age


def choose_index(predicate, indexes: tuple[tuple[str, ...], ...]) -> tuple[int, list[tuple]] | None:
    """(index number, value tuples to look up) for the first hash index whose fields the filter's
    equality terms cover, or None: then the filter reads every record. `IN` lists over the fields of
    one index multiply (4,000 values on each of two fields: 16M lookups, where a scan reads each
    record once), so an index with more than MAX_INDEX_LOOKUPS combinations is passed over: its
    cost is known before any lookup, whatever the store holds."""
    terms = predicate.equality_terms()
    if not terms:
        return None
    for no, paths in enumerate(indexes):
        if all(p in terms for p in paths) and math.prod(len(terms[p]) for p in paths) <= MAX_INDEX_LOOKUPS:
            return no, list(itertools.product(*(sorted(terms[p], key=repr) for p in paths)))
    return None


def _expiry_entry(instant: int, kb: bytes) -> bytes:
    """The expiry index key of a record: its instant as stored (`_instant`), then its SowKey."""
    return _EXP + _BE64.pack(instant) + kb


def _instant(expires_at: int) -> int:
    """An expiry instant as stored: clamped to [0, 2**63 - 1] (due at once / never, in practice).

    Inputs cannot produce one outside (durations are bounded at parse time), but a record restored
    from a changelog someone else wrote can: a commit must not fail on any record, and the record
    header (signed 64 bits) and the expiry index key (unsigned) must agree on the value."""
    return min(max(expires_at, 0), 2**63 - 1)


def _key_spelling(keys: KeySpec, record: SowRecord) -> int:
    """_SPELLING_ODD when a key value of a new record is an odd spelling (or cannot be read: a
    record restored from a changelog someone else wrote), else _SPELLING_PLAIN."""
    try:
        values = keys.key_values(record.data)
    except KeyError_:
        return _SPELLING_ODD
    for value in values:
        if type(value) is str and odd_key_spelling(value):
            return _SPELLING_ODD
    return _SPELLING_PLAIN


def encode_record(record: SowRecord) -> bytes:
    expires = _NO_EXPIRY if record.expires_at is None else _instant(record.expires_at)
    data = record.json
    return _HEADER.pack(record.seq, expires, record.updated_at) + (orjson.dumps(record.data) if data is None else data)


_DATA = SowRecord.__dict__["data"]  # the slot behind SowRecord.data


class StoredRecord(SowRecord):
    """A record read from a store: its data is decoded from the stored JSON when first asked for.
    A record that is only expired or deleted (its last version goes out as the stored bytes) and
    that no view looks at is never decoded."""

    __slots__ = ()

    @property  # type: ignore[override]
    def data(self) -> dict:
        data = _DATA.__get__(self)
        if data is None:
            data = orjson.loads(self.json)
            _DATA.__set__(self, data)
        return data

    @data.setter
    def data(self, value: dict | None) -> None:
        _DATA.__set__(self, value)

    def __eq__(self, other: object) -> bool:  # the same value as a SowRecord with the same fields
        if not isinstance(other, SowRecord):
            return NotImplemented
        return (self.data, self.seq, self.expires_at, self.updated_at) == (other.data, other.seq, other.expires_at, other.updated_at)

    __hash__ = None  # type: ignore[assignment]


_new_record = object.__new__
_SET_DATA = _DATA.__set__


def decode_record(raw: bytes, data: dict | None = None) -> SowRecord:
    # Fields set one by one: the dataclass __init__ would set `data` through StoredRecord's
    # property (a Python call), and a sweep decodes every record it expires.
    seq, expires, updated = _HEADER.unpack_from(raw)
    record = _new_record(StoredRecord)
    _SET_DATA(record, data)
    record.seq = seq
    record.expires_at = None if expires == _NO_EXPIRY else expires
    record.updated_at = updated
    record.json = raw[_HEADER.size :]
    return record


def index_value_hash(values: tuple) -> bytes:
    """Fixed-width digest of an index's values, so range scans can find one value's entries."""
    return hashlib.blake2b(orjson.dumps(values), digest_size=8).digest()


@dataclass(slots=True)
class PreparedCommit:
    """A store's staged writes as a backend batch (`PartitionStore.prepare`)."""

    batch: WriteBatch
    count: int  # records once applied
    due_from: int
    clamped: list[str]  # records whose expiry instant is stored clamped: not cached as they are


@dataclass(eq=False)  # a store is itself alone (and hashable: `_OPEN` holds it)
class PartitionStore:
    """One partition of one SOW topic. Not thread-safe: its runner serialises access."""

    backend: KeyValueBackend
    indexes: IndexSpec = field(default_factory=IndexSpec)
    _staged: dict[str, SowRecord | None] = field(default_factory=dict)
    _committed: dict[str, SowRecord | None] = field(default_factory=dict)  # the cache: committed versions (None: absent)
    _meta: dict[str, int] = field(default_factory=dict)
    _size_delta: int = 0
    # No committed expiry-index entry is older than this instant (due() raises it to the oldest entry
    # it finds, commit() to the last entry its sweeps deleted, and lowers it for new entries). due()
    # seeks here instead of to the start of the index, where the entries of every record expired so
    # far lie as RocksDB tombstones until compaction: skipping them made each sweep cost O(records
    # expired so far).
    _due_from: int = 0
    # Within a batch: the expiry index keys due() handed out and got past, in index order (each
    # sweep of the batch starts after the last; the commit deletes them).
    _swept: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        _OPEN.add(self)
        self._reindex_age()
        self._reindex_hash()
        self._check_key_spelling()

    def _index_signature(self) -> int:
        text = orjson.dumps([INDEX_FORMAT, self.indexes.hash_indexes])
        return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "big")

    def _reindex_hash(self) -> None:
        """Rebuild the hash indexes when they were written for other indexes (the topology's
        `hash_indexes` changed) or another INDEX_FORMAT: a record without its entries would be
        hidden from the equality queries and deletes that use them. Done once, at open; a crash
        meanwhile leaves the signature unwritten, so the next open does it again."""
        signature = self._index_signature()
        if self.meta(_INDEXES) == signature:
            return
        stale = ((k, None) for k, _ in self.backend.scan(_IDX, _IDX + _END))
        fresh = ((entry, b"") for key, record in self.records() for entry in self._hash_entries(key.encode(), record))
        batch = self.backend.batch()
        for n, (entry, value) in enumerate(itertools.chain(stale, fresh if self.indexes.hash_indexes else ()), 1):
            if value is None:
                batch.delete(entry)
            else:
                batch.put(entry, value)
            if n % _REINDEX_CHUNK == 0:
                self.backend.write(batch)
                batch = self.backend.batch()
        batch.put(_META + _INDEXES.encode(), _INT.pack(signature))
        self.backend.write(batch)

    def _check_key_spelling(self) -> None:
        """Mark a store opened without `_KEY_SPELLING` (new, or written by a release before it),
        reading each record's key values once, as `_reindex_hash` does: then filters with number
        literals on the key fields name SowKeys there too."""
        keys = self.indexes.keys
        if keys is None or self.meta(_KEY_SPELLING) != _SPELLING_UNKNOWN:
            return
        odd = any(_key_spelling(keys, record) == _SPELLING_ODD for _, record in self.records())
        batch = self.backend.batch()
        batch.put(_META + _KEY_SPELLING.encode(), _INT.pack(_SPELLING_ODD if odd else _SPELLING_PLAIN))
        self.backend.write(batch)

    def _reindex_age(self) -> None:
        """Make the age index cover every record when the topic has a capacity. Only stores of a
        topic with a capacity write `v` entries, so a store that ran without one (or whose age index
        was keyed by update instant, in earlier releases) has records capacity could never evict:
        the index is written again from the records, once, at open. A store opened without a
        capacity drops the mark (and its entries, which its commits no longer keep up)."""
        complete = self.meta(_AGE_INDEX) == 1
        if complete == self.indexes.track_age:
            return
        stale = (k for prefix in (_AGE, _AGE_BY_INSTANT) for k, _ in self.backend.scan(prefix, prefix + _END))
        fresh = (_AGE + _BE64.pack(record.seq) + key.encode() for key, record in self.records()) if self.indexes.track_age else ()
        batch = self.backend.batch()
        for n, (entry, write) in enumerate(itertools.chain(((k, False) for k in stale), ((k, True) for k in fresh)), 1):
            if write:
                batch.put(entry, b"")
            else:
                batch.delete(entry)
            if n % _REINDEX_CHUNK == 0:
                self.backend.write(batch)
                batch = self.backend.batch()
        batch.put(_META + _AGE_INDEX.encode(), _INT.pack(1 if self.indexes.track_age else 0))
        self.backend.write(batch)

    # reads -----------------------------------------------------------------
    def get(self, key: str) -> SowRecord | None:
        record = self._staged.get(key, _ABSENT)
        if record is _ABSENT:
            record = self._committed.get(key, _ABSENT)
            if record is _ABSENT:
                record = self._committed[key] = self._load(key)  # stage() needs it too
        return record

    def committed(self, key: str) -> SowRecord | None:
        """The committed version of a record, not cached (for queries outside a batch)."""
        return self._load(key)

    def _load(self, key: str) -> SowRecord | None:
        raw = self.backend.get(_REC + key.encode())
        return None if raw is None else decode_record(raw)

    def meta(self, name: str, default: int = 0) -> int:
        if name in self._meta:
            return self._meta[name]
        raw = self.backend.get(_META + name.encode())
        return default if raw is None else _INT.unpack(raw)[0]

    def plain_key_spelling(self) -> bool:
        """True while no key value of the committed records is an odd spelling of a number or
        boolean (`_KEY_SPELLING`): then a number or boolean literal names their SowKeys."""
        return self.meta(_KEY_SPELLING) == _SPELLING_PLAIN

    def key_format(self) -> int:
        """The SowKey rule (`processor.core.keys.KEY_FORMAT`) this store's records are known to
        follow: the one last stamped by `set_key_format`, else 1 (stores from before the rule was
        numbered, and stores not checked yet; `processor.state.keyformat` checks them)."""
        return self.meta(_KEY_FORMAT, 1)

    def set_key_format(self, version: int) -> None:
        """Stamp the SowKey rule; written with the next commit, like any metadata."""
        self.set_meta(_KEY_FORMAT, version)

    def records(self) -> Iterator[tuple[str, SowRecord]]:
        """Every committed record, in SowKey byte order (staged writes are not visible here)."""
        for k, v in self.backend.scan(_REC, _REC + _END):
            yield k[1:].decode(), decode_record(v)

    def latest(self) -> Iterator[tuple[str, SowRecord]]:
        """Every committed record as the writes staged over it leave it (one staged away is left
        out), in SowKey byte order; records only staged are not listed. For a re-seed after a replay
        staged a recreated changelog's newer versions; nothing may be staged meanwhile."""
        staged = self._staged
        for key, record in self.records():
            if key in staged:
                newer = staged[key]
                if newer is None:
                    continue
                record = newer
            yield key, record

    def matching(self, predicate) -> Iterator[str]:
        """SowKeys of the records the batch in flight sees whose data satisfies a compiled filter, as
        of the call: the caller may remove records and commit while this runs (a long delete
        checkpoints), so the staged writes are taken now and the committed records come from one
        point-in-time scan (a record removed since is still listed; the caller finds it gone).

        When the filter's equality terms cover a hash index, only that index's candidates are read
        (a delete by filter on an indexed field does not decode the whole partition)."""
        matches = predicate.matches
        staged = dict(self._staged)
        candidates = self._indexed_candidates(predicate)
        if candidates is None:
            committed: Iterator[tuple[str, SowRecord | None]] = (kr for kr in self.records() if kr[0] not in staged)
        else:
            committed = ((key, self._load(key)) for key in candidates if key not in staged)
        for key, record in committed:
            if record is not None and matches(record.data):
                yield key
        for key, record in staged.items():
            if record is not None and matches(record.data):
                yield key

    def _indexed_candidates(self, predicate) -> set[str] | None:
        """Committed SowKeys the key fields (`choose_keys`) or an index say may match, or None when
        neither covers the filter."""
        named = choose_keys(predicate, self.indexes.keys, self.plain_key_spelling())
        if named is not None:
            return set(named)
        choice = choose_index(predicate, self.indexes.hash_indexes)
        if choice is None:
            return None
        found: set[str] = set()
        for values in choice[1]:
            found.update(self.lookup(choice[0], values))
        return found

    def select(self, predicate, raw_check=None, check_every: int = 0, check=None) -> tuple[list[tuple[str, SowRecord]], int]:
        """Committed records whose data satisfies `predicate`, and how many were read: the scan path
        of queries, kept to one loop that decodes only the fields and builds records for matches.

        `raw_check(stored bytes)`, when given, is a necessary condition for `predicate` (see
        processor.core.rawfilter): records it rejects are not decoded. It is dropped after the
        first `PROBE` records if it rejected too few of them to pay for itself.
        `check(matched so far)`, when given, is called every `check_every` records read (a power
        of two; sooner for large records: `_checked`) and may raise to end the scan: a query's row
        and time limits.
        """
        loads, size, decode = orjson.loads, _HEADER.size, decode_record
        out: list[tuple[str, SowRecord]] = []
        append = out.append
        items = iter(self.backend.scan(_REC, _REC + _END))
        if check is not None:
            items = _checked(items, check_every - 1, check, out)
        read = 0
        if raw_check is not None:
            rejected = 0
            for k, raw in itertools.islice(items, self.PROBE):
                read += 1
                if not raw_check(raw):
                    rejected += 1
                    continue
                data = loads(raw[size:])
                if predicate(data):
                    append((k[1:].decode(), decode(raw, data)))
            if read == self.PROBE and rejected >= read * self.MIN_REJECTED:
                for k, raw in items:
                    read += 1
                    if raw_check(raw):
                        data = loads(raw[size:])
                        if predicate(data):
                            append((k[1:].decode(), decode(raw, data)))
                return out, read
        for k, raw in items:
            read += 1
            data = loads(raw[size:])
            if predicate(data):
                append((k[1:].decode(), decode(raw, data)))
        return out, read

    PROBE = 1000  # records a raw check is tried on before the scan decides to keep it
    MIN_REJECTED = 0.25  # the share of those it must reject (it costs ~1/4 of a decode and filter)

    def count(self) -> int:
        """Committed records."""
        return self.meta("count")

    def size(self) -> int:
        """Records including staged writes (what capacity checks against)."""
        return self.meta("count") + self._size_delta

    def due(self, now_ms: int) -> Iterator[tuple[int, str]]:
        """(expires_at, SowKey) of committed records whose instant is at or before now_ms.

        Within a batch, an entry the caller went past (it asked for the next one) was handled:
        expired, or found stale. The batch's next sweeps start after it (`_swept`) instead of
        reading again every entry the batch already expired (their removal is only staged), and
        its commit deletes them (`prepare`). A look that handles nothing must end with rollback().

        A committed entry carries its record as committed (an update replaces or removes the entry
        in the same commit): it goes into the cache, so the caller's get() reads nothing more."""
        stop = _EXP + _BE64.pack(now_ms + 1)
        swept = self._swept
        first = not swept
        staged, committed = self._staged, self._committed
        found = False
        for k, raw in self.backend.scan(_EXP + _BE64.pack(self._due_from) if first else swept[-1] + b"\x00", stop):
            at = _BE64.unpack_from(k, 1)[0]
            if first and not found:  # the oldest committed entry: nothing lies before it
                self._due_from = at
            found = True
            key = k[9:].decode()
            if raw and key not in staged and key not in committed:
                committed[key] = decode_record(raw)
            yield at, key
            swept.append(k)
        if first and not found:
            self._due_from = now_ms + 1

    def pop_due(self, now_ms: int) -> Iterator[tuple[int, str, SowRecord]]:
        """Remove the records whose instant is at or before now_ms, handing each out as (expires_at,
        SowKey, record), oldest first (the engine's sweep): due(), get() and remove() in one pass.
        A record that changed since its entry was written (staged, or committed over) is passed over."""
        get, staged = self.get, self._staged
        for at, key in self.due(now_ms):
            record = get(key)  # cached by due() from its entry, or staged since
            if record is None or record.expires_at != at:
                continue
            staged[key] = None  # stage(key, None), whose look-ups get() just made
            self._size_delta -= 1
            yield at, key, record

    def oldest(self) -> Iterator[tuple[int, str]]:
        """(seq, SowKey), least recently updated first (needs IndexSpec.track_age)."""
        for k, _ in self.backend.scan(_AGE, _AGE + _END):
            yield _BE64.unpack_from(k, 1)[0], k[9:].decode()

    def least_recently_updated(self) -> Iterator[tuple[str, SowRecord]]:
        """Live records, least recently updated first, staged writes included (for eviction)."""
        staged = sorted((r.seq, k) for k, r in self._staged.items() if r is not None)
        committed = ((s, k) for s, k in self.oldest() if k not in self._staged)
        for seq, key in heapq.merge(committed, staged):
            record = self.get(key)
            if record is not None and record.seq == seq:
                yield key, record

    def lookup(self, index_no: int, values: tuple) -> Iterator[str]:
        """SowKeys whose fields of hash index `index_no` may equal `values` (committed state; the
        caller still applies the filter, as a key can be shared by values that differ)."""
        for combo in itertools.product(*(distinct_keys(index_keys(v)) for v in values)):
            prefix = _IDX + bytes([index_no]) + index_value_hash(combo)
            for k, _ in self.backend.scan(prefix, prefix + _END):
                yield k[len(prefix) :].decode()

    # writes ----------------------------------------------------------------
    def stage(self, key: str, record: SowRecord | None = None) -> None:
        """Put (or with None, remove) a record; visible to get() at once, durable at commit()."""
        staged = self._staged
        previous = staged.get(key, _ABSENT)
        if previous is _ABSENT:
            previous = self._committed.get(key, _ABSENT)
            if previous is _ABSENT:
                previous = self._committed[key] = self._load(key)
        self._size_delta += (record is not None) - (previous is not None)
        staged[key] = record

    def put_many(self, writes: list[tuple[str, SowRecord | None]]) -> None:
        """stage() each (SowKey, record or None: a removal) in order, the committed versions of the
        records neither staged nor cached read in one multi-get (a restore's batch of changelog
        records, mostly of SowKeys the store has not seen)."""
        staged, committed = self._staged, self._committed
        unread = list({key for key, _ in writes if key not in staged and key not in committed})
        if unread:
            for key, raw in zip(unread, self.backend.get_many([_REC + key.encode() for key in unread])):
                committed[key] = None if raw is None else decode_record(raw)
        stage = self.stage
        for key, record in writes:  # each previous version staged or cached now: no read of its own
            stage(key, record)

    def set_meta(self, name: str, value: int) -> None:
        self._meta[name] = value

    # the engine's PartitionState (processor.engine.partition) ----------------------
    put = remove = stage  # remove(key) is stage(key, None), without a second call

    def counter(self) -> int:
        value = self._meta.get("counter")  # staged by every change of a batch but its first
        return self.meta("counter") if value is None else value

    def set_counter(self, value: int) -> None:
        self._meta["counter"] = value

    @property
    def dirty(self) -> bool:
        return bool(self._staged or self._meta)

    def prepare(self) -> "PreparedCommit":
        """The staged writes as one backend batch, not applied yet: a runner builds it while its
        transaction commits, and applies it with `commit(prepared)` once that succeeded (or drops it
        and rolls back). Writes of one record go in order, removals before puts (a later write of a
        key wins), so an entry both removed and written stays."""
        batch = self.backend.batch()
        put, delete = batch.put, batch.delete
        # Every committed expiry entry from the first due() handed out in this batch to the last was
        # handed out and handled: its record expired, or changed since (and its writes below put
        # the new entry back). They are deleted as due() read them, so the records' own removals
        # below need not work out their entries again. A delete each, not one range tombstone for
        # the span: RocksDB fragments every range tombstone of a memtable again on the first read
        # after a write (measured: ~2 ms a get after 3,000 commits, against ~20 us).
        swept = self._swept
        first, last = (swept[0], swept[-1]) if swept else (b"", b"")
        lo = hi = 0  # an instant strictly between these lies in [first, last] (no key compare needed)
        if swept:
            lo, hi = _BE64.unpack_from(first, 1)[0], _BE64.unpack_from(last, 1)[0]
            for k in swept:
                delete(k)
        count = self.meta("count")
        indexed = not self.indexes.plain  # the common case: no index but the expiry entries
        keys = self.indexes.keys
        spelling = was = _SPELLING_ODD if keys is None else self.meta(_KEY_SPELLING)
        if spelling == _SPELLING_UNKNOWN and count == 0:
            spelling = _SPELLING_PLAIN  # emptied by clear(): every record it will hold is checked below
        committed = self._committed
        # The entries this batch went through are gone once it commits: the next batch's first sweep
        # seeks past them (to the last one's instant), not over their tombstones. Entries written
        # below lower it again.
        due_from = max(self._due_from, hi)
        clamped: list[str] = []
        for key, after in self._staged.items():
            before = committed[key]
            kb = key.encode()
            if before is not None:
                expires = before.expires_at
                if expires is not None and not lo < expires < hi:
                    entry = _expiry_entry(_instant(expires), kb)
                    if not first <= entry <= last:
                        delete(entry)
                if indexed:
                    for entry in self._entries(kb, before):
                        delete(entry)
                count -= 1
            elif spelling == _SPELLING_PLAIN and after is not None:
                spelling = _key_spelling(keys, after)
            if after is not None:
                raw = encode_record(after)
                put(_REC + kb, raw)
                expires_at = after.expires_at
                if expires_at is not None:
                    # The expiry entry carries the record: a sweep reads what it expires in one scan.
                    instant = _instant(expires_at)
                    put(_expiry_entry(instant, kb), raw)
                    if instant < due_from:
                        due_from = instant
                    if instant != expires_at:
                        clamped.append(key)  # stored otherwise: not cached as it is
                if indexed:
                    for entry in self._entries(kb, after):
                        put(entry, b"")
                count += 1
            else:
                delete(_REC + kb)
        if spelling != was:
            put(_META + _KEY_SPELLING.encode(), _INT.pack(spelling))
        return PreparedCommit(batch, count, due_from, clamped)

    def commit(self, prepared: "PreparedCommit | None" = None) -> None:
        """Make the staged writes durable, with the metadata, in one atomic batch."""
        if prepared is None:
            prepared = self.prepare()
        batch = prepared.batch
        self._due_from = prepared.due_from
        self._meta["count"] = prepared.count
        for name, value in self._meta.items():
            batch.put(_META + name.encode(), _INT.pack(value))
        self.backend.write(batch)
        committed = self._committed
        committed.update(self._staged)
        for key in prepared.clamped:
            del committed[key]
        if len(committed) > cache_records() // max(1, len(_OPEN)):
            committed.clear()
        self.rollback()  # nothing staged is left to forget: it is committed, and cached above

    def rollback(self) -> None:
        """Forget the staged writes (the cache holds committed versions only: it stays)."""
        self._staged.clear()
        self._meta.clear()
        self._size_delta = 0
        self._swept = []

    def _entries(self, kb: bytes, record: SowRecord) -> Iterator[bytes]:
        """The entries of the age and hash indexes (the expiry entry: `_expiry_entry`)."""
        if self.indexes.track_age:
            yield _AGE + _BE64.pack(record.seq) + kb
        yield from self._hash_entries(kb, record)

    def _hash_entries(self, kb: bytes, record: SowRecord) -> Iterator[bytes]:
        for no, paths in enumerate(self.indexes.split):
            # Every key a value can be matched by ('10' also as 10, arrays by element), so an
            # equality filter finds the record whatever type spells the value.
            keys = [distinct_keys(index_keys(get_path(record.data, p))) for p in paths]
            for combo in itertools.product(*keys):  # distinct, as each field's keys are
                yield _IDX + bytes([no]) + index_value_hash(combo) + kb

    def clear(self) -> None:
        """Forget everything and start empty (the changelog is then replayed from the start)."""
        self.rollback()
        self._committed.clear()
        self.backend.clear()
        self._reindex_age()  # nothing to index: stamps whether the replayed records get age entries
        self._reindex_hash()  # nothing to index: stamps the signature the replayed records are indexed under

    def close(self) -> None:
        _OPEN.discard(self)
        self.backend.close()


# The open stores of the process: each keeps at most its share of `cache_records()` decoded records
# (cleared whole when it would grow past: a share is worked out at each commit, as stores come and go).
_OPEN: "weakref.WeakSet[PartitionStore]" = weakref.WeakSet()


def cached_records() -> int:
    """Decoded records the open stores of the process keep between batches (for /metrics)."""
    # A copy of the WeakSet's references in one step: iterating the WeakSet itself fails when the
    # loop thread opens a store meanwhile (set changed size during iteration).
    return sum(len(store._committed) for ref in list(_OPEN.data) if (store := ref()) is not None)


CHECK_BYTES = 256 << 10  # record bytes read between two checks at most, however few the records


def _checked(items: Iterator, mask: int, check, out: list) -> Iterator:
    """`items` ((key, stored bytes) pairs), calling check(len(out)) every mask + 1 of them (mask: a
    power of two minus one), and sooner when they hold more than CHECK_BYTES: a filter's cost grows
    with a record's size (audit: 20 records of 900 KB under a slow LIKE ran a query 292 s past a
    10 s limit, checked every 1,024 records)."""
    read = 0
    for n, item in enumerate(items):
        read += len(item[1])
        if n & mask == 0 or read > CHECK_BYTES:
            read = 0
            check(len(out))
        yield item
    check(len(out))


class StoreInUse(Exception):
    """Another process (or this one) has the store open: a store serves one owner at a time."""

    def __init__(self, path: str):
        super().__init__(f"the store {path} is open in another process")
        self.path = path


def open_partition_store(kind: str, path: str | None, indexes: IndexSpec) -> PartitionStore:
    """A store for one partition: kind 'rocksdb' (a folder at path) or 'memory'."""
    if kind == "rocksdb":
        from processor.state.rocksdb import RocksDBBackend

        assert path is not None
        return PartitionStore(RocksDBBackend(path), indexes)
    if kind == "memory":
        from processor.state.memory import MemoryBackend

        return PartitionStore(MemoryBackend(), indexes)
    raise ValueError(f"unknown store kind {kind!r}")
