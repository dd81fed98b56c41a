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
    if not key:
        raise MalformedSowMessage("no key (a SowKey is required)")
    try:
        sow_key = key.decode()
    except UnicodeDecodeError:
        raise MalformedSowMessage("key is not UTF-8") from None
    if type(headers) is UnreadableHeaders:
        raise MalformedSowMessage(UnreadableHeaders.REASON)
    found = {name: raw for name, raw in headers or () if name in (H.OP, H.SEQ, H.EXPIRES_AT)}
    op_text = _text(found, H.OP)
    if op_text is None:
        op = Op.DELETE if value is None else Op.UPDATE
    else:
        try:
            op = Op(op_text)
        except ValueError:
            raise MalformedSowMessage(f"unknown {H.OP} {op_text[:40]!r}") from None
    seq = _integer(found, H.SEQ)
    expires_at = _integer(found, H.EXPIRES_AT)
    if value is None:
        return SowMessage(op, sow_key, seq, expires_at, None)
    try:
        record = codec.decode(value)
    except InputError as exc:
        raise MalformedSowMessage(str(exc)) from None
    return SowMessage(op, sow_key, seq, expires_at, record)


def _text(found: dict, name: str) -> str | None:
    raw = found.get(name)
    if raw is None:
        return None
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise MalformedSowMessage(f"header {name} is not ASCII") from None


def _integer(found: dict, name: str) -> int | None:
    """A decimal signed 64-bit integer header (ASCII digits, so no huge-number parsing)."""
    text = _text(found, name)
    if text is None:
        return None
    digits = text[1:] if text.startswith("-") else text
    number = int(text) if 0 < len(digits) <= 19 and digits.isdigit() else None
    if number is None or number not in _INT64:
        raise MalformedSowMessage(f"header {name} is not a 64-bit integer: {text[:40]!r}")
    return number
