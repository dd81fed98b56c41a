"""The reference fold: a SOW topic's input history applied in order, one message at a time, with the
core. No Spark here: the Spark snapshot is tested and benchmarked against this, and `ksow replay`
uses it for the changes after its starting snapshot.

What "the history" means (the same rules as `processor.engine.topic`):
- Inputs are `<topic>` (default command publish) and `<topic>.delta` (delta_publish), never
  `<topic>.repartition` (it only holds copies of them).
- Order: by (Kafka timestamp, topic rank (`<topic>` before `<topic>.delta`), partition, offset).
  Within one partition with non-decreasing timestamps (LogAppendTime, or producers that do not set
  older CreateTimes) this is the offset order the worker applied them in.
- "Now" for a message is its Kafka timestamp: lifetimes count from it, and a record whose expiry
  instant is <= that timestamp is gone before the message applies (so a delta on it starts anew).
- A message the worker rejects (bad JSON, missing key field, unknown command, bad header, a filter
  that does not parse) changes nothing.
- The SOW "as of" T holds what the messages with timestamp <= T left, minus records whose expiry
  instant is <= T (when the topic's expiration is not disabled).
"""

from __future__ import annotations

import heapq
from typing import Iterable, Iterator

from processor.contract.types import Command, InputError, Op, SowCommand, SowRecord
from processor.core.codec import Codec, codec_for
from processor.core.commands import header_map, parse_command
from processor.core.expiry import is_due
from processor.core.filters import FilterError, compile_filter
from processor.core.keys import owner_partition
from processor.core.merge import merge
from processor.core.sow import Transition, apply_write, removal
from processor.engine.topic import SEQ_PARTITION_BITS, InputMessage
from processor.topology import SowTopic


def topic_rank(spec: SowTopic, topic: str) -> int:
    """Tie-break for equal timestamps: full publishes (`<topic>`) before deltas (`<topic>.delta`)."""
    return 1 if topic == spec.delta_topic else 0


def in_order(spec: SowTopic, messages: Iterable[InputMessage]) -> list[InputMessage]:
    """The messages in history order: (timestamp, topic rank, partition, offset)."""
    return sorted(messages, key=lambda m: (m.timestamp, topic_rank(spec, m.topic), m.partition, m.offset))


class SowFold:
    """One SOW topic's state as its history is applied; `transitions=True` also yields what the
    workers would have produced (ops, diffs, event IDs synthesized as the worker makes them)."""

    def __init__(self, spec: SowTopic, codec: Codec | None = None, transitions: bool = False, records: dict[str, SowRecord] | None = None):
        self.spec = spec
        self.codec = codec or codec_for(spec.message_type.value, spec.schema_)
        self.policy = spec.expiry
        self.key_paths = spec.key_spec.split
        self.defaults = {spec.topic: Command.PUBLISH, spec.delta_topic: Command.DELTA_PUBLISH}
        self.records: dict[str, SowRecord] = {}
        self.transitions = transitions
        self.rejected = 0
        self._due: list[tuple[int, str]] = []  # (expires_at, key), stale entries skipped lazily
        self._counters: dict[int, int] = {}
        for key, record in (records or {}).items():
            self._store(key, record)

    # state --------------------------------------------------------------------------------
    def _store(self, key: str, record: SowRecord) -> None:
        self.records[key] = record
        if self.policy.active and record.expires_at is not None:
            heapq.heappush(self._due, (record.expires_at, key))

    def _seq(self, key: str, now: int) -> int:
        """As `SowTopicProcessor.next_seq`, with the message instant as the clock."""
        if not self.transitions:
            return 0
        p = owner_partition(key, self.spec.partitions)
        counter = max(self._counters.get(p, 0) + 1, now * 1000)
        self._counters[p] = counter
        return (counter << SEQ_PARTITION_BITS) | p

    def expire_until(self, now: int) -> list[Transition]:
        """Remove every record whose instant is <= now, in instant order (what the timers do)."""
        out: list[Transition] = []
        due = self._due
        while due and due[0][0] <= now:
            at, key = heapq.heappop(due)
            record = self.records.get(key)
            if record is None or record.expires_at != at:
                continue  # updated or deleted since
            del self.records[key]
            if self.transitions:
                out.append(removal(Op.EXPIRE, key, record, at, self._seq(key, at)))
        return out

    # inputs -------------------------------------------------------------------------------
    def parse(self, msg: InputMessage) -> SowCommand | None:
        """The command a message carries, or None when the worker would reject it."""
        try:
            cmd = parse_command(self.spec.key_spec, self.codec, self.defaults[msg.topic], msg.value, header_map(msg.headers))
            if cmd.filter is not None:
                compile_filter(cmd.filter)
            return cmd
        except (InputError, FilterError):
            self.rejected += 1
            return None

    def apply(self, msg: InputMessage) -> list[Transition]:
        """Apply one message at its Kafka timestamp (expiring what was due first)."""
        now = msg.timestamp
        out = self.expire_until(now) if self._due else []
        cmd = self.parse(msg)
        if cmd is None:
            return out
        if cmd.command is Command.SOW_DELETE:
            self._delete(cmd, now, out)
        else:
            self._write(cmd, now, out)
        return out

    def _write(self, cmd: SowCommand, now: int, out: list[Transition]) -> None:
        key = cmd.sow_key
        assert key is not None and cmd.data is not None
        before = self.records.get(key)
        if self.transitions:
            t = apply_write(key, before, cmd, self.policy, self.key_paths, now, self._seq(key, now))
            assert t.after is not None
            self._store(key, t.after)
            out.append(t)
            return
        # The state alone: apply_write without the diff nobody reads here (the bench's fast loop).
        data = merge(before.data, cmd.data) if cmd.command is Command.DELTA_PUBLISH and before is not None else cmd.data
        self._store(key, SowRecord(data, 0, self.policy.expires_at(now, cmd.expiration_ms), now))

    def _delete(self, cmd: SowCommand, now: int, out: list[Transition]) -> None:
        if cmd.sow_key is not None:
            keys: Iterable[str] = (cmd.sow_key,)
        elif cmd.keys:
            keys = cmd.keys
        else:
            predicate = compile_filter(cmd.filter or "1=1")
            keys = [k for k, r in self.records.items() if predicate.matches(r.data)]
        for key in keys:
            before = self.records.pop(key, None)
            if before is not None and self.transitions:
                out.append(removal(Op.DELETE, key, before, now, self._seq(key, now)))

    def run(self, messages: Iterable[InputMessage]) -> Iterator[Transition]:
        """Apply messages that are already in history order, yielding transitions."""
        for msg in messages:
            yield from self.apply(msg)

    def as_of(self, instant: int) -> dict[str, SowRecord]:
        """The SOW at `instant` (after the messages applied so far): expired records left out."""
        if not self.policy.active:
            return dict(self.records)
        return {k: r for k, r in self.records.items() if not is_due(r.expires_at, instant)}


def fold_history(spec: SowTopic, messages: Iterable[InputMessage], as_of: int, codec: Codec | None = None) -> dict[str, SowRecord]:
    """The SOW of `spec` as it stood at `as_of` (epoch ms), from its input messages in any order."""
    fold = SowFold(spec, codec)
    for msg in in_order(spec, (m for m in messages if m.timestamp <= as_of and m.topic in fold.defaults)):
        fold.apply(msg)
    return fold.as_of(as_of)
