"""The SOW rules of one partition, written once.

Every engine applies its inputs through `SowPartition`: the Faust worker over its RocksDB or memory
store, Spark streaming over `transformWithState` state, the reference fold over a dict. They differ
only in the `PartitionState` they hand in (and in what they call "now"), so a rule changed here is
changed for all of them.

What a partition decides: whether a write finds its record already expired, whether capacity
evicts or rejects, which records a delete reaches, when a record expires, the event ID of every
change, and which messages (SOW streams and views) tell the world.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, Protocol

from processor.contract.errors import InputError
from processor.contract.limits import delete_chunk, delete_filter_seconds, max_record_bytes
from processor.contract.types import Command, Op, SowCommand, SowRecord
from processor.core.bookmarks import SEQ_PARTITION_BITS
from processor.core.codec import Codec
from processor.core.expiry import is_due
from processor.core.filters import compile_filter
from processor.core.keys import owner_partition
from processor.core.sow import Transition, apply_write, removal
from processor.engine.outputs import Sink, Streams, render, render_removal, sink
from processor.topology import CapacityPolicy, Persistence, SowTopic

_SOW_DELETE, _EXPIRE = Command.SOW_DELETE, Op.EXPIRE  # globals: a member looked up on its Enum class costs ~8x more


def checkpoint(out: list | None) -> None:
    """In the middle of a delete over many records, let a runner commit what is done so far (its
    outputs, its state and the inputs before this one), so one input never holds an unbounded
    transaction or unbounded staged state. A runner's output buffer that can do so has `checkpoint`;
    a plain list keeps everything. After a crash the delete is applied again and finds only the
    records it had not removed yet: the same outcome, each removal told once."""
    if out is not None:
        commit = getattr(out, "checkpoint", None)
        if commit is not None:
            commit()


class PartitionState(Protocol):
    """What the SOW rules need from the state of one partition. Writes are visible to reads at once;
    when they become durable is the engine's business (a store commits after its Kafka transaction)."""

    def get(self, key: str) -> SowRecord | None: ...

    def put(self, key: str, record: SowRecord) -> None: ...

    def remove(self, key: str) -> None: ...

    def size(self) -> int:
        """Records, the writes in flight included (what capacity counts)."""
        ...

    def matching(self, predicate) -> Iterator[str]:
        """SowKeys of the records (writes in flight included) whose data satisfies the filter, as
        they were when it was called: the caller may remove records, and commit, while it runs."""
        ...

    def due(self, now_ms: int) -> Iterator[tuple[int, str]]:
        """(expires_at, SowKey) of records whose instant is at or before now_ms, oldest first.
        May hold stale entries (a record updated since): the engine checks each against get().
        Every entry the caller goes past (asks for the next one) counts as handled: expired or stale."""
        ...

    def pop_due(self, now_ms: int) -> Iterator[tuple[int, str, SowRecord]]:
        """Remove the records whose instant is at or before now_ms and hand each out as (expires_at,
        SowKey, record), oldest first: each is removed when handed out. `pop_due_by_lookup` does it
        with due(), get() and remove(); a store may do it in one pass."""
        ...

    def least_recently_updated(self) -> Iterator[tuple[str, SowRecord]]:
        """Live records, least recently updated first (for capacity eviction): by event ID, which
        orders a partition's changes as they were applied (updates of the same millisecond too)."""
        ...

    def counter(self) -> int: ...

    def set_counter(self, value: int) -> None: ...


class ChangeListener(Protocol):
    """Told of every change of the partition (server-side views)."""

    def on_change(self, p: int, t: Transition, out: list) -> None: ...


