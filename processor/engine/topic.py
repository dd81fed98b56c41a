"""One SOW topic as an engine sees it: inputs parsed, routed to the partition that owns them, applied.

The facade over the partitions of one topic that a runner owns. A runner hands it input messages in
the order they are to be applied and a list to append outputs to; routing applies each input in the
partition that owns its SowKey (a delete by SowKeys or by filter in every owner) when the runner
owns that partition, and reroutes it through `<topic>.repartition` otherwise; each partition applies
its inputs with the rules of `SowPartition`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterable

from processor.contract import headers as H
from processor.contract.errors import BatchAborted, InputError
from processor.contract.limits import delete_filter_seconds, max_record_bytes
from processor.contract.types import Command, InputMessage, Output, SowCommand, SowRecord
from processor.core.bookmarks import SEQ_PARTITION_BITS
from processor.core.changelog import MalformedSowMessage, sow_change
from processor.core.codec import Codec
from processor.core.commands import header_map, parse_command
from processor.core.filters import compile_filter
from processor.core.keyplan import choose_keys
from processor.core.keys import owner_partition
from processor.engine.outputs import Streams, rejected, source_headers
from processor.engine.partition import DeleteBudget, PartitionState, SowPartition
from processor.engine.views import ViewProcessor, views_mark, views_of
from processor.state.base import IndexSpec, PartitionStore
from processor.topology import SowTopic, View

log = logging.getLogger("ksow.engine")

_RECENT_OWNERS = 1 << 17  # SowKeys whose owner an engine remembers (cleared whole past that)

_LOCAL = (H.LOCAL, b"1")

# The event IDs a restore takes from `<topic>.sow`: a worker's are positive and far below 2**62 (the
# clock floors the counter at epoch ms * 1000, 2**62 is past the year 2100). A negative one cannot be
# stored (the age index keys it unsigned), and one near 2**63 would leave the next event ID past 64
# bits: every later write of the partition would fail to commit.
_MAX_RESTORED_SEQ = 1 << 62


def _resume_after(state: PartitionState, seq: int) -> None:
    """Make the partition's next event ID come after `seq`, an ID an owner of it already handed out."""
    state.set_counter(max(state.counter(), seq >> SEQ_PARTITION_BITS))


class _Held(Exception):
    """An input that would touch a partition this runner owns but is still restoring: `handle`
    stops before it, and it waits with what follows it, so the inputs keep their order."""


