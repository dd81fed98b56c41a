"""Expiry maths: a record's lifetime from the topic policy and the publisher's header, and whether a
record may still be delivered.

AMPS rules: a per-message lifetime overrides the topic default; `0` on a message means "never".
Artemis rules for the clamps (`min_expiration`/`max_expiration`, its min/max-expiry-delay): they
bound the lifetimes of a topic that has *no* default lifetime. A topic default lifetime is Artemis's
expiry-delay, which overrides the min/max settings altogether: with one set, no lifetime is clamped,
neither the default nor a per-message one (Artemis leaves a message's own expiration unchanged when
expiry-delay is set).
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

    def __post_init__(self) -> None:
        if (self.mode is ExpirationMode.DEFAULT) != (self.default_ms is not None):
            raise ValueError("a default lifetime goes with mode DEFAULT, and only with it")
        for name in ("default_ms", "min_ms", "max_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        # The lifetime of a record published without a lifetime of its own: worked out once, as
        # every publish without a sow-expiration header asks for it.
        object.__setattr__(self, "_default_lifetime", self.lifetime_ms(None))

    @property
    def active(self) -> bool:
        """Whether the workers remove records whose instant has passed."""
        return self.mode is not ExpirationMode.DISABLED

    @property
    def clamped(self) -> bool:
        """Whether the clamps apply: set, and not overridden by a topic default lifetime."""
        return self.default_ms is None and (self.min_ms is not None or self.max_ms is not None)

    def lifetime_ms(self, message_ms: int | None) -> int | None:
        """The lifetime of a record just published; None means it never expires."""
        if message_ms is not None:
            lifetime = message_ms or None  # 0 = never expires
        else:
            lifetime = self.default_ms
        if not self.clamped:
            return lifetime
        if lifetime is None:
            return self.max_ms if self.max_ms is not None else self.min_ms
        if self.max_ms is not None and lifetime > self.max_ms:
            return self.max_ms
        if self.min_ms is not None and lifetime < self.min_ms:
            return self.min_ms
        return lifetime

    def expires_at(self, now_ms: int, message_ms: int | None) -> int | None:
        """Epoch ms at which a record applied at `now_ms` expires (every update starts anew)."""
        lifetime = self._default_lifetime if message_ms is None else self.lifetime_ms(message_ms)
        return None if lifetime is None else now_ms + lifetime

    def is_live(self, expires_at: int | None, now_ms: int) -> bool:
        """Whether a record with this instant may be delivered at `now_ms`.

        The one rule of every read path (worker queries, the client's reads of `<topic>.sow`,
        subscriptions, Spark snapshots): a record past its instant is never delivered, whether or
        not a worker's sweep has removed it yet. On a topic whose expiration is disabled, instants
        are only stored, so every record is live.
        """
        return not (self.active and is_due(expires_at, now_ms))


def is_due(expires_at: int | None, now_ms: int) -> bool:
    return expires_at is not None and expires_at <= now_ms
