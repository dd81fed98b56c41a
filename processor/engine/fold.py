"""The reference fold: a SOW topic's input history applied in order, one message at a time, by the
same partition engine as the workers, over plain dicts. No Kafka and no Spark here: the Spark snapshot
is tested and benchmarked against this, and `ksow replay` uses it for the changes after its snapshot.

What "the history" means:
- Inputs are `<topic>` (default command publish) and `<topic>.delta` (delta_publish), never
  `<topic>.repartition` (it only holds copies of them).
- Order: by (sort time, topic rank (`<topic>` before `<topic>.delta`), partition, offset), the
  order in which a worker applies the inputs of one SOW partition. An input's sort time is the
  largest Kafka timestamp so far in its input partition (processor.engine.ordering), so a timestamp
  that goes backwards (publishers' clocks) keeps its offset's place; where timestamps do not go
  backwards it is the timestamp. (A worker also sorts a publisher's stamp more than 10 s ahead of its
  own clock as that clock plus 10 s, which no history holds: the topics ksow creates refuse such
  stamps.)
- "Now" for a message is its Kafka timestamp: lifetimes count from it. Every record whose instant
  is at or before its sort time expires, at its instant, before the message applies.
- A message a worker rejects changes nothing (it is counted in `rejected`).
- The SOW "as of" T holds what the messages with sort time <= T left (a state a worker went
  through: its inputs up to a place in its order), minus records whose instant is <= T (when the
  topic's expiration is not disabled).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from operator import itemgetter
from typing import Iterable, Iterator

from processor.contract.errors import InputError
from processor.contract.types import Command, InputMessage, SowCommand, SowRecord
from processor.core.codec import Codec
from processor.core.commands import header_map, parse_command
from processor.core.expiry import is_due
from processor.core.filters import FilterError
from processor.core.keys import owner_partition
from processor.core.sow import Transition
from processor.engine.ordering import in_partition_time_order
from processor.engine.partition import SowPartition, pop_due_by_lookup, scan_matching
from processor.topology import SowTopic


class DictState:
    """A `PartitionState` over a dict, with a heap of expiry instants (stale entries skipped lazily)."""

    def __init__(self) -> None:
        self.records: dict[str, SowRecord] = {}
        self._due: list[tuple[int, str]] = []
        self._counter = 0

    def get(self, key: str) -> SowRecord | None:
        return self.records.get(key)

    def put(self, key: str, record: SowRecord) -> None:
        self.records[key] = record
        if record.expires_at is not None:
            heapq.heappush(self._due, (record.expires_at, key))

    def remove(self, key: str) -> None:
        self.records.pop(key, None)

    def size(self) -> int:
        return len(self.records)

    def matching(self, predicate) -> Iterator[str]:
        return scan_matching(lambda: iter(list(self.records.items())), predicate)

    def due(self, now_ms: int) -> Iterator[tuple[int, str]]:
        due = self._due
        while due and due[0][0] <= now_ms:
            yield heapq.heappop(due)

    pop_due = pop_due_by_lookup

    def next_due(self) -> int | None:
        """The earliest instant in the heap (maybe stale), or None."""
        return self._due[0][0] if self._due else None

    def least_recently_updated(self) -> Iterator[tuple[str, SowRecord]]:
        return iter(sorted(self.records.items(), key=lambda item: item[1].seq))

    def counter(self) -> int:
        return self._counter

    def set_counter(self, value: int) -> None:
        self._counter = value


class _Collect:
    """A ChangeListener that keeps the transitions (the fold's output, instead of Kafka messages)."""

    def __init__(self) -> None:
        self.transitions: list[Transition] = []

    def on_change(self, p: int, t: Transition, out) -> None:
        self.transitions.append(t)


def topic_rank(spec: SowTopic, topic: str) -> int:
    """Tie-break for equal timestamps: full publishes (`<topic>`) before deltas (`<topic>.delta`)."""
    return 1 if topic == spec.delta_topic else 0


def history(spec: SowTopic, messages: Iterable[InputMessage], until: int | None = None) -> list[tuple[int, InputMessage]]:
    """(sort time, message) in history order: (sort time, topic rank, partition, offset); with
    `until`, only those whose sort time is <= it. Give every message of a partition up to `until` (or
    all): the sort time of one depends on those before it."""
    ordered = in_partition_time_order((m.timestamp, topic_rank(spec, m.topic), m.partition, m.offset, m) for m in messages)
    if until is not None:
        ordered = ordered[:bisect_right(ordered, until, key=itemgetter(0))]
    return [(entry[0], entry[4]) for entry in ordered]


def in_order(spec: SowTopic, messages: Iterable[InputMessage], until: int | None = None) -> list[InputMessage]:
    """The messages of `history`, without their sort times (a whole history's fold needs none)."""
    return [msg for _, msg in history(spec, messages, until)]


class SowFold:
    """One SOW topic's state as its history is applied; `transitions=True` also returns the changes
    (ops, diffs, event IDs) the workers would have produced."""

    def __init__(self, spec: SowTopic, codec: Codec | None = None, transitions: bool = False, records: dict[str, SowRecord] | None = None):
        self.spec = spec
        self.codec = codec or spec.codec(None)
        self.policy = spec.expiry
        self.defaults = {spec.topic: Command.PUBLISH, spec.delta_topic: Command.DELTA_PUBLISH}
        self.rejected = 0
        self._collect = _Collect() if transitions else None
        listeners = (self._collect,) if self._collect else ()
        self.states = [DictState() for _ in range(spec.partitions)]
        self.partitions = [SowPartition(spec, p, state, self.codec, listeners) for p, state in enumerate(self.states)]
        for key, record in (records or {}).items():
            self.states[owner_partition(key, spec.partitions)].put(key, record)

    @property
    def records(self) -> dict[str, SowRecord]:
        return {k: r for state in self.states for k, r in state.records.items()}

    def _taken(self) -> list[Transition]:
        if self._collect is None:
            return []
        taken, self._collect.transitions = self._collect.transitions, []
        return taken

    def expire_until(self, now: int) -> list[Transition]:
        """Expire every record whose instant is <= now, each at its instant, in instant order."""
        if self.policy.active:
            while True:
                due = [(at, p) for p, state in enumerate(self.states) if (at := state.next_due()) is not None and at <= now]
                if not due:
                    break
                at, p = min(due)
                self.partitions[p].expire_due(at, None)
        return self._taken()

    def parse(self, msg: InputMessage) -> SowCommand | None:
        """The command a message carries, or None when a worker would reject it."""
        try:
            return parse_command(self.spec.key_spec, self.codec, self.defaults[msg.topic], msg.value, header_map(msg.headers))
        except (InputError, FilterError):
            self.rejected += 1
            return None

    def apply(self, msg: InputMessage, sort: int | None = None) -> list[Transition]:
        """Apply one message at its Kafka timestamp, once what was due by its sort time has expired
        (as a worker's sweeps do before it; in a whole history the inputs before it took the fold
        there already, so `sort` matters only to a fold of part of one)."""
        now = msg.timestamp
        out = self.expire_until(now if sort is None or sort < now else sort)
        cmd = self.parse(msg)
        if cmd is None:
            return out
        n = self.spec.partitions
        if cmd.sow_key is not None:
            owners: Iterable[int] = (owner_partition(cmd.sow_key, n),)
        elif cmd.keys:
            owners = sorted({owner_partition(k, n) for k in cmd.keys})
        else:
            owners = range(n)
        try:
            for p in owners:
                self.partitions[p].apply(cmd, now, now, None)
        except InputError:  # refused by the partition (capacity_policy: reject)
            self.rejected += 1
        return out + self._taken()

    def run(self, messages: Iterable[InputMessage]) -> Iterator[Transition]:
        """Apply messages that are already in history order, yielding transitions."""
        for msg in messages:
            yield from self.apply(msg)

    def as_of(self, instant: int) -> dict[str, SowRecord]:
        """The SOW at `instant` (after the messages applied so far): expired records left out."""
        records = self.records
        if not self.policy.active:
            return records
        return {k: r for k, r in records.items() if not is_due(r.expires_at, instant)}


def fold_history(spec: SowTopic, messages: Iterable[InputMessage], as_of: int, codec: Codec | None = None) -> dict[str, SowRecord]:
    """The SOW of `spec` as it stood at `as_of` (epoch ms), from its input messages in any order."""
    fold = SowFold(spec, codec)
    for sort, msg in history(spec, (m for m in messages if m.topic in fold.defaults), as_of):
        fold.apply(msg, sort)
    return fold.as_of(as_of)
