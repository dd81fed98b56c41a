"""Server-side views: `<view>.sow` and `<view>.diff` kept by the workers from a SOW topic's changes.

A view is a standing subscription (filter, select list, options, conflation) whose output is two
Kafka topics, so its consumers need no ksow code. `<view>.sow` is compacted: the selected record
while it is in focus, a tombstone when it leaves (sow-op oof or the removal). `<view>.diff` carries
what a delta subscriber with the view's options would get, including OOF events (sow-op oof, header
sow-oof-reason). Conflation applies to `<view>.diff`: deltas of a record within the interval are
merged into one event, sent when the interval ends.

Exactly-once: a held event is also written to the compacted `<topic>.holds` topic in the batch's
transaction (a tombstone when it is released), and a worker that takes the partition reads the holds
back, so no conflated event is lost or sent twice across a crash or a rebalance.

A view added to a topic that already has records, or whose filter, select list or options changed,
is seeded: each partition writes its records to `<view>.sow` as the view now sees them (`seed`).
Which definitions a partition's `<view>.sow` follows travels with the group's committed input
offsets, as their metadata (`views_mark`), so it moves with the partition and survives a lost disk.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable

import orjson

from processor.contract.types import Op, Output, SowRecord
from processor.contract import headers as H
from processor.core.durations import parse_duration_ms
from processor.core.filters import compile_filter
from processor.core.subscription import SubscriptionSpec, conflate_event
from processor.core.sow import Transition
from processor.topology import MAX_VIEWS_PER_TOPIC, SowTopic, View

_INSERT = Op.INSERT.value.encode()
_OOF = Op.OOF.value.encode()
log = logging.getLogger("ksow.views")


@dataclass
class _Pending:
    due: int
    event: dict
    headers: list


@dataclass
class ViewProcessor:
    """One view of a SOW topic: a `ChangeListener` of its partitions."""

    view: View
    spec: SowTopic
    number: int = 0  # the view's index among its topic's views (keys its holds)
    sub: SubscriptionSpec = field(init=False)
    conflation_ms: int = field(init=False)
    pending: dict[int, dict[str, _Pending]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        options = set(self.view.options)
        self.sub = SubscriptionSpec(
            filter=compile_filter(self.view.filter).matches,
            delta=True,
            oof="oof" in options,
            no_empties="no_empties" in options,
            no_sowkey="no_sowkey" in options,
            select=tuple(self.view.select),
            key_paths=self.spec.key_spec.split,
        )
        self.conflation_ms = parse_duration_ms(self.view.conflation) if self.view.conflation else 0
        self._prefix = f"{self.number}|"
        self.token = _digest(repr((self.view.name, self.view.filter, tuple(self.view.select), sorted(self.view.options))))

    @property
    def sow_topic(self) -> str:
        return f"{self.view.name}.sow"

    @property
    def diff_topic(self) -> str:
        return f"{self.view.name}.diff"

    def on_change(self, p: int, t: Transition, out: list) -> None:
        """The view's messages for one transition of the SOW topic."""
        before = t.before.data if t.before else None
        after = t.after.data if t.after else None
        record = t.after or t.before
        expires = record.expires_at if record else None
        key = t.key.encode()
        was, now_in = self.sub.matches(before), self.sub.matches(after)
        base = self._headers(key, t.seq, expires)
        if t.op is Op.EXPIRE:  # as on the SOW topic's own expire events
            base.append((H.ACTUAL_EXPIRY, b"%d" % t.at_ms))
        if now_in:  # a record new to the view is an insert to it, whatever it was to the SOW
            op_name = t.op.value.encode() if was else _INSERT
            out.append(Output(self.sow_topic, p, key, orjson.dumps(self.sub.shape(after)), base + [(H.OP, op_name)]))
        elif was:
            op = t.op if t.op.removes else Op.OOF
            out.append(Output(self.sow_topic, p, key, None, base + [(H.OP, op.value.encode())]))
        event = self.sub.change(t.op, t.key, t.seq, before, after, expires)
        if event is None:
            return
        headers = base + [(H.OP, event["op"].encode())]
        if "reason" in event:
            headers.append((H.OOF_REASON, event["reason"].encode()))
        if self.conflation_ms:
            self._hold(p, t.key, event, headers, t.at_ms, out)
        else:
            out.append(Output(self.diff_topic, p, key, orjson.dumps(event["record"]), headers))

    def seed(self, p: int, records: Iterable[tuple[str, SowRecord]], tombstones: bool) -> list[Output]:
        """The `<view>.sow` messages that make partition p's records what the view now selects: an
        insert for each record it matches and, with `tombstones` (its `<view>.sow` partition holds
        messages: of another definition, or of the view before it was taken out of the topology), a
        tombstone for each it does not. Nothing on `<view>.diff`: no record changed."""
        out = []
        for key, record in records:
            data, kb = record.data, key.encode()
            headers = self._headers(kb, record.seq, record.expires_at)
            if self.sub.matches(data):
                out.append(Output(self.sow_topic, p, kb, orjson.dumps(self.sub.shape(data)), headers + [(H.OP, _INSERT)]))
            elif tombstones:
                out.append(Output(self.sow_topic, p, kb, None, headers + [(H.OP, _OOF)]))
        return out

    def _headers(self, key: bytes, seq: int, expires: int | None) -> list:
        """The headers of a view message about one record, but its sow-op."""
        headers = [(H.SEQ, b"%d" % seq)] if self.sub.no_sowkey else [(H.KEY, key), (H.SEQ, b"%d" % seq)]
        if expires is not None:
            headers.append((H.EXPIRES_AT, b"%d" % expires))
        return headers

    def _hold(self, p: int, key: str, event: dict, headers: list, now: int, out: list) -> None:
        waiting = self.pending.setdefault(p, {})
        held = waiting.get(key)
        if held is None:
            held = waiting[key] = _Pending(now + self.conflation_ms, event, headers)
        else:
            now_sent, merged = conflate_event(held.event, event, True)
            if now_sent is not None:  # it left and is back: its leave goes at once
                out.append(Output(self.diff_topic, p, key.encode(), orjson.dumps(now_sent["record"]), held.headers))
            if merged is None:  # in and out of the view within the interval: nothing to tell
                del waiting[key]
                out.append(Output(self.spec.holds_topic, p, (self._prefix + key).encode(), None, []))
                return
            if merged["op"] != event["op"]:
                headers = [(k, v) for k, v in headers if k != H.OP] + [(H.OP, merged["op"].encode())]
            held.event, held.headers = merged, headers
        value = orjson.dumps({"due": held.due, "event": held.event, "headers": [(k, v.decode()) for k, v in held.headers]})
        out.append(Output(self.spec.holds_topic, p, (self._prefix + key).encode(), value, []))

    def due(self, p: int, now: int, out: list) -> None:
        """Release the conflated events whose interval has ended (a handed-over partition's holds are
        read back by its new owner from `<topic>.holds`, so none is released early)."""
        waiting = self.pending.get(p)
        if not waiting:
            return
        for key in [k for k, held in waiting.items() if held.due <= now]:
            held = waiting.pop(key)
            out.append(Output(self.diff_topic, p, key.encode(), orjson.dumps(held.event["record"]), held.headers))
            out.append(Output(self.spec.holds_topic, p, (self._prefix + key).encode(), None, []))

    def restore_hold(self, p: int, key: bytes, value: bytes | None) -> None:
        """Take back one record of `<topic>.holds` (when a partition is assigned). `.holds` is a
        plain Kafka topic: a record that is not one `_hold` writes is skipped and logged, so that it
        cannot stop every worker that takes the partition."""
        try:
            text = key.decode() if key else ""
        except UnicodeDecodeError:
            text = ""
        if not text.startswith(self._prefix) or len(text) == len(self._prefix):
            return
        sow_key = text[len(self._prefix):]
        waiting = self.pending.setdefault(p, {})
        if value is None:
            waiting.pop(sow_key, None)
            return
        held = _held(value)
        if held is None:
            log.warning("skipped a record of %s (partition %d, key %r) that is not a held view event", self.spec.holds_topic, p, key[:100])
            return
        # `_hold` sets a due one interval after the change: one further out than that from now (a
        # forged or garbled record) would hold the record's events for ever, merging every later one.
        held.due = min(held.due, time.time_ns() // 1_000_000 + self.conflation_ms)
        waiting[sow_key] = held

    def forget(self, p: int) -> None:
        """Drop partition p's holds (it was handed over: its new owner reads them back)."""
        self.pending.pop(p, None)


def _held(value: bytes) -> _Pending | None:
    """The held event a `.holds` record carries (as `_hold` writes it), or None."""
    try:
        held = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(held, dict):
        return None
    due, event, headers = held.get("due"), held.get("event"), held.get("headers")
    if type(due) is not int or not isinstance(event, dict) or not isinstance(event.get("op"), str) or not isinstance(event.get("record"), dict):
        return None
    if not isinstance(headers, list) or not all(
        isinstance(h, list) and len(h) == 2 and isinstance(h[0], str) and isinstance(h[1], str) for h in headers
    ):
        return None
    try:  # released as it is: a record orjson cannot write (nested past its 254 levels) would fail every release
        orjson.dumps(event)
    except orjson.JSONEncodeError:
        return None
    return _Pending(due, event, [(k, v.encode()) for k, v in headers])


def views_of(spec: SowTopic, views: Iterable[View]) -> list[ViewProcessor]:
    return [ViewProcessor(view, spec, number) for number, view in enumerate(views)]


_MARK = "ksow-views:"  # how an offset's metadata that names view definitions begins
_TOKEN = 12  # hexadecimal characters a view takes in it (a digest of its name and definition)
assert len(_MARK) + MAX_VIEWS_PER_TOPIC * _TOKEN < 4096  # Kafka's default offset.metadata.max.bytes


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=_TOKEN // 2).hexdigest()


def views_mark(views: Iterable[ViewProcessor]) -> str:
    """The metadata of the committed offsets of a partition whose `<view>.sow` topics follow these
    views' definitions."""
    return _MARK + "".join(v.token for v in views)


def views_to_seed(views: Iterable[ViewProcessor], marks: Iterable[str | None]) -> tuple[list[ViewProcessor], bool]:
    """The views a partition may have to seed, given the metadata of its inputs' committed offsets:
    those not named as they are now by every input that carries a mark; and whether any input
    carries one. Inputs committed without one say nothing: none committed yet (the partition's
    records may all have come through other partitions' inputs), or committed by a release before
    views were seeded. With no mark at all, every view is returned, and what its topic holds must
    decide."""
    found = [m[len(_MARK):] for m in marks if m and m.startswith(_MARK)]
    tokens = [{m[i:i + _TOKEN] for i in range(0, len(m), _TOKEN)} for m in found]
    seeded = set.intersection(*tokens) if tokens else set()
    return [v for v in views if v.token not in seeded], bool(found)