class SowPartition:
    """One partition of one SOW topic, over the state its engine keeps."""

    def __init__(self, spec: SowTopic, p: int, state: PartitionState, codec: Codec, listeners: Iterable[ChangeListener] = ()):
        self.spec = spec
        self.p = p
        self.state = state
        self.codec = codec
        self.listeners = tuple(listeners)
        self.policy = spec.expiry
        self.expiring = spec.expiry.active
        self.key_paths = spec.key_spec.split
        self.streams = Streams.of(spec)
        self.stored = spec.persistence is not Persistence.TRANSIENT
        n, capacity = spec.partitions, spec.capacity
        # Capacity is split evenly over the partitions, so the topic never holds more than `capacity`.
        self.capacity = capacity // n + (1 if p < capacity % n else 0) if capacity else 0
        self.max_bytes = max_record_bytes()
        self._out: object = None  # the output buffer `_to` sends into
        self._to: Sink | None = None
        self.delete_chunk = delete_chunk()

    # event IDs ---------------------------------------------------------------------
    def next_seq(self, now: int) -> int:
        """Increasing per partition, unique in the topic, never reused: a counter floored by the clock,
        so a partition rebuilt from a compacted changelog never hands out an old number again."""
        state = self.state
        counter = state.counter() + 1
        floor = now * 1000
        if counter < floor:
            counter = floor
        state.set_counter(counter)
        return (counter << SEQ_PARTITION_BITS) | self.p

    # commands ----------------------------------------------------------------------
    def apply(self, cmd: SowCommand, published: int, now: int, out: list, came: int | None = None) -> None:
        """Apply one command owned by this partition. `published` is the instant the input reached
        Kafka: a lifetime counts from it. `came` (default `published`) is its place in the order of
        the partition's inputs, its sort time: a record whose instant had not passed by then is still
        there for it, however late it is applied (a worker behind its inputs, or down a while, does
        not lose an update or a delete sent in time). `now` is when it is applied. Raises InputError
        when refused."""
        if came is None:
            came = published
        if cmd.command is _SOW_DELETE:
            self.delete(cmd, now, out, at=came)
        else:
            self.write(cmd, published, now, out, came)

    def write(self, cmd: SowCommand, published: int, now: int, out: list, came: int) -> None:
        """A publish or delta publish (`apply`)."""
        key = cmd.sow_key
        assert key is not None
        state = self.state
        stored = self.stored
        at = came if came < now else now  # what had expired by then is gone for it
        before = state.get(key) if stored else None
        if before is not None:
            if self.expiring and is_due(before.expires_at, at):
                # Its instant passed before this write came: it expired first, and the write starts anew.
                state.remove(key)
                self._removed(_EXPIRE, key, before, now, out)
                before = None
        if before is None and self.capacity and stored:
            self._make_room(at, now, out)
        t = apply_write(key, before, cmd, self.policy, self.key_paths, published, self.next_seq(now))
        if out is not None:  # else the caller keeps transitions, not messages (the reference fold)
            # Refused (InputError, nothing emitted) when the record or its diff is over the size a
            # Kafka message may have.
            render(t, self.p, self.codec, self.streams, self._sink(out), stored, self.max_bytes)
        # Stored before the views hear of it: a runner's buffer produces `.sow` at once, so should a
        # view fail on the record, the store still holds what `.sow` says.
        if stored:
            state.put(key, t.after)  # type: ignore[arg-type]
        for listener in self.listeners:
            listener.on_change(self.p, t, out)

    def _make_room(self, at: int, now: int, out: list) -> None:
        """Before a new record (sent at `at`): evict the least recently updated record(s), or refuse
        the new one. Records whose instant passed before it came are not counted: they expire first."""
        state = self.state
        if state.size() < self.capacity:
            return
        if self.expiring:
            self.expire_due(now, out, until=at)
            if state.size() < self.capacity:
                return
        if self.spec.capacity_policy is CapacityPolicy.REJECT:
            raise InputError(
                f"capacity reached: partition {self.p} of {self.spec.topic} holds its share of {self.capacity} of capacity "
                f"{self.spec.capacity} records (capacity_policy: reject)"
            )
        for key, victim in state.least_recently_updated():
            if state.size() < self.capacity:
                break
            state.remove(key)
            self._removed(_EXPIRE if self.expiring and is_due(victim.expires_at, at) else Op.EVICT, key, victim, now, out)

    def delete(self, cmd: SowCommand, now: int, out: list, sent_at: int | None = None, at: int | None = None,
               budget: "DeleteBudget | None" = None) -> int:
        """A sow_delete by data or SowKey, by SowKeys (those this partition owns) or by filter, sent
        at `at` (or `sent_at`; else now): a record whose instant passed before then expires instead.
        Returns how many records it removed. A filter's time comes out of `budget` (default: a
        budget of its own), which the partitions of one input share.

        `sent_at` is given for a delete that another worker fanned out to this partition through
        `.repartition`: it can arrive after this partition applied inputs sent later than it, and a
        record one of those wrote (last changed after `sent_at`) is not the delete's to remove."""
        sent = sent_at if sent_at is not None else at if at is not None else now
        due_by = sent if sent < now else now
        if not self.stored:
            return 0  # nothing is kept, so nothing can be deleted
        if cmd.sow_key is not None:
            keys: Iterable[str] = (cmd.sow_key,)
        elif cmd.keys:
            n = self.spec.partitions
            keys = [k for k in cmd.keys if owner_partition(k, n) == self.p]
        else:  # lazily: a filter over millions of records is never listed at once
            if budget is None:
                budget = DeleteBudget(delete_filter_seconds())
            keys = self.state.matching(_TimedFilter(compile_filter(cmd.filter or "1=1"), budget, lambda: checkpoint(out)))
        state = self.state
        expiring = self.policy.active
        chunk = self.delete_chunk
        removed = 0
        try:
            for key in keys:
                before = state.get(key)
                if before is None or (sent_at is not None and before.updated_at > sent_at):
                    continue
                # A record whose instant has passed was gone before the delete came: it expires.
                op = Op.EXPIRE if expiring and is_due(before.expires_at, due_by) else Op.DELETE
                state.remove(key)
                self._removed(op, key, before, now, out)
                removed += 1
                if removed % chunk == 0:
                    checkpoint(out)
        except _OverBudget as over:
            done = removed + budget.removed  # type: ignore[union-attr]  # only a filter (which has its budget) runs over
            raise InputError(f"the sow-filter took over {over.budget:g}s testing this worker's records (stopped in "
                             f"partition {self.p}; KSOW_DELETE_FILTER_SECONDS); {done} records it matched were deleted, the rest "
                             "were not, nor those of other workers' partitions (a LIKE with large counted "
                             "repetitions is the usual cause)") from None
        if budget is not None:
            budget.removed += removed
        return removed

    def expire_due(self, now: int, out: list, limit: int | None = None, until: int | None = None) -> tuple[int, int]:
        """Remove the records whose instant is at or before `until` (default `now`; at most `limit`),
        expiring at `now`. Returns how many, and the instant of the oldest of them (0 when none): `now`
        less that instant is how late the sweep came, the `sow-actual-expiry` less `sow-expires-at` of
        its first expiry."""
        if not self.policy.active or not self.stored or limit == 0:
            return 0, 0
        state = self.state
        p, codec, streams, listeners = self.p, self.codec, self.streams, self.listeners
        to = None if out is None else self._sink(out)
        # As next_seq, for a run of removals at one instant: the counter is read once and stored once.
        counter = start = state.counter()
        floor = now * 1000
        expired = oldest = 0
        for at, key, record in state.pop_due(now if until is None else until):
            counter = counter + 1 if counter >= floor else floor
            seq = (counter << SEQ_PARTITION_BITS) | p
            if to is not None:
                render_removal(_EXPIRE, key.encode(), record, seq, now, p, codec, streams, to)
            if listeners:
                self._tell(removal(_EXPIRE, key, record, now, seq), out)
            if not expired:
                oldest = at  # pop_due() hands out instants oldest first
            expired += 1
            if expired == limit:  # after the one handed out: it is removed already
                break
        if counter != start:
            state.set_counter(counter)
        return expired, oldest

    def purge(self, records: Iterable[tuple[str, SowRecord]], now: int, out: list) -> None:
        """Remove the given records, telling the world (a `simple` SOW does not survive a restart):
        those past their instant expire (on `EXP.`, as they would have had their owner lived), the
        others are deleted."""
        expires = self.policy.active
        for key, record in list(records):
            self.state.remove(key)
            self._removed(Op.EXPIRE if expires and is_due(record.expires_at, now) else Op.DELETE, key, record, now, out)

    # outputs -----------------------------------------------------------------------
    def _sink(self, out) -> Sink:
        """`sink(out)`, worked out once for each output buffer a runner hands in."""
        if out is not self._out:
            self._out, self._to = out, sink(out)
        return self._to

    def _removed(self, op: Op, key: str, before: SowRecord, now: int, out: list | None) -> None:
        """Tell of a removal the caller made (out=None: the caller keeps transitions, not messages).
        No Transition is made unless a listener needs one: expiry sweeps remove thousands a second."""
        seq = self.next_seq(now)
        if out is not None:
            render_removal(op, key.encode(), before, seq, now, self.p, self.codec, self.streams, self._sink(out))
        if self.listeners:
            self._tell(removal(op, key, before, now, seq), out)

    def _tell(self, t: Transition, out: list | None) -> None:
        for listener in self.listeners:
            listener.on_change(self.p, t, out)