class SowTopicEngine:
    """The partitions of one SOW topic that this runner owns."""

    def __init__(self, spec: SowTopic, topology_dir: Path | None = None, views: Iterable[View] = ()):
        self.spec = spec
        self.codec: Codec = spec.codec(topology_dir)
        self.views: list[ViewProcessor] = views_of(spec, views)
        self.views_mark = views_mark(self.views)  # the metadata of its inputs' offsets (what its views' topics follow)
        self.streams = Streams.of(spec)
        self.partitions: dict[int, SowPartition] = {}
        self.restoring: set[int] = set()  # partitions this runner owns whose state is being rebuilt (detached)
        self.defaults = {spec.topic: Command.PUBLISH, spec.delta_topic: Command.DELTA_PUBLISH}
        self.inputs = (spec.topic, spec.delta_topic, spec.repartition_topic)
        self.key_paths = spec.key_spec.split
        self.current: InputMessage | None = None  # the input being applied (a runner's checkpoint leaves it out)
        self._owners: dict[str, int] = {}  # owner partitions of recent SowKeys: one dict look-up per input
        # What a store of this topic keeps beside its records (only topics with a capacity pay for ages).
        self.indexes = IndexSpec(tuple(tuple(i) for i in spec.hash_indexes), track_age=spec.capacity > 0,
                                 keys=spec.key_spec if spec.key_spec.paths else None)
        # A runner whose outputs commit in transactions sets this to their timeout (seconds): a
        # delete by SowKeys or filter that took longer cannot have committed (the coordinator aborts
        # the transaction), and read again it would stall the partition the same way, for ever. It
        # is refused when it comes again (`_too_slow`: where it was read).
        self.slow_delete_seconds: float | None = None
        self._too_slow: set[tuple[str, int, int]] = set()
        # The largest encoded record or diff a write may produce (KSOW_MAX_RECORD_BYTES): a runner
        # lowers it to what its output topics take (`limit_record_bytes`).
        self.max_record_bytes = max_record_bytes()

    # partitions -----------------------------------------------------------------------
    def attach(self, p: int, state: PartitionState) -> SowPartition:
        self.restoring.discard(p)
        partition = self.partitions[p] = SowPartition(self.spec, p, state, self.codec, self.views)
        partition.max_bytes = self.max_record_bytes
        return partition

    def limit_record_bytes(self, limit: int) -> None:
        """Refuse (on `.errors`) a write whose record or diff would be larger than `limit` bytes as
        well: the broker would refuse its message, and the batch holding it, for ever."""
        self.max_record_bytes = min(max_record_bytes(), limit)
        for partition in self.partitions.values():
            partition.max_bytes = self.max_record_bytes

    def detach(self, p: int, restoring: bool = False) -> None:
        """Forget partition p (and its views' holds). `restoring`: it stays this runner's while a
        runner rebuilds its state; until it is attached again an input that would touch it waits
        (`handle` stops before it) instead of going to its owner through `.repartition`."""
        self.partitions.pop(p, None)
        if restoring:
            self.restoring.add(p)
        else:
            self.restoring.discard(p)
        for view in self.views:
            view.forget(p)

    def restore(self, p: int, state: PartitionStore, key: bytes | None, value: bytes | None, headers, timestamp: int) -> None:
        """Apply one `<topic>.sow` record to partition p's state (replaying the changelog). Raises
        MalformedSowMessage on a record that is not a SOW record (the runner skips it)."""
        for _, exc in self.restore_many(p, state, ((key, value, headers, timestamp),)):
            raise exc

    def restore_many(self, p: int, state: PartitionStore, changes: Iterable[tuple]) -> list[tuple[int, MalformedSowMessage]]:
        """Apply `<topic>.sow` records, (key, value, headers, timestamp) each, in order to partition
        p's state (replaying the changelog): a record's event ID is the partition's next one at
        least, a tombstone removes its record, any other record is put with the message's instant
        as its update instant. Returns (place in `changes`, why) of the records that are not SOW
        records, passed over (the runner says so and goes on)."""
        parse, codec, record = sow_change, self.codec, SowRecord
        skipped: list[tuple[int, MalformedSowMessage]] = []
        writes: list[tuple[str, SowRecord | None]] = []
        last = 0  # the largest event ID
        for n, (key, value, headers, timestamp) in enumerate(changes):
            try:
                _, sow_key, seq, expires_at, data = parse(codec, key, value, headers)
                if seq is None:
                    seq = 0
                elif not 0 <= seq < _MAX_RESTORED_SEQ:
                    raise MalformedSowMessage(f"{H.SEQ} {seq} is not an event ID a worker writes (0 to 2**62)")
            except MalformedSowMessage as exc:  # written by anything else: it must not stop restore
                skipped.append((n, exc))
                continue
            if seq > last:
                last = seq
            writes.append((sow_key, None if data is None else record(data, seq, expires_at, timestamp)))
        if last:
            _resume_after(state, last)
        state.put_many(writes)
        return skipped

    def reseed(self, p: int, records: Iterable[tuple[str, SowRecord]]) -> list[Output]:
        """The `.sow` messages that write records back to partition p's changelog (it was deleted and
        created again, or the topic's encoding changed): the same versions, with their own event IDs
        and last-change instants (the messages' timestamps, as `render` gives them), in the
        topology's encoding; nothing on `.diff`, since nothing changed."""
        sow, encode, out = self.spec.sow_topic, self.codec.encode, []
        for key, record in records:
            kb = key.encode()
            headers = [(H.KEY, kb), (H.OP, b"update"), (H.SEQ, b"%d" % record.seq)]
            if record.expires_at is not None:
                headers.append((H.EXPIRES_AT, b"%d" % record.expires_at))
            out.append(Output(sow, p, kb, encode(record.data), headers, True, record.updated_at))
        return out

    def resume_events(self, state: PartitionState, headers) -> None:
        """Take the event ID of one of this topic's own output messages (the last `.diff` events of a
        transient partition, which keeps no changelog, when it changes owner): the partition's next
        one comes after it. A message without one, or with no event ID a worker writes, is passed over."""
        for name, value in headers or ():
            if name == H.SEQ:
                try:
                    seq = int(value)
                except ValueError:
                    return
                if 0 < seq < _MAX_RESTORED_SEQ:
                    _resume_after(state, seq)
                return

    # inputs ---------------------------------------------------------------------------
    def handle(self, messages: Iterable[InputMessage], now: int, out: list, until: float | None = None) -> int:
        """Apply messages in the given order; what cannot be applied goes to `.errors` with the reason.
        With `until` (a time.monotonic() instant), stop before any message but the first once it has
        passed, and before one that would touch a partition still restoring. Returns how many
        messages were handled (the first ones)."""
        done = 0
        for msg in messages:
            if until is not None and done and time.monotonic() >= until:
                break
            done += 1
            self.current = msg
            try:
                self.handle_one(msg, now, out)
            except _Held:
                done -= 1
                break
            except BatchAborted:
                self.current = None
                raise
            except InputError as exc:
                out.append(rejected(msg, str(exc), self.streams))
            except Exception as exc:  # a poison message must not stop the worker: park it with the reason
                log.exception("could not apply %s[%d]@%d", msg.topic, msg.partition, msg.offset)
                out.append(rejected(msg, f"internal error: {type(exc).__name__}: {exc}", self.streams))
        self.current = None
        return done

    def parse(self, msg: InputMessage):
        """(the command, the command its topic defaults to) of one input; raises InputError."""
        default = self.defaults.get(msg.topic)
        if default is None:  # the repartition topic: the first topic's default travels in a header
            origin = dict(msg.headers or ()).get(H.ORIGIN, b"publish")
            try:
                default = Command(origin.decode(errors="replace"))
            except ValueError:
                raise InputError(f"bad {H.ORIGIN} header {origin!r} on {msg.topic}") from None
        return parse_command(self.spec.key_spec, self.codec, default, msg.value, header_map(msg.headers) if msg.headers else None), default

    def handle_one(self, msg: InputMessage, now: int, out: list) -> None:
        """Apply one input where it belongs: in the partition that owns it when this runner owns that
        partition too, else rerouted through `.repartition` to its owner."""
        cmd, default = self.parse(msg)
        published = msg.timestamp or now
        came = msg.sort or published  # its place in the order: what was due by then expired before it
        key = cmd.sow_key
        if key is not None:
            owner = self._owners.get(key)
            if owner is None:
                owner = self._owner(key)
            target = self.partitions.get(owner)
            if target is None:
                if owner in self.restoring:
                    raise _Held
                out.append(self._reroute(msg, default, owner, cmd.sow_key.encode()))
            else:
                target.apply(cmd, published, now, out, came)
            return
        if self.slow_delete_seconds is None:
            self._delete(msg, cmd, default, published, came, now, out)
            return
        where = (msg.topic, msg.partition, msg.offset)
        if where in self._too_slow:
            raise InputError(f"this sow_delete took longer than the transaction timeout ({self.slow_delete_seconds:g}s) the "
                             "last time it was applied, so it could not commit; it is not applied again (what its earlier "
                             "commits removed stays removed; a LIKE with large counted repetitions over large values is "
                             "the usual cause)")
        began = time.monotonic()
        try:
            self._delete(msg, cmd, default, published, came, now, out)
        finally:
            if time.monotonic() - began > self.slow_delete_seconds:
                self._too_slow.add(where)

    def _delete(self, msg: InputMessage, cmd: SowCommand, default: Command, published: int, came: int, now: int, out: list) -> None:
        """A delete by SowKeys or filter: applied by every owner of what it names (`handle_one`), every
        partition for a filter that names no SowKeys."""
        partitions = self.partitions
        n = self.spec.partitions
        if msg.topic == self.streams.repartition and _is_local(msg):  # a delete another worker fanned out: for this partition, as of when it was sent
            partitions[msg.partition].delete(cmd, now, out, sent_at=published)
            return
        # Each key is deleted by the partition that owns it; a filter by every partition, or by the
        # owners of the SowKeys it names when it names some in every partition (`choose_keys`). The
        # partitions here go first: a long delete may commit part of its work and, after a crash,
        # be applied again (engine.partition.checkpoint), so the copies for other owners are sent
        # last, once, in the transaction that commits this input.
        # The partition it was read from has applied nothing sent after it; another may have (this
        # worker took the delete's partition over from one that had not applied it): there, as for
        # a fanned-out copy, what changed after the delete's place in the order (its sort time, not
        # its own stamp, which can be behind what its partition applied before it) is not the
        # delete's to remove. The copies carry that place as their timestamp.
        named = cmd.keys or choose_keys(compile_filter(cmd.filter or "1=1"), self.spec.key_spec, False)
        owners = set(range(n)) if named is None else {self._owner(key) for key in named}
        if not owners.isdisjoint(self.restoring):
            raise _Held
        budget = None if cmd.keys else DeleteBudget(delete_filter_seconds())  # one filter budget for all of them
        for q in sorted(owners & partitions.keys()):
            if q == msg.partition:
                partitions[q].delete(cmd, now, out, at=came, budget=budget)  # as apply() would
            else:
                partitions[q].delete(cmd, now, out, sent_at=came, budget=budget)
        if cmd.keys:
            for key in cmd.keys:
                owner = self._owner(key)
                if owner not in partitions:
                    out.append(self._reroute(msg, default, owner, key.encode(), (H.KEYS, key.encode()), came))
        else:
            for q in sorted(owners - partitions.keys()):
                out.append(self._reroute(msg, default, q, msg.key, None, came))

    def _owner(self, key: str) -> int:
        """The partition that owns a SowKey. murmur2 is pure Python (~3 us a call) and SowKeys
        repeat, so the owners of recent ones are remembered (the hot path looks in `_owners` first)."""
        owners = self._owners
        owner = owners.get(key)
        if owner is None:
            if len(owners) >= _RECENT_OWNERS:
                owners.clear()
            owner = owners[key] = owner_partition(key, self.spec.partitions)
        return owner

    def _reroute(self, msg: InputMessage, default: Command, p: int, key: bytes | None, extra: tuple | None = None,
                 timestamp: int | None = None) -> Output:
        """The copy of an input for partition p's owner, stamped as the input (a lifetime counts
        from it) or with `timestamp` (a delete's place in the order)."""
        headers = [(k, v) for k, v in (msg.headers or ()) if k not in H.INTERNAL and not (extra and k == H.KEYS)]
        headers += [(H.ORIGIN, default.value.encode()), _LOCAL, *source_headers(msg, self.streams)]
        if extra:
            headers.append(extra)
        return Output(self.spec.repartition_topic, p, key, msg.value, headers, timestamp=msg.timestamp if timestamp is None else timestamp)

    # timers ---------------------------------------------------------------------------
    def expire_due(self, p: int, now: int, out: list, limit: int | None = None, until: int | None = None) -> tuple[int, int]:
        """(records expired, instant of the oldest of them): SowPartition.expire_due."""
        return self.partitions[p].expire_due(now, out, limit, until)

    def release_views(self, p: int, now: int, out: list) -> None:
        """Release the conflated view events whose interval ended."""
        for view in self.views:
            view.due(p, now, out)

    @property
    def conflates(self) -> bool:
        return any(v.conflation_ms for v in self.views)


def _is_local(msg: InputMessage) -> bool:
    return any(name == H.LOCAL for name, _ in msg.headers or ())
