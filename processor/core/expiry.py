"""Expiry maths: a record's lifetime from the topic policy, the publisher's header and the clamps.

AMPS rules: a per-message lifetime overrides the topic default; `0` on a message means "never".
Artemis clamps (`min_expiration`/`max_expiration`) bound any lifetime; a record left with no
lifetime gets `max_expiration`, else `min_expiration`, when those are set.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ExpirationMode(str, Enum):
    DISABLED = "disabled"  # instants are stored with records but never acted on
    ENABLED = "enabled"  # only records carrying a per-message lifetime expire
    DEFAULT = "default"  # every record gets the topic's default lifetime


@dataclass(frozen=True)
class ExpiryPolicy:
    mode: ExpirationMode = ExpirationMode.DISABLED
    default_ms: int | None = None
    min_ms: int | None = None
    max_ms: int | None = None

    @property
    def active(self) -> bool:
        """Whether the workers remove records whose instant has passed."""
        return self.mode is not ExpirationMode.DISABLED

    def lifetime_ms(self, message_ms: int | None) -> int | None:
        """The lifetime of a record just published; None means it never expires."""
        if message_ms is not None:
            lifetime = message_ms or None  # 0 = never expires
        elif self.mode is ExpirationMode.DEFAULT:
            lifetime = self.default_ms
        else:
            lifetime = None
        if lifetime is None:
            return self.max_ms if self.max_ms is not None else self.min_ms
        if self.max_ms is not None and lifetime > self.max_ms:
            return self.max_ms
        if self.min_ms is not None and lifetime < self.min_ms:
            return self.min_ms
        return lifetime

    def expires_at(self, now_ms: int, message_ms: int | None) -> int | None:
        """Epoch ms at which a record applied at `now_ms` expires (every update starts anew)."""
        lifetime = self.lifetime_ms(message_ms)
        return None if lifetime is None else now_ms + lifetime


def is_due(expires_at: int | None, now_ms: int) -> bool:
    return expires_at is not None and expires_at <= now_ms
