"""SOW keys: which record a message updates, and which partition owns that record.

A SowKey is opaque to users. For topics with key paths it is a 64-bit checksum over the key domain
and the *text* of each key field value, as AMPS makes it (same domain + texts => same key, whatever
the field order in the message), so `{"id": 5}` and `{"id": "5"}` are one record. The text of a
value (`key_text`):
- a string: itself, exactly (no trimming, no case folding);
- an integer: its decimal digits (`-` for negatives);
- a floating-point number with an integral value below 2**53 in magnitude: the same as that
  integer (`5.0` -> `5`: JSON does not tell 5 from 5.0, nor do ksow filters);
- any other floating-point number: the shortest decimal that reads back as the same number,
  Python's `repr` (`0.1` -> `0.1`, `1.5e-05`, `1e+22`);
- a boolean: `true` or `false`;
- Avro logical types (timestamps, dates, UUIDs): their JSON text (ISO-8601, the UUID's hex form).
Null (or a missing field), objects and arrays are not key values: such a message is rejected.

Topics without key paths take the publisher's `sow-key` header as the SowKey.

KEY_FORMAT numbers this rule. Version 1 (before it) checksummed the values' JSON, types included
(5 and "5" were two records); a store written by it is detected by `processor.state.keyformat`.
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Iterable

import orjson

from processor.core.paths import MISSING, get_path, split_path

SowKey = str

_BASE64_CHARS = re.compile(r"[A-Za-z0-9+/=_-]+")  # fullmatch: "$" would let a final newline through


class KeyError_(ValueError):
    """A message whose SowKey cannot be determined (missing key field, bad sow-key header)."""


@dataclass(frozen=True)
class KeySpec:
    """How a topic's SowKeys are made: key paths (content keys) or publisher-supplied keys."""

    domain: str
    paths: tuple[str, ...] = ()

    @cached_property
    def split(self) -> tuple[tuple[str, ...], ...]:
        return tuple(split_path(p) for p in self.paths)

    @property
    def user_keys(self) -> bool:
        """True when publishers supply the SowKey in the `sow-key` header."""
        return not self.paths

    @cached_property
    def _fields(self) -> tuple[tuple[str, str | None, tuple[str, ...]], ...]:
        """(path, top-level field name or None, parts): a one-part path is a plain dict lookup."""
        return tuple((path, parts[0] if len(parts) == 1 else None, parts) for path, parts in zip(self.paths, self.split))

    def key_values(self, record: dict) -> list[Any]:
        values = []
        for path, field, parts in self._fields:
            value = record.get(field, MISSING) if field is not None else get_path(record, parts)
            if value is MISSING:
                raise KeyError_(f"missing key field {path}")
            if value is None:
                raise KeyError_(f"key field {path} is null")
            if isinstance(value, (dict, list)):
                raise KeyError_(f"key field {path} must be a scalar, got {type(value).__name__}")
            values.append(value)
        return values

    @cached_property
    def _single_field(self) -> str | None:
        """The field name when the key is one top-level field (the common case), else None."""
        return self.split[0][0] if len(self.split) == 1 and len(self.split[0]) == 1 else None

    @cached_property
    def _recent(self) -> dict:
        """SowKeys of recent one-field key values of exact type str or int (whose texts are the
        values themselves: 5 and "5" share a key, and True or 5.0 never land here)."""
        return {}

    def sow_key(self, record: dict | None, header_key: str | None = None) -> SowKey:
        """The SowKey of a message: from its key fields, or from the publisher's `sow-key`."""
        field = self._single_field
        if field is not None and type(record) is dict:  # the hot path of every input
            value = record.get(field)
            kind = type(value)
            if kind is str or kind is int:
                recent = self._recent
                key = recent.get(value)
                if key is None:
                    if len(recent) >= _RECENT_KEYS:
                        recent.clear()
                    key = recent[value] = checksum_key(self.domain, [value])
                return key
        if self.user_keys:
            if not header_key:
                said = "an empty sow-key header" if header_key == "" else "no sow-key header"
                raise KeyError_(f"topic has no key fields: the publisher must send a SowKey in sow-key, and sent {said}")
            return validate_user_key(header_key)
        if record is None:
            raise KeyError_("no record to compute the SowKey from")
        return checksum_key(self.domain, self.key_values(record))


