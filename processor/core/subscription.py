"""What one subscriber sees of a change: filters, focus (oof), deltas, select lists, empties.

Pure and shared by the client's subscriptions and the workers' server-side views. Input is a change
as the SOW saw it (the record before, the record after, the op); output is zero or one event dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from processor.contract.types import Op
from processor.core.merge import diff, has_data_changes, merge
from processor.core.paths import project, project_changes, split_path, within

Predicate = Callable[[dict], bool]
_INSERT = Op.INSERT.value


def _match_all(record: dict) -> bool:
    return True


@dataclass
class SubscriptionSpec:
    filter: Predicate = _match_all
    delta: bool = False
    oof: bool = False
    no_empties: bool = False
    no_sowkey: bool = False
    select: tuple[str, ...] = ()
    key_paths: tuple[tuple[str, ...], ...] = ()
    keys: frozenset[str] | None = None  # SowKeys the subscription is limited to (None: every record)
    _select_split: list = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        paths = [split_path(p) for p in self.select]
        # A path inside another selected one adds nothing, and would undo the removal that one tells.
        self._select_split = [p for p in paths if not within(p, [q for q in paths if len(q) < len(p)])]

    def matches(self, record: dict | None) -> bool:
        return record is not None and bool(self.filter(record))

    def shape(self, record: dict, keep_keys: bool = True) -> dict:
        """Apply the select list (key fields kept, as send_keys does by default)."""
        if not self._select_split:
            return record
        paths = (list(self.key_paths) if keep_keys else []) + self._select_split
        return project(record, paths)

    def shape_delta(self, changes: dict, before: dict) -> dict:
        """Apply the select list to a diff: a selected field the change took away comes as null."""
        if not self._select_split:
            return changes
        return project_changes(changes, before, list(self.key_paths) + self._select_split)

    def event(self, op: str, key: str, seq: int | None, record: dict, expires_at: int | None = None, **extra: Any) -> dict:
        out: dict = {"op": op}
        if not self.no_sowkey:
            out["sow_key"] = key
        if seq is not None:
            out["seq"] = seq
        if expires_at is not None:
            out["expires_at"] = expires_at
        out.update(extra)
        out["record"] = record
        return out

    def snapshot(self, key: str, seq: int | None, record: dict, expires_at: int | None = None) -> dict | None:
        """The event for one record of the initial SOW snapshot, or None if it is filtered out."""
        if (self.keys is not None and key not in self.keys) or not self.matches(record):
            return None
        return self.event("sow", key, seq, self.shape(record), expires_at)

    def resumed(self, op: Op, key: str, seq: int | None, record: dict | None, expires_at: int | None = None,
                before: dict | None = None) -> dict | None:
        """The event for a record's last change after a resume's bookmark: its current version
        whole, as op "sow" (as in a snapshot: it replaces what the subscriber holds, whether it had
        the record or not, and a delta subscriber tells it from the live deltas after it); a removal,
        with no record (with no_sowkey, the key fields of `before`, the version removed, say which
        record went; without them the SowKey does); with oof, an oof for one that does not match now
        (it may have left meanwhile)."""
        if self.keys is not None and key not in self.keys:
            return None
        if record is None:
            if not self.no_sowkey:
                return self.event(op.value, key, seq, None)
            if before is not None and self.key_paths:
                return self.event(op.value, key, seq, project(before, list(self.key_paths)))
            return {**self.event(op.value, key, seq, None), "sow_key": key}
        if self.matches(record):
            return self.event("sow", key, seq, self.shape(record), expires_at)
        if self.oof:
            return self.event(Op.OOF.value, key, seq, self.shape(record), expires_at, reason="no_match")
        return None

    def change(self, op: Op, key: str, seq: int | None, before: dict | None, after: dict | None, expires_at: int | None = None) -> dict | None:
        """The event for one change of the SOW, or None when this subscriber gets nothing."""
        if self.keys is not None and key not in self.keys:
            return None
        was, now = self.matches(before), self.matches(after)
        if now:
            assert after is not None
            if not self.delta or before is None or (not was and self.oof):
                # A record new to this subscriber is an insert to it, whatever it was to the SOW.
                return self.event(op.value if was else _INSERT, key, seq, self.shape(after), expires_at)
            shaped = self.shape_delta(diff(before, after, self.key_paths), before)
            if self.no_empties and not has_data_changes(shaped, self.key_paths):
                return None
            return self.event(op.value, key, seq, shaped, expires_at)
        if was and self.oof:
            assert before is not None
            reason = op.value if op.removes else "no_match"
            last = after if after is not None else before
            return self.event(Op.OOF.value, key, seq, self.shape(last), expires_at, reason=reason)
        return None


def conflate(pending: dict | None, delta: dict) -> dict:
    """Merge a delta into the one waiting for the end of a conflation interval."""
    return delta if pending is None else merge(pending, delta)


_GONE = ("oof", "delete", "expire", "evict")


def _replaces_whole(pending: dict, delta: dict) -> bool:
    """Whether merging `delta` into the held delta `pending` would put an object where `pending`
    has something else: the merged delta would merge that object into the subscriber's copy, where
    the events one by one set it whole (after the removal or the value `pending` told)."""
    for name, value in delta.items():
        if isinstance(value, dict) and name in pending:
            old = pending[name]
            if not isinstance(old, dict) or _replaces_whole(old, value):
                return True
    return False


def conflate_event(pending: dict | None, event: dict, delta: bool) -> tuple[dict | None, dict | None]:
    """A conflation interval's events for one record, after `event` came: (the event to send now,
    the one to hold until the interval ends), either None.

    What is held takes the subscriber from where it was when the interval began to where the record
    is: deltas merge; a full record, or anything else, replaces what was waiting (the record as it
    is then, not a merge of its versions: a field a publish removed stays removed); an insert (a
    whole record new to the subscriber) replaces what was held, and stays an insert through the
    updates after it. A record that came in and left within the interval is never told (the
    subscriber never had it). One that left and came back cannot be told in one event: the leave
    goes at once, and its return is held."""
    if pending is None:
        return None, event
    held, op = pending["op"], event["op"]
    if op in _GONE:
        return None, (None if held == _INSERT else event)
    if held in _GONE:
        return pending, event
    if op == _INSERT:
        return None, event
    if delta and held != _INSERT and _replaces_whole(pending["record"], event["record"]):
        # An object where the held delta leaves a removal (null), a number, a string or an array:
        # the subscriber merges a delta's object into the one it holds, which may have more
        # fields than this one, so no single delta can tell it. The held one goes at once.
        return pending, event
    merged = dict(event)
    if delta:
        merged["record"] = conflate(pending["record"], event["record"])
    if held == _INSERT:
        merged["op"] = _INSERT
    return None, merged
