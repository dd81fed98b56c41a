"""What one command does to one record, and the events that tell the world.

Pure: given the record before (or None) and a command, return the transition; render it as
output events. The Faust worker, the Spark pipeline and the tests all call these functions, so
the engines cannot disagree on semantics.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from processor.contract.types import Command, Op, OutputEvent, SowCommand, SowRecord
from processor.core.codec import Codec
from processor.contract import headers as H
from processor.core.expiry import ExpiryPolicy
from processor.core.merge import diff, merge


@dataclass(slots=True)
class Transition:
    op: Op
    key: str
    seq: int  # the event ID of this change
    before: SowRecord | None
    after: SowRecord | None  # None when the record left the SOW
    changes: dict | None = None  # the diff, for insert and update
    at_ms: int = 0  # when it happened (the actual expiry, for expire)


def apply_write(
    key: str,
    before: SowRecord | None,
    command: SowCommand,
    policy: ExpiryPolicy,
    key_paths: tuple[tuple[str, ...], ...],
    now_ms: int,
    seq: int,
) -> Transition:
    """A publish or delta publish: merge, diff, and a fresh lifetime (every update starts anew)."""
    assert command.data is not None
    if command.command is Command.DELTA_PUBLISH and before is not None:
        data = merge(before.data, command.data)
    else:
        data = command.data
    after = SowRecord(data, seq, policy.expires_at(now_ms, command.expiration_ms), now_ms)
    changes = diff(before.data if before else None, data, key_paths)
    return Transition(Op.UPDATE if before else Op.INSERT, key, seq, before, after, changes, now_ms)


def removal(op: Op, key: str, before: SowRecord, now_ms: int, seq: int) -> Transition:
    """A delete, expire or evict of an existing record."""
    assert op.removes
    return Transition(op, key, seq, before, None, None, now_ms)


_OP_BYTES = {op: op.value.encode() for op in Op}


def _headers(t: Transition, key: bytes, record: SowRecord | None) -> list[tuple[str, bytes]]:
    headers = [(H.KEY, key), (H.OP, _OP_BYTES[t.op]), (H.SEQ, b"%d" % t.seq)]
    if record is not None and record.expires_at is not None:
        headers.append((H.EXPIRES_AT, b"%d" % record.expires_at))
    if t.op is Op.EXPIRE:
        headers.append((H.ACTUAL_EXPIRY, b"%d" % t.at_ms))
    return headers


def render(t: Transition, codec: Codec, has_expiry_topic: bool = True) -> list[OutputEvent]:
    """Output events of a transition, by stream: sow, diff, expired, dead (see the contract)."""
    key = t.key.encode()
    if t.after is not None:
        headers = _headers(t, key, t.after)
        return [
            OutputEvent("sow", key, codec.encode(t.after.data), headers),
            OutputEvent("diff", key, orjson.dumps(t.changes), headers),
        ]
    assert t.before is not None
    headers = _headers(t, key, t.before)
    last = codec.encode(t.before.data)
    events = [OutputEvent("sow", key, None, headers), OutputEvent("diff", key, last, headers)]
    if t.op is Op.EXPIRE:
        events.append(OutputEvent("expired" if has_expiry_topic else "dead", key, last, headers))
    elif t.op is Op.EVICT:
        events.append(OutputEvent("dead", key, last, headers))
    return events