_RECENT_KEYS = 1 << 17  # one-field key values remembered per topic (cleared whole past that)
KEY_FORMAT = 2  # the SowKey rule of this module (see the module docstring)
_EXACT_INT = 2**53  # floats below this magnitude hold every integer exactly


def key_text(value: Any) -> str:
    """The text of one key value (see the module docstring); KeyError_ for what cannot be one."""
    kind = type(value)
    if kind is str:
        return value
    if kind is bool:
        return "true" if value else "false"
    if kind is int:
        return str(value)
    if kind is float:
        if value.is_integer() and abs(value) < _EXACT_INT:
            return str(int(value))
        return repr(value)
    try:
        text = orjson.loads(orjson.dumps(value))
    except TypeError:
        text = None
    if type(text) is not str:
        raise KeyError_(f"a key value must be text, a number or a boolean, got {kind.__name__}")
    return text


def checksum_key(domain: str, values: list[Any]) -> SowKey:
    """64-bit checksum over the domain and the values' texts. The texts go in as a JSON array: it
    delimits each text, and it never holds a raw 0x1f, the byte that ends the domain. A key of
    string values is the same as under key format 1."""
    return _checksum(domain, tuple([key_text(v) for v in values]))


@lru_cache(maxsize=1 << 16)
def _checksum(domain: str, texts: tuple[str, ...]) -> SowKey:
    """Keys repeat (updates of the same records): recent ones are remembered, by their texts."""
    payload = domain.encode() + b"\x1f" + orjson.dumps(texts)
    return str(int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "big"))


MAX_USER_KEY_CHARS = 1024  # a publisher's own SowKey goes on each of its outputs twice (Kafka key and sow-key header)
# The same rule for Spark's regexp_like (Java regex, "find"): anchored at both ends, "\z" as Java's
# "$" too would let a final newline through.
USER_KEY_JAVA_REGEX = rf"^[A-Za-z0-9+/=_-]{{1,{MAX_USER_KEY_CHARS}}}\z"


def validate_user_key(key: str) -> SowKey:
    """A SowKey a publisher gave (sow-key, sow-keys): Base64 text, at most MAX_USER_KEY_CHARS long
    (a longer one would make outputs the broker refuses, and stall the batch that holds them)."""
    if len(key) > MAX_USER_KEY_CHARS:
        raise KeyError_(f"sow-key of {len(key)} characters is longer than {MAX_USER_KEY_CHARS}: {key[:40]!r}...")
    if not _BASE64_CHARS.fullmatch(key):
        shown = repr(key) if len(key) <= 80 else f"{key[:40]!r}..."
        raise KeyError_(f"sow-key {shown} must use only Base64 characters")
    return key


def validate_user_keys(keys: Iterable[str]) -> list[SowKey]:
    """SowKeys a caller gave (a delete's or a query's keys); KeyError_ names the first bad one."""
    return [validate_user_key(key) for key in keys]


_WORDS = [struct.Struct(f"<{n}I") for n in range(64)]  # little-endian 32-bit words of short keys


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (as in the Java client's default partitioner), as a signed 32-bit int.
    Every new SowKey pays for it, so the words are read by struct, not byte by byte (half the time)."""
    length = len(data)
    m = 0x5BD1E995
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    words = length >> 2
    if words:
        for k in (_WORDS[words] if words < 64 else struct.Struct(f"<{words}I")).unpack_from(data):
            k = (k * m) & 0xFFFFFFFF
            k ^= k >> 24
            h = ((h * m) & 0xFFFFFFFF) ^ ((k * m) & 0xFFFFFFFF)
    extra = length & 3
    if extra:
        tail = words << 2
        if extra >= 3:
            h ^= data[tail + 2] << 16
        if extra >= 2:
            h ^= data[tail + 1] << 8
        h ^= data[tail]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def owner_partition(sow_key: SowKey, partitions: int) -> int:
    """The partition that owns a SowKey: what Kafka's default partitioner picks for that message key,
    so a publisher that keys its messages by SowKey never needs repartitioning."""
    return (murmur2(sow_key.encode()) & 0x7FFFFFFF) % partitions
