"""Durations as the contract writes them: 500ms, 30s, 5m, 2h, 1d, or a bare number of seconds."""

from __future__ import annotations

import re

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")


class DurationError(ValueError):
    """A duration string that does not parse."""


def parse_duration_ms(text: str | int | float) -> int:
    """Milliseconds for a duration; a bare number is seconds (as AMPS and the contract say)."""
    if isinstance(text, bool):
        raise DurationError(f"not a duration: {text!r}")
    if isinstance(text, (int, float)):
        if text < 0:
            raise DurationError(f"negative duration: {text!r}")
        return int(round(text * 1000))
    match = _DURATION.match(text)
    if not match:
        raise DurationError(f"not a duration: {text!r} (use e.g. 500ms, 30s, 5m, 2h, 1d or seconds)")
    number, unit = match.groups()
    return int(round(float(number) * _UNITS_MS[unit or "s"]))


def format_duration_ms(ms: int) -> str:
    """The shortest exact spelling of a duration, for messages and docs."""
    for unit in ("d", "h", "m", "s"):
        size = _UNITS_MS[unit]
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"