class _OverBudget(Exception):
    def __init__(self, budget: float):
        self.budget = budget


# While a delete's filter tests records, a runner may commit at least this often (`checkpoint`): a
# scan that finds few matches would otherwise hold the transaction open past its timeout (10 s by
# default, under the filter's budget), and the coordinator would abort it and the input be read
# again, for ever.
DELETE_CHECKPOINT_SECONDS = 1.0


class DeleteBudget:
    """The filter time one sow_delete may spend on a worker, shared by every partition of that worker
    it tests: a per-partition budget let one delete hold a worker that owns P partitions P times as
    long (past max.poll.interval.ms with 20 of them: the worker left its group mid-delete)."""

    __slots__ = ("seconds", "spent", "removed")

    def __init__(self, seconds: float):
        self.seconds, self.spent, self.removed = seconds, 0.0, 0


class _TimedFilter:
    """A delete's filter that may spend its `budget` testing records, then raises _OverBudget:
    a delete by filter runs on the worker's loop, and one input must not hold it for hours. Calls
    `tick` every DELETE_CHECKPOINT_SECONDS."""

    __slots__ = ("filter", "budget", "tick", "ticked")

    def __init__(self, inner, budget: DeleteBudget, tick):
        self.filter, self.budget = inner, budget
        self.tick, self.ticked = tick, time.perf_counter()

    def equality_terms(self):
        return self.filter.equality_terms()

    def literal_terms(self):
        return self.filter.literal_terms()

    def matches(self, record: dict) -> bool:
        began = time.perf_counter()
        try:
            return self.filter.matches(record)
        finally:
            ended = time.perf_counter()
            budget = self.budget
            budget.spent += ended - began
            if budget.spent > budget.seconds:
                raise _OverBudget(budget.seconds)
            if ended - self.ticked >= DELETE_CHECKPOINT_SECONDS:
                self.ticked = ended
                self.tick()


def pop_due_by_lookup(state: PartitionState, now_ms: int) -> Iterator[tuple[int, str, SowRecord]]:
    """`PartitionState.pop_due` from its due(), get() and remove(): an entry whose record changed
    since (updated, or deleted) is passed over."""
    for at, key in state.due(now_ms):
        record = state.get(key)
        if record is not None and record.expires_at == at:
            state.remove(key)
            yield at, key, record


def scan_matching(records: Callable[[], Iterator[tuple[str, SowRecord]]], predicate) -> Iterator[str]:
    """`PartitionState.matching` for states without indexes: test every record."""
    matches = predicate.matches
    for key, record in records():
        if matches(record.data):
            yield key
