"""SOW keys: which record a message updates, and which partition owns that record.

A SowKey is opaque to users. For topics with key paths it is a 64-bit checksum over the key domain
and the key field values (same domain + fields + values => same key, whatever the field order in
the message). Topics without key paths take the publisher's `sow-key` header as the SowKey.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import orjson

from processor.core.paths import MISSING, get_path, split_path

SowKey = str

_BASE64_CHARS = re.compile(r"^[A-Za-z0-9+/=_-]+$")


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

    def key_values(self, record: dict) -> list[Any]:
        values = []
        for path, parts in zip(self.paths, self.split):
            value = get_path(record, parts)
            if value is MISSING or value is None:
                raise KeyError_(f"missing key field {path}")
            if isinstance(value, (dict, list)):
                raise KeyError_(f"key field {path} must be a scalar, got {type(value).__name__}")
            values.append(value)
        return values

    def sow_key(self, record: dict | None, header_key: str | None = None) -> SowKey:
        """The SowKey of a message: from its key fields, or from the publisher's `sow-key`."""
        if self.user_keys:
            if not header_key:
                raise KeyError_("topic has no key fields: publisher must send a sow-key header")
            return validate_user_key(header_key)
        if record is None:
            raise KeyError_("no record to compute the SowKey from")
        return checksum_key(self.domain, self.key_values(record))


def checksum_key(domain: str, values: list[Any]) -> SowKey:
    """Checksum over domain + values with a separator no JSON text contains raw (0x1f)."""
    payload = domain.encode() + b"\x1f" + orjson.dumps(values)
    return str(int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "big"))


def validate_user_key(key: str) -> SowKey:
    if not _BASE64_CHARS.match(key):
        raise KeyError_(f"sow-key {key!r} must use only Base64 characters")
    return key


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (as in the Java client's default partitioner), as a signed 32-bit int."""
    length = len(data)
    seed = 0x9747B28C
    m = 0x5BD1E995
    r = 24
    h = (seed ^ length) & 0xFFFFFFFF
    length4 = length // 4
    for i in range(length4):
        i4 = i * 4
        k = (data[i4] & 0xFF) + ((data[i4 + 1] & 0xFF) << 8) + ((data[i4 + 2] & 0xFF) << 16) + ((data[i4 + 3] & 0xFF) << 24)
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    extra = length % 4
    tail = length4 * 4
    if extra >= 3:
        h ^= (data[tail + 2] & 0xFF) << 16
    if extra >= 2:
        h ^= (data[tail + 1] & 0xFF) << 8
    if extra >= 1:
        h ^= data[tail] & 0xFF
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def owner_partition(sow_key: SowKey, partitions: int) -> int:
    """The partition that owns a SowKey: what Kafka's default partitioner picks for that message key,
    so a publisher that keys its messages by SowKey never needs repartitioning."""
    return (murmur2(sow_key.encode()) & 0x7FFFFFFF) % partitions
