"""Regular expressions for LIKE, matched in linear time with RE2.

A backtracking engine (Python's `re`, PCRE) takes exponential time on patterns like `^(a+)+$`
against 'aaaa...b'; a filter is run by workers (views, deletes by filter, queries) on values
anyone can publish, so one such filter would hold a worker for hours. RE2 matches in time linear
in the text, whatever the pattern, with memory bounded per pattern (MAX_MEM).

The syntax is RE2's, which is PCRE's (what AMPS users write) minus what cannot be matched in
linear time: backreferences (`\\1`), look-around (`(?=`, `(?!`, `(?<=`, `(?<!`), atomic groups and
possessive quantifiers. `\\d`, `\\w`, `\\s` and `\\b` are ASCII, as in PCRE by default; `\\p{L}`
and friends give Unicode classes. Repetition counts are at most 1000. A pattern RE2 refuses (`Regex(pattern)`) is a
RegexError with the reason and, when RE2 names the offending fragment, its position.
"""

from __future__ import annotations

from functools import lru_cache

import re2
from re2 import _re2

__all__ = ["RegexError", "Regex", "MAX_MEM", "MAX_PROGRAM", "regex"]

MAX_MEM = 2 << 20  # bytes of RE2 program and DFA cache per pattern (RE2's default is 8 MiB)
# RE2 instructions a pattern may compile to. Linear in the text is not cheap with a large program:
# counted repetitions of broad classes (`.{1000}.{1000}z`: 16,005 instructions) overflow the DFA
# and fall back to a match costing text x program (4 s for 100 KB), which no budget can interrupt.
# `\p{L}` alone is 1,200; `[0-9a-f]{32}` 68; `.{500}` 4,004.
MAX_PROGRAM = 5_000
# RE2's reasons for the PCRE constructs it leaves out, which a user may not expect to be refused.
_UNSUPPORTED = ("invalid perl operator", "invalid escape sequence", "bad repetition operator", "invalid repetition size")
_HINT = "LIKE uses RE2 syntax: no backreferences, look-around, atomic groups, possessive quantifiers or counts over 1000"


class RegexError(ValueError):
    """A pattern RE2 cannot compile: `reason` says why, `position` is where in the pattern."""

    def __init__(self, pattern: str, reason: str, position: int):
        self.pattern = pattern
        self.reason = reason
        self.position = position
        super().__init__(f"{reason} at position {position} of {pattern!r}")


def _options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # RE2 would print every refused pattern to stderr
    options.never_capture = True  # only "does it match" is asked: no submatch bookkeeping
    options.max_mem = MAX_MEM
    return options


_OPTIONS = _options()
_UNANCHORED = _re2.RE2.Anchor.UNANCHORED
_WHOLE = _re2.RE2.Anchor.ANCHOR_BOTH


class Regex:
    """A compiled pattern with `search(text) -> bool` (anywhere in the text, as re.search) and
    `fullmatch(text) -> bool` (the whole text).

    Calls RE2's binding directly: the `re2` module's own `search` is a Python generator that builds
    match objects and maps byte offsets to characters, about 5x the cost of the match itself.
    Pickles as its pattern (Spark ships filters to its Python workers)."""

    __slots__ = ("pattern", "size", "_match")

    def __init__(self, pattern: str):
        compiled = _re2.RE2(pattern.encode("utf-8", "surrogatepass"), _OPTIONS)
        if not compiled.ok():
            reason = compiled.error()
            reason = reason.decode(errors="replace") if isinstance(reason, bytes) else str(reason)
            position = _position(pattern, reason)
            if reason.startswith(_UNSUPPORTED):
                reason = f"{reason}; {_HINT}"
            raise RegexError(pattern, reason, position)
        size = compiled.ProgramSize()
        if size > MAX_PROGRAM:
            raise RegexError(pattern, f"the pattern compiles to {size:,} RE2 instructions, over the {MAX_PROGRAM:,} a LIKE may "
                             "use (large counted repetitions, such as .{1000} or \\p{L}{100}, make every match slow)", 0)
        self.pattern = pattern
        self.size = size
        self._match = compiled.Match

    def search(self, text: str) -> bool:
        # surrogatepass: a lone surrogate (possible in a str from Avro or Python) must not raise;
        # RE2 sees invalid UTF-8 there, which no character class matches.
        raw = text.encode("utf-8", "surrogatepass")
        return self._match(_UNANCHORED, raw, 0, len(raw))[0][0] >= 0

    def fullmatch(self, text: str) -> bool:
        raw = text.encode("utf-8", "surrogatepass")
        return self._match(_WHOLE, raw, 0, len(raw))[0][0] >= 0

    def __reduce__(self):
        return Regex, (self.pattern,)

    def __repr__(self) -> str:
        return f"Regex({self.pattern!r})"


@lru_cache(maxsize=1024)
def regex(pattern: str) -> Regex:
    """`Regex(pattern)`, compiled once: a filter's parse validates its patterns and its compilation
    uses them, and subscriptions repeat filters."""
    return Regex(pattern)


def _position(pattern: str, reason: str) -> int:
    """Where the fragment RE2 quotes after the colon ("invalid escape sequence: \\1") starts."""
    _, colon, fragment = reason.partition(": ")
    found = pattern.find(fragment) if colon and fragment else -1
    return max(found, 0)

