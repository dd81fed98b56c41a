"""What one command does to one record: the transition from the record before to the record after.

Pure. The partition engine (processor.engine.partition) is the only caller that applies these to
state, and processor.engine.outputs renders transitions as messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from processor.contract.types import Command, Op, SowCommand, SowRecord
from processor.core.expiry import ExpiryPolicy
from processor.core.merge import diff, merge

_DELTA_PUBLISH, _INSERT, _UPDATE = Command.DELTA_PUBLISH, Op.INSERT, Op.UPDATE  # globals: a member looked up on its Enum class costs ~8x more


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
    if command.command is _DELTA_PUBLISH and before is not None:
        data = merge(before.data, command.data)
    else:
        data = command.data if command.whole is None else command.whole
    after = SowRecord(data, seq, policy.expires_at(now_ms, command.expiration_ms), now_ms)
    changes = diff(before.data if before else None, data, key_paths)
    return Transition(_UPDATE if before is not None else _INSERT, key, seq, before, after, changes, now_ms)


def removal(op: Op, key: str, before: SowRecord, now_ms: int, seq: int) -> Transition:
    """A delete, expire or evict of an existing record."""
    return Transition(op, key, seq, before, None, None, now_ms)
