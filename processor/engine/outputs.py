"""Transitions rendered as the messages of a SOW topic's derived topics (see the contract's "Topics").

One renderer for every engine, so `.sow`, `.diff`, `EXP.<topic>`, `.dead` and `.errors` records are
byte for byte the same whichever engine wrote them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import orjson

from processor.contract import headers as H
from processor.contract.errors import InputError
from processor.contract.types import InputMessage, Op, Output, SowRecord
from processor.core.codec import Codec
from processor.core.sow import Transition
from processor.topology import SowTopic

_KEY, _SEQ, _EXPIRES_AT, _ACTUAL_EXPIRY = H.KEY, H.SEQ, H.EXPIRES_AT, H.ACTUAL_EXPIRY
_INSERT, _UPDATE = (H.OP, b"insert"), (H.OP, b"update")
_EXPIRE, _EVICT = Op.EXPIRE, Op.EVICT  # globals: a member looked up on its Enum class costs ~8x more
# The sow-op header of each removal, found by identity: an Enum member's hash is a Python call.
_EXPIRE_OP, _EVICT_OP, _DELETE_OP = ((H.OP, op.value.encode()) for op in (Op.EXPIRE, Op.EVICT, Op.DELETE))


@dataclass(frozen=True, slots=True)
class Streams:
    """The derived topics of one SOW topic."""

    sow: str
    diff: str
    expired: str | None  # None: expiry_topic none, expired records go to `dead`
    dead: str
    errors: str
    repartition: str
    origin: tuple[str, bytes]  # the sow-topic header of what goes to `expired` or `dead` (shareable topics)

    @classmethod
    def of(cls, spec: SowTopic) -> "Streams":
        return cls(spec.sow_topic, spec.diff_topic, spec.expired_topic, spec.dead_topic, spec.errors_topic, spec.repartition_topic,
                   (H.TOPIC, spec.topic.encode()))


class Sink(Protocol):
    """Where an engine's messages go: a runner's output buffer (the worker's produces them at once)
    or a list that collects them as Outputs (`sink`)."""

    def send(self, topic: str, partition: int, key: bytes | None, value: bytes | None, headers: list,
             changelog: bool = False, timestamp: int = 0) -> None:
        """One message (`changelog`: a `.sow` record)."""
        ...

    def change(self, sow: str, diff: str, partition: int, key: bytes, value: bytes | None, told: bytes, headers: list,
               timestamp: int = 0, side: str | None = None, side_headers: list | None = None) -> None:
        """The messages of one transition, with the same key: `value` on `sow` (None: a tombstone)
        stamped `timestamp` (0: now) and `told` on `diff`, both with `headers`, and, when given,
        `told` on `side` (`EXP.` or `.dead`) with `side_headers`. Every input and every expiry
        sends these: a buffer does its bookkeeping once for them."""
        ...


def sink(out) -> Sink:
    """`out` itself when it is a runner's buffer (it has `change`), else a Sink that appends Outputs
    to it."""
    return out if hasattr(out, "change") else _Collector(out.append)


class _Collector:
    """A Sink over a list's `append` (the fold, Spark, tests): each message becomes an Output."""

    __slots__ = ("append",)

    def __init__(self, append: Callable[[Output], None]):
        self.append = append

    def send(self, topic: str, partition: int, key: bytes | None, value: bytes | None, headers: list,
             changelog: bool = False, timestamp: int = 0) -> None:
        self.append(Output(topic, partition, key, value, headers, changelog, timestamp))

    def change(self, sow: str, diff: str, partition: int, key: bytes, value: bytes | None, told: bytes, headers: list,
               timestamp: int = 0, side: str | None = None, side_headers: list | None = None) -> None:
        append = self.append
        append(Output(sow, partition, key, value, headers, True, timestamp))
        append(Output(diff, partition, key, told, headers))
        if side is not None:
            append(Output(side, partition, key, told, side_headers))


def render(t: Transition, p: int, codec: Codec, streams: Streams, out: Sink, stored: bool = True, max_bytes: int = 0) -> None:
    """Send the messages that tell the world about one transition of partition p into `out`.

    A write puts the merged record on `.sow` and the diff on `.diff`; a removal puts a tombstone on
    `.sow` and the last record on `.diff`, and for expire/evict also on `EXP.`/`.dead`. When nothing
    is stored (`transient` topics), a write is relayed whole on `.diff` and `.sow` is not written.

    With `max_bytes`, a write whose record or diff would be larger raises InputError before anything
    is sent (a runner's buffer produces what it is given at once).
    """
    key = t.key.encode()
    after = t.after
    if after is not None:  # a write: the hot path of every input, hence inline
        headers = [(_KEY, key), _INSERT if t.before is None else _UPDATE, (_SEQ, b"%d" % t.seq)]
        if after.expires_at is not None:
            headers.append((_EXPIRES_AT, b"%d" % after.expires_at))
        try:
            if codec.name == "json":
                # Kept with the record (the store writes it and caches it): an exact-size copy, as
                # orjson's result holds a buffer of some kilobytes (measured: 4 KB a record of ~100
                # bytes, a page fault each and most of the worker's memory when thousands are kept).
                value = after.json = bytes(memoryview(orjson.dumps(after.data)))
            else:
                value = codec.encode(after.data)
            if not stored:
                if max_bytes and len(value) > max_bytes:
                    _too_large(t, streams.diff, len(value), max_bytes)
                out.send(streams.diff, p, key, value, headers)
                return
            changes = orjson.dumps(t.changes)
        except orjson.JSONEncodeError as exc:  # e.g. an Avro record (of a recursive schema) deeper than orjson writes
            deep = ": objects and arrays nest at most 254 levels deep" if "Recursion" in str(exc) else ""
            raise InputError(f"the record cannot be written as JSON ({exc}){deep}") from None
        if max_bytes and (len(value) > max_bytes or len(changes) > max_bytes):
            big, topic = max((len(value), streams.sow), (len(changes), streams.diff))
            _too_large(t, topic, big, max_bytes)
        # The `.sow` record carries the instant of the change, so a store restored from it knows
        # when each record last changed (a rerouted delete keeps what changed after it).
        out.change(streams.sow, streams.diff, p, key, value, changes, headers, after.updated_at)
        return
    assert t.before is not None
    render_removal(t.op, key, t.before, t.seq, t.at_ms, p, codec, streams, out)


def render_removal(op: Op, key: bytes, before: SowRecord, seq: int, at_ms: int, p: int, codec: Codec, streams: Streams, out: Sink) -> None:
    """The messages of a delete, expire or evict of `before` (what `render` sends for a removal,
    without a Transition: the expiry sweep's path)."""
    headers = [(_KEY, key), _EXPIRE_OP if op is _EXPIRE else _EVICT_OP if op is _EVICT else _DELETE_OP, (_SEQ, b"%d" % seq)]
    expires_at = before.expires_at
    if expires_at is not None:
        headers.append((_EXPIRES_AT, b"%d" % expires_at))
    if op is _EXPIRE:
        headers.append((_ACTUAL_EXPIRY, b"%d" % at_ms))
    last = before.json
    if last is None:
        last = orjson.dumps(before.data)
    side = (streams.expired or streams.dead) if op is _EXPIRE else streams.dead if op is _EVICT else None
    if side is None or codec.name == "json":
        out.change(streams.sow, streams.diff, p, key, None, last, headers, 0, side, None if side is None else [*headers, streams.origin])
        return
    # `.diff` carries JSON whatever the message type; `EXP.` and `.dead` the record as it was.
    out.change(streams.sow, streams.diff, p, key, None, last, headers)
    out.send(side, p, key, codec.encode(before.data), [*headers, streams.origin])


def _too_large(t: Transition, topic: str, size: int, max_bytes: int) -> None:
    raise InputError(f"the {t.op.value} of {t.key} would put {size} bytes on {topic}, over the limit of "
                     f"{max_bytes} (KSOW_MAX_RECORD_BYTES, lower when an output topic's max.message.bytes is); the SOW keeps the record as it was")


def source_headers(msg: InputMessage, streams: Streams) -> list[tuple[str, bytes]]:
    """The headers that take where an input was first (topic, partition, offset, Kafka key) along
    when it is rerouted through `.repartition`, so its `.errors` record points at the publisher's
    message. A rerouted input keeps those it came with (only one read from `.repartition`: on an
    input topic they are a publisher's, and say nothing)."""
    found = [(k, v) for k, v in (msg.headers or ()) if k == H.SOURCE or k == H.SOURCE_KEY] if msg.topic == streams.repartition else []
    if found:
        return found
    headers = [(H.SOURCE, b"%s:%d:%d" % (msg.topic.encode(), msg.partition, msg.offset))]
    return headers if msg.key is None else headers + [(H.SOURCE_KEY, msg.key)]


def rejected(msg: InputMessage, reason: str, streams: Streams) -> Output:
    """The `.errors` record of an input that could not be applied: its original bytes, key and place
    (before any rerouting) and the reason, in the partition it was read from (so it belongs to the
    same owner's transactions). The internal headers of an input topic's message are a publisher's:
    left out, never taken for its place."""
    topic, partition, offset, key = msg.topic.encode(), b"%d" % msg.partition, b"%d" % msg.offset, msg.key
    rerouted = msg.topic == streams.repartition
    headers = []
    for k, v in msg.headers or ():
        if rerouted and k == H.SOURCE and isinstance(v, bytes) and v.count(b":") >= 2:
            topic, partition, offset = v.rsplit(b":", 2)
            key = next((v for k, v in msg.headers if k == H.SOURCE_KEY), None)
        elif k not in H.INTERNAL:
            headers.append((k, v))
    headers += [(H.ERROR, reason.encode()), (H.ERROR_TOPIC, topic), (H.ERROR_PARTITION, partition), (H.ERROR_OFFSET, offset)]
    return Output(streams.errors, msg.partition, key, msg.value, headers)
