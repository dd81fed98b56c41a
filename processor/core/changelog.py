"""Reading one `<topic>.sow` message back: key, headers and value, checked.

`<topic>.sow` is written by the workers, but it is a plain Kafka topic: anything with write access
can put a record there. Readers (restore, subscriptions, the client's query fallback) therefore
parse each message here and skip the ones that do not parse (MalformedSowMessage says why)
instead of failing on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from processor.contract import headers as H
from processor.contract.errors import InputError
from processor.contract.types import Op, UnreadableHeaders
from processor.core.codec import Codec

_INT64 = range(-(2**63), 2**63)
_TOP = 2**63


class MalformedSowMessage(InputError):
    """A `<topic>.sow` message that does not parse; its message says what is wrong."""


@dataclass(frozen=True, slots=True)
class SowMessage:
    op: Op
    key: str
    seq: int | None
    expires_at: int | None  # epoch ms
    record: dict | None  # None: a tombstone, the record left the SOW


def parse_sow_message(codec: Codec, key: bytes | None, value: bytes | None, headers: Iterable[tuple[str, bytes | None]] | None) -> SowMessage:
    """The change one `<topic>.sow` message carries; raises MalformedSowMessage."""
    return SowMessage(*sow_change(codec, key, value, headers))


_OPS = {op.value.encode(): op for op in Op}


def sow_change(codec: Codec, key: bytes | None, value: bytes | None,
               headers: Iterable[tuple[str, bytes | None]] | None) -> tuple[Op, str, int | None, int | None, dict | None]:
    """`parse_sow_message`'s fields as a tuple (op, key, seq, expires_at, record): what a restore
    reads for each of millions of messages, without an object each. Raises MalformedSowMessage."""
    if not key:
        raise MalformedSowMessage("no key (a SowKey is required)")
    try:
        sow_key = key.decode()
    except UnicodeDecodeError:
        raise MalformedSowMessage("key is not UTF-8") from None
    if type(headers) is UnreadableHeaders:
        raise MalformedSowMessage(UnreadableHeaders.REASON)
    op_raw = seq_raw = expires_raw = None
    for name, raw in headers or ():  # the last of a name counts
        if name == _OP:
            op_raw = raw
        elif name == _SEQ:
            seq_raw = raw
        elif name == _EXPIRES_AT:
            expires_raw = raw
    if op_raw is None:
        op = Op.DELETE if value is None else Op.UPDATE
    else:
        op = _OPS.get(op_raw) or _op(op_raw)
    seq = _integer(_SEQ, seq_raw)
    expires_at = _integer(_EXPIRES_AT, expires_raw)
    if value is None:
        return op, sow_key, seq, expires_at, None
    try:
        record = codec.decode(value)
    except InputError as exc:
        raise MalformedSowMessage(str(exc)) from None
    return op, sow_key, seq, expires_at, record


_OP, _SEQ, _EXPIRES_AT = H.OP, H.SEQ, H.EXPIRES_AT


def _op(raw: bytes) -> Op:
    """The op of a header value that is none of `_OPS`' (only a malformed one is not)."""
    text = _text(_OP, raw)
    try:
        return Op(text)
    except ValueError:
        raise MalformedSowMessage(f"unknown {H.OP} {text[:40]!r}") from None


def _text(name: str, raw: bytes) -> str:
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise MalformedSowMessage(f"header {name} is not ASCII") from None


def _integer(name: str, raw: bytes | None) -> int | None:
    """A decimal signed 64-bit integer header (ASCII digits, so no huge-number parsing)."""
    if raw is None:
        return None
    if 0 < len(raw) <= 19 and raw.isdigit() and (number := int(raw)) < _TOP:  # the common case
        return number
    text = _text(name, raw)
    digits = text[1:] if text.startswith("-") else text
    number = int(text) if 0 < len(digits) <= 19 and digits.isdigit() else None
    if number is None or number not in _INT64:
        raise MalformedSowMessage(f"header {name} is not a 64-bit integer: {text[:40]!r}")
    return number
