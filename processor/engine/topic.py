"""The engine-neutral heart of a worker: applies input messages of one SOW topic to its partitions.

A runner (Faust today) owns the Kafka side: it consumes, hands batches here, produces what comes
back, and after the producer has delivered calls `commit` with the changelog positions. This class
owns the semantics around the pure core: routing to the partition that owns a SowKey, event IDs,
deletes by keys and by filter, expiry, and restoring partitions from the changelog (`<topic>.sow`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

from processor.contract.types import Command, InputError, Op, SowCommand, SowRecord
from processor.core.codec import Codec, codec_for
from processor.contract import headers as H
from processor.core.commands import header_map, parse_command
from processor.core.expiry import is_due
from processor.core.keys import owner_partition as _owner_partition
from processor.core.sow import Transition, apply_write, removal, render
from processor.state.base import IndexSpec, PartitionStore, open_partition_store
from processor.topology import CapacityPolicy, Persistence, SowTopic, View
from processor.engine.views import ViewProcessor

log = logging.getLogger("ksow.processor")

SEQ_PARTITION_BITS = 10  # sow-seq = counter << 10 | partition: unique in the topic, up to 1024 partitions
EXPIRE_BATCH = 2000  # records removed per partition per tick, so a backlog never stalls ingestion


# murmur2 is pure Python (~5-10 us a call, a tenth of handling an input): SowKeys repeat, so the
# owner partition of recent ones is remembered.
owner_partition = lru_cache(maxsize=1 << 16)(_owner_partition)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(slots=True)
class InputMessage:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] | None
    timestamp: int  # epoch ms the message reached Kafka: the instant a publish counts from


@dataclass(slots=True)
class ProduceRequest:
    topic: str
    partition: int | None
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    changelog: int | None = None  # SOW partition whose changelog this record is (for positions)
    timestamp: int = 0  # keep the original publish time on rerouted inputs (0: now)


class SowTopicProcessor:
    """All partitions of one SOW topic that this worker owns."""

    def __init__(self, spec: SowTopic, data_dir: Path | None, topology_dir: Path | None = None, views: list[View] = ()):
        self.spec = spec
        self.views = [ViewProcessor(view, spec) for view in views]
        self.codec: Codec = codec_for(spec.message_type.value, spec.schema_, topology_dir)
        self.key_paths = spec.key_spec.split
        self.data_dir = data_dir
        self.indexes = IndexSpec(tuple(tuple(i) for i in spec.hash_indexes), track_age=spec.capacity > 0)
        self.stores: dict[int, PartitionStore] = {}
        self._defaults = {spec.topic: Command.PUBLISH, spec.delta_topic: Command.DELTA_PUBLISH}
        self._stream_topics = {"sow": spec.sow_topic, "diff": spec.diff_topic, "expired": spec.expired_topic, "dead": spec.dead_topic}

    # partitions --------------------------------------------------------------
    @property
    def keeps_state(self) -> bool:
        return self.spec.persistence is not Persistence.TRANSIENT

    @property
    def restores(self) -> bool:
        """Whether a partition's SOW is rebuilt from the changelog when this worker takes it."""
        return self.spec.persistence in (Persistence.PERSISTENT, Persistence.MEMORY)

    def open(self, p: int) -> PartitionStore:
        store = self.stores.get(p)
        if store is None:
            if self.spec.persistence is Persistence.PERSISTENT:
                assert self.data_dir is not None
                path = self.data_dir / self.spec.topic / f"p{p}"
                store = open_partition_store("rocksdb", str(path), self.indexes)
            else:
                store = open_partition_store("memory", None, self.indexes)
            self.stores[p] = store
        return store

    def close(self, p: int) -> None:
        store = self.stores.pop(p, None)
        if store is not None:
            store.rollback()
            store.close()

    def changelog_position(self, p: int) -> int:
        """Next `<topic>.sow` offset the local store has not seen."""
        return self.open(p).meta("changelog")

    def restore(self, p: int, key: bytes | None, value: bytes | None, headers: list | None, timestamp: int) -> None:
        """Apply one `<topic>.sow` record to partition p's store (replaying the changelog)."""
        if key is None:
            return
        store = self.open(p)
        hmap = dict(headers or ())
        seq = int(hmap[H.SEQ]) if H.SEQ in hmap else 0
        if seq:
            store.set_meta("counter", max(store.meta("counter"), seq >> SEQ_PARTITION_BITS))
        if value is None:
            store.stage(key.decode(), None)
            return
        expires = int(hmap[H.EXPIRES_AT]) if H.EXPIRES_AT in hmap else None
        store.stage(key.decode(), SowRecord(self.codec.decode(value), seq, expires, timestamp))

    def commit(self, p: int, changelog_next: int | None = None) -> None:
        store = self.stores.get(p)
        if store is None:
            return
        if changelog_next is not None and changelog_next > store.meta("changelog"):
            store.set_meta("changelog", changelog_next)
        if store.dirty:
            store.commit()

    def rollback(self) -> None:
        for store in self.stores.values():
            store.rollback()

    # event IDs -----------------------------------------------------------------
    def next_seq(self, p: int, now: int) -> int:
        """Increasing per partition, unique in the topic, never reused: a counter floored by the clock
        (so a partition rebuilt from a compacted changelog never hands out an old number again)."""
        store = self.stores[p]
        counter = max(store.meta("counter") + 1, now * 1000)
        store.set_meta("counter", counter)
        return (counter << SEQ_PARTITION_BITS) | p

    # inputs --------------------------------------------------------------------
    def handle(self, messages: Iterable[InputMessage], now: int | None = None) -> list[ProduceRequest]:
        now = now_ms() if now is None else now
        out: list[ProduceRequest] = []
        for msg in messages:
            try:
                self._handle_one(msg, now, out)
            except InputError as exc:
                out.append(self._error(msg, str(exc)))
            except Exception as exc:  # a poison message must not stop the worker: park it with the reason
                log.exception("could not apply %s[%d]@%d", msg.topic, msg.partition, msg.offset)
                out.append(self._error(msg, f"internal error: {type(exc).__name__}: {exc}"))
        return out

    def _handle_one(self, msg: InputMessage, now: int, out: list[ProduceRequest]) -> None:
        headers = header_map(msg.headers)
        default = self._defaults.get(msg.topic)
        if default is None:  # the repartition topic: the first topic's default travels in a header
            origin = dict(msg.headers or ()).get(H.ORIGIN, b"publish")
            try:
                default = Command(origin.decode(errors="replace"))
            except ValueError:
                raise InputError(f"bad {H.ORIGIN} header {origin!r} on {msg.topic}") from None
        cmd = parse_command(self.spec.key_spec, self.codec, default, msg.value, headers)
        n = self.spec.partitions
        if cmd.sow_key is not None:
            owner = owner_partition(cmd.sow_key, n)
            if owner != msg.partition:
                out.append(self._reroute(msg, default, owner, cmd.sow_key.encode()))
                return
        elif cmd.keys and not self._is_local(msg):
            for key in cmd.keys:  # each key is deleted by the partition that owns it
                extra = [(H.KEYS, key.encode())]
                out.append(self._reroute(msg, default, owner_partition(key, n), key.encode(), extra))
            return
        elif cmd.filter is not None and not self._is_local(msg):
            for p in range(n):  # every partition deletes its own matches
                out.append(self._reroute(msg, default, p, msg.key))
            return
        self.open(msg.partition)
        if cmd.command is Command.SOW_DELETE:
            self._delete(msg.partition, cmd, now, out)
        else:
            self._write(msg.partition, cmd, msg.timestamp or now, now, out)

    @staticmethod
    def _is_local(msg: InputMessage) -> bool:
        return any(name == H.LOCAL for name, _ in msg.headers or ())

    def _reroute(self, msg: InputMessage, default: Command, p: int, key: bytes | None, extra: list | None = None) -> ProduceRequest:
        headers = [(k, v) for k, v in (msg.headers or ()) if k not in (H.ORIGIN, H.LOCAL) and not (extra and k == H.KEYS)]
        headers += [(H.ORIGIN, default.value.encode()), (H.LOCAL, b"1")] + (extra or [])
        return ProduceRequest(self.spec.repartition_topic, p, key, msg.value, headers, timestamp=msg.timestamp)

    def _error(self, msg: InputMessage, reason: str) -> ProduceRequest:
        headers = [(k, v) for k, v in (msg.headers or ()) if k not in (H.ORIGIN, H.LOCAL)]
        headers += [
            (H.ERROR, reason.encode()),
            (H.ERROR_TOPIC, msg.topic.encode()),
            (H.ERROR_PARTITION, str(msg.partition).encode()),
            (H.ERROR_OFFSET, str(msg.offset).encode()),
        ]
        return ProduceRequest(self.spec.errors_topic, None, msg.key, msg.value, headers)

    def _write(self, p: int, cmd: SowCommand, published: int, now: int, out: list[ProduceRequest]) -> None:
        """Lifetimes count from `published` (the input's Kafka timestamp, i.e. its arrival), so a
        replay of the input topics computes the same instants as the live worker did."""
        store = self.stores[p]
        key = cmd.sow_key
        assert key is not None
        before = store.get(key) if self.keeps_state else None
        if before is not None and self.spec.expiry.active and is_due(before.expires_at, now):
            self._emit(p, removal(Op.EXPIRE, key, before, now, self.next_seq(p, now)), out)
            before = None
        if before is None and self.spec.capacity and self.keeps_state:
            self._make_room(p, now, out)
        t = apply_write(key, before, cmd, self.spec.expiry, self.key_paths, published, self.next_seq(p, now))
        if self.keeps_state:
            store.stage(key, t.after)
        self._emit(p, t, out)

    def capacity_of(self, p: int) -> int:
        """Capacity is split evenly over the partitions, so the topic never holds more than `capacity`."""
        n, capacity = self.spec.partitions, self.spec.capacity
        return capacity // n + (1 if p < capacity % n else 0)

    def _make_room(self, p: int, now: int, out: list[ProduceRequest]) -> None:
        """Before a new record: evict the least recently updated record(s), or refuse the record."""
        store = self.stores[p]
        limit = self.capacity_of(p)
        if store.size() < limit:
            return
        if self.spec.capacity_policy is CapacityPolicy.REJECT:
            raise InputError(f"capacity reached: partition {p} of {self.spec.topic} holds its share of {limit} of capacity {self.spec.capacity} records (capacity_policy: reject)")
        for key, victim in store.least_recently_updated():
            if store.size() < limit:
                break
            store.stage(key, None)
            self._emit(p, removal(Op.EVICT, key, victim, now, self.next_seq(p, now)), out)

    def _delete(self, p: int, cmd: SowCommand, now: int, out: list[ProduceRequest]) -> None:
        if cmd.sow_key is not None:
            keys: Iterable[str] = (cmd.sow_key,)
        elif cmd.keys:
            keys = [k for k in cmd.keys if owner_partition(k, self.spec.partitions) == p]
        else:
            keys = list(self.matching(p, cmd.filter or "1=1"))
        store = self.stores[p]
        expiring = self.spec.expiry.active
        for key in keys:
            before = store.get(key)
            if before is not None:
                # A record whose instant has passed was gone before the delete came: it expires.
                op = Op.EXPIRE if expiring and is_due(before.expires_at, now) else Op.DELETE
                store.stage(key, None)
                self._emit(p, removal(op, key, before, now, self.next_seq(p, now)), out)

    def matching(self, p: int, filter_text: str) -> Iterator[str]:
        """SowKeys of partition p's records that match a filter, writes of the batch in flight included."""
        from processor.core.filters import compile_filter

        predicate = compile_filter(filter_text)
        for key, record in self.open(p).current_records():
            if predicate.matches(record.data):
                yield key

    # expiry ----------------------------------------------------------------------
    def expire_due(self, p: int, now: int | None = None) -> list[ProduceRequest]:
        """Remove partition p's records whose instant has passed (at most EXPIRE_BATCH per call)."""
        out: list[ProduceRequest] = []
        if not self.spec.expiry.active or p not in self.stores:
            return out
        now = now_ms() if now is None else now
        store = self.stores[p]
        for n, (at, key) in enumerate(store.due(now)):
            if n >= EXPIRE_BATCH:
                break
            record = store.get(key)
            if record is None or record.expires_at != at:
                continue  # updated or deleted in this batch already
            store.stage(key, None)
            self._emit(p, removal(Op.EXPIRE, key, record, now, self.next_seq(p, now)), out)
        return out

    # outputs ---------------------------------------------------------------------
    def _emit(self, p: int, t: Transition, out: list[ProduceRequest]) -> None:
        for event in render(t, self.codec, self.spec.expired_topic is not None):
            changelog = p if event.stream == "sow" else None
            out.append(ProduceRequest(self._stream_topics[event.stream], p, event.key, event.value, event.headers, changelog))
        for view in self.views:
            for topic, vp, key, value, headers in view.on_change(p, t, t.at_ms):
                out.append(ProduceRequest(topic, vp, key, value, headers))

    def views_due(self, p: int, now: int | None = None, everything: bool = False) -> list[ProduceRequest]:
        """Conflated view events whose interval ended (all of them when the partition is handed over)."""
        now = now_ms() if now is None else now
        return [ProduceRequest(topic, vp, key, value, headers) for view in self.views for topic, vp, key, value, headers in view.due(p, now, everything)]

    def purge(self, p: int, now: int | None = None) -> list[ProduceRequest]:
        """Remove every record of partition p (a `simple` SOW does not survive a restart)."""
        now = now_ms() if now is None else now
        out: list[ProduceRequest] = []
        store = self.open(p)
        for key, record in list(store.records()):
            store.stage(key, None)
            self._emit(p, removal(Op.DELETE, key, record, now, self.next_seq(p, now)), out)
        return out


__all__ = ["InputMessage", "ProduceRequest", "SowTopicProcessor"]
