"""Durations as the contract writes them: 500ms, 30s, 5m, 2h, 1d, or a bare number of seconds."""

from __future__ import annotations

import re

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", re.ASCII)  # ASCII: float() reads other scripts' digits too

# Every duration (lifetimes, expiration clamps, conflation) is at most 36,500 days, about 100
# years: an instant "now + lifetime" then always fits the signed 64-bit milliseconds that record
# headers and store keys hold, whatever the input asked for.
MAX_DURATION_MS = 36_500 * _UNITS_MS["d"]


class DurationError(ValueError):
    """A duration string that does not parse, or one beyond MAX_DURATION_MS."""


def parse_duration_ms(text: str | int | float) -> int:
    """Milliseconds for a duration; a bare number is seconds (as AMPS and the contract say)."""
    if isinstance(text, bool) or text != text:  # text != text: NaN
        raise DurationError(f"not a duration: {_shown(text)}")
    if isinstance(text, (int, float)):
        if text < 0:
            raise DurationError(f"negative duration: {_shown(text)}")
        return _bounded(text * 1000, text)
    if not isinstance(text, str):  # a caller's list or bytes: the same error, not a TypeError from the regex
        raise DurationError(f"not a duration: {_shown(text)} (a text such as 30s, or a number of seconds)")
    match = _DURATION.match(text)
    if not match:
        raise DurationError(f"not a duration: {_shown(text)} (use e.g. 500ms, 30s, 5m, 2h, 1d or seconds)")
    number, unit = match.groups()
    return _bounded(float(number) * _UNITS_MS[unit or "s"], text)


def _bounded(ms: float, given: object) -> int:
    if not ms <= MAX_DURATION_MS:  # also infinity, e.g. from 400 digits
        limit = format_duration_ms(MAX_DURATION_MS)
        raise DurationError(f"duration {_shown(given)} is over the limit of {limit} (about 100 years)")
    rounded = int(round(ms))
    return 1 if rounded == 0 and ms > 0 else rounded  # under half a millisecond is the shortest lifetime, not 0 (never)


def _shown(value: object, width: int = 40) -> str:
    """The value as a message quotes it, cut short: error reasons must not echo a huge input."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def format_duration_ms(ms: int) -> str:
    """The shortest exact spelling of a duration, for messages and docs."""
    for unit in ("d", "h", "m", "s"):
        size = _UNITS_MS[unit]
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"
