"""Raw-bytes prefilters: reject a stored record before decoding it when it cannot match a filter.

`raw_prefilter(f)` derives from a compiled filter a check over the record's stored JSON bytes (as
orjson writes them: compact, no whitespace, strings escaped only for '"', '\\' and control
characters). The check is a *necessary* condition: when it says False, the filter is not TRUE
for the record; when it says True, the record still goes through the full filter. So it can make
a scan cheaper but never changes its answer. Where a node's semantics make a byte-level condition
doubtful, that node has no check (the scan then decodes as before).

Per node:

* `/f = 'lit'` and `/f IN ('a', 'b')` with plain strings (not spelling a number or boolean, so
  AMPS's conversions cannot make a number or boolean equal them): the JSON-encoded literal,
  quotes included, must occur in the bytes (a string equals the literal only if it is spelled
  exactly so, alone or as an array element).
* any other predicate on one path (comparisons with a literal, IN, BETWEEN, LIKE, BEGINS/ENDS WITH,
  through UPPER/LOWER too): find every `"<last path segment>":` in the bytes (every occurrence,
  at any depth, so the record's own field is among them) and decode only the scalar value after
  each; the record can match only if the node's own compiled predicate is TRUE for one of those
  values, or one of them is an array or object (then: maybe). A predicate that can be TRUE for a
  missing or NULL field (IS NULL) gets no check.
* AND: every conjunct that has a check must pass. OR: only when every disjunct has one, one
  must pass. NOT, path-to-path comparisons and constants: no check.
"""

from __future__ import annotations

import math
import operator
import re
from typing import Any, Callable

import orjson

from processor.core.filters import (
    Affix, And, Between, Compare, Filter, Func, In, IsNull, Like, Lit, Not, Or, Path, _compile, index_keys,
)
from processor.core.paths import split_path

__all__ = ["raw_prefilter", "RawCheck"]

# A check returns something true when the record may match (often a regex search's bound method,
# returning a Match or None: no Python frame per record).
RawCheck = Callable[[bytes], Any]

# The value after a key: a number, a string (escapes included), true/false/null, or else just its
# first byte ('[' or '{': not decoded, the record stays a candidate).
_VALUE = rb'(-?[0-9][0-9.eE+\-]*|"(?:[^"\\]|\\.)*"|true|false|null|.)'
_SEARCH, _PYTHON = 0, 1  # what a check costs: one regex search, or Python code per record


def raw_prefilter(f: Filter, offset: int = 0) -> RawCheck | None:
    """A necessary condition on stored bytes for `f` to be TRUE, or None when there is none.

    `offset` is where the JSON starts in the bytes given to the check. Checks may also look at
    the bytes before it: a match there only keeps a record a candidate, it never drops one.
    """
    found = _node(f._ast, offset)
    return None if found is None else found[0]


def _node(node: Any, offset: int) -> tuple[RawCheck, int] | None:
    if isinstance(node, And):
        found = [c for c in (_node(i, offset) for i in node.items) if c is not None]
        found.sort(key=lambda c: c[1])  # regex searches first, in the filter's order
        checks = [c for c, _ in found]
        if len(checks) <= 1:
            return found[0] if found else None
        cost = max(c for _, c in found)
        if len(checks) == 2:
            first, second = checks
            return (lambda raw: first(raw) and second(raw)), cost
        return (lambda raw: all(c(raw) for c in checks)), cost
    if isinstance(node, Or):
        found = [_node(i, offset) for i in node.items]
        if any(c is None for c in found):
            return None
        checks = [c for c, _ in found]
        return (lambda raw: any(c(raw) for c in checks)), max(c for _, c in found)
    if isinstance(node, (Not, IsNull)):
        return None
    if isinstance(node, Compare):
        left, right = node.left, node.right
        if isinstance(left, Lit) == isinstance(right, Lit):
            return None  # constant, or one path against another
        if isinstance(left, Lit):
            left, right = right, left
        if node.op == "=" and _plain_string(right.value):
            check = _substring(left, [right.value])
            if check is not None:
                return check, _SEARCH
    elif isinstance(node, In):
        values = [v for v in node.values if v is not None]  # a NULL alternative is never TRUE
        if not node.negated and values and all(map(_plain_string, values)):
            check = _substring(node.operand, values)
            if check is not None:
                return check, _SEARCH
    elif not isinstance(node, (Like, Between, Affix)):
        return None
    return _extract(node, offset)


def _plain_string(value: Any) -> bool:
    """A string literal that only a string can equal: not one spelling a number or a boolean."""
    return type(value) is str and index_keys(value) == [value]


# ASCII characters that str.lower()/str.upper() make out of non-ASCII ones ('K' KELVIN SIGN ->
# 'k', 'ß' -> 'SS', ...): tests/unit/test_rawfilter.py recomputes these over all of Unicode.
CASE_FROM_NON_ASCII = {"LOWER": frozenset("ik"), "UPPER": frozenset("AFHIJLNSTWY")}
_PRINTABLE = frozenset(chr(c) for c in range(0x20, 0x7F)) - {'"', "\\"}


def _never(raw: bytes) -> bool:
    return False


def _substring(operand: Any, values: list[str]) -> RawCheck | None:
    """`operand = one of values` (plain strings) as a byte search, for a path or UPPER/LOWER(path).

    A string equals such a literal only when it is spelled exactly so, and orjson writes it as
    the same quoted bytes alone or in an array. Through UPPER/LOWER, a value equals such a
    literal only if it is an ASCII string (given the literal avoids the letters non-ASCII
    characters case-map to), so an ASCII-case-insensitive search finds it.
    """
    flags = 0
    if isinstance(operand, Func):
        if not isinstance(operand.arg, Path):
            return None
        avoid = CASE_FROM_NON_ASCII[operand.name]
        if not all(set(v) <= _PRINTABLE and not set(v) & avoid for v in values):
            return None
        fold = str.lower if operand.name == "LOWER" else str.upper
        values = [v for v in values if fold(v) == v]  # 'B' is never LOWER(anything)
        if not values:
            return _never
        flags = re.IGNORECASE  # on bytes: ASCII letters only
    elif not isinstance(operand, Path):
        return None
    return re.compile(b"|".join(re.escape(orjson.dumps(v)) for v in values), flags).search


def _operand_path(node: Any) -> str | None:
    """The one path a predicate reads (through UPPER/LOWER), or None."""
    if isinstance(node, Compare):
        operand, other = node.left, node.right
        if isinstance(operand, Lit):
            operand, other = other, operand
        if not isinstance(other, Lit):
            return None
    else:
        operand = node.operand
    while isinstance(operand, Func):
        operand = operand.arg
    return operand.path if isinstance(operand, Path) else None


_NUMBER_OPS = {"=": operator.eq, "<>": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_FLIP = {"=": "=", "<>": "<>", "<": ">", "<=": ">=", ">": "<", ">=": "<="}


def _number_test(node: Any) -> Callable[[Any], bool] | None:
    """For a comparison or BETWEEN of a path with number literals: the node's result for a value
    that is a number (AMPS compares numbers numerically), else None."""
    if isinstance(node, Compare):
        left, right, op = node.left, node.right, node.op
        if isinstance(left, Lit):
            left, right, op = right, left, _FLIP[op]
        if isinstance(left, Path) and isinstance(right, Lit) and _is_number(right.value):
            fn, lit = _NUMBER_OPS[op], right.value
            return lambda v: fn(v, lit)
    if isinstance(node, Between) and isinstance(node.operand, Path) and _is_number(node.low) and _is_number(node.high):
        low, high = node.low, node.high
        if node.negated:
            return lambda v: not (low <= v <= high)
        return lambda v: low <= v <= high
    return None


def _is_number(v: Any) -> bool:
    return type(v) is int or type(v) is float


def _extract(node: Any, offset: int) -> tuple[RawCheck, int] | None:
    path = _operand_path(node)
    if path is None:
        return None
    parts = split_path(path)
    leaf = _compile(node)

    def record_with(value: Any) -> dict:
        rec: Any = value
        for part in reversed(parts):
            rec = {part: rec}
        return rec

    # A predicate that can be TRUE with the field missing or NULL cannot be checked this way.
    if leaf({}) is True or leaf(record_with(None)) is True:
        return None
    key = re.escape(orjson.dumps(parts[-1])) + b":"
    loads = orjson.loads
    fails = _number_fails(node)
    if fails is not None:
        # One regex search: a key whose value is not a number this node surely rejects.
        return re.compile(key + b"(?!(?:" + fails + rb")[,}\]])").search, _SEARCH
    number_test = _number_test(node)
    if number_test is not None:
        # Numbers only: anything else after the key (a string that may spell a number, an
        # array, ...) leaves the record a candidate. orjson writes numbers so that float()
        # reads back the same value; integers of up to 15 digits are exact as floats.
        findall = re.compile(key + rb"(?=(-?[0-9][0-9.eE+\-]*)?)").findall

        def check(raw: bytes) -> bool:
            for token in findall(raw, offset):
                if not token or len(token) > 15 or number_test(float(token)):
                    return True
            return False

    else:
        findall = re.compile(key + b"(?=" + _VALUE + b")", re.S).findall
        if len(parts) == 1:
            (name,) = parts
            record_with = lambda value: {name: value}  # noqa: E731 - the common case, one dict

        def check(raw: bytes) -> bool:
            for token in findall(raw, offset):
                if token[0] in b"[{":
                    return True
                try:
                    value = loads(token)
                except orjson.JSONDecodeError:
                    return True
                if leaf(record_with(value)) is True:
                    return True
            return False

    return check, _PYTHON


# Number tokens a comparison surely rejects, as a regex over JSON number text (integers and
# plain decimals as orjson writes them; exponents are never matched, so they stay candidates).
# Each set may leave out some rejected numbers (they are decoded), never include an accepted one.

_DIGITS = rb"(?:0|[1-9][0-9]*)"
_REGEX_LIMIT = 10**15  # literals beyond take the float() check (the regex grows with the digits)


def _ints_le(n: int) -> bytes | None:
    """Canonical digit strings (no sign, no leading zeros) of the integers 0..n; None if n < 0."""
    if n < 0:
        return None
    d = str(n)
    alts = []
    if len(d) > 1:
        alts.append(b"0|[1-9][0-9]{0,%d}" % (len(d) - 2))
    for i, c in enumerate(d):
        low = 1 if i == 0 and len(d) > 1 else 0
        if int(c) > low:
            alts.append(d[:i].encode() + b"[%d-%d]" % (low, int(c) - 1) + b"[0-9]" * (len(d) - i - 1))
    alts.append(d.encode())
    return b"(?:" + b"|".join(alts) + b")"


def _ints_ge(n: int) -> bytes:
    """Canonical digit strings of the integers >= n (n >= 0)."""
    if n <= 0:
        return _DIGITS
    d = str(n)
    alts = [b"[1-9][0-9]{%d,}" % len(d)]
    for i, c in enumerate(d):
        if int(c) < 9:
            alts.append(d[:i].encode() + b"[%d-9]" % (int(c) + 1) + b"[0-9]" * (len(d) - i - 1))
    alts.append(d.encode())
    return b"(?:" + b"|".join(alts) + b")"


def _below(limit: float, strict: bool, flip: bool = False) -> list[bytes]:
    """Tokens whose value is surely <= limit (< when strict); with flip, of -value instead."""
    minus, plus = (b"", b"-") if flip else (b"-", b"")
    out = []
    if limit > 0 or (limit == 0 and not strict):
        out.append(minus + _DIGITS + rb"(?:\.[0-9]+)?")  # every negative number (and -0)
        top = math.ceil(limit) - 1 if strict else math.floor(limit)  # largest integer that fits
        ints = _ints_le(top)
        if ints is not None:
            out.append(plus + ints)
        # I.f reads as at most I + 1 (rounded to a double: I + 1 is one), so I + 1 must fit.
        decimals = _ints_le(math.ceil(limit) - 2 if strict else math.floor(limit) - 1)
        if decimals is not None:
            out.append(plus + decimals + rb"\.[0-9]+")
    else:
        least = math.floor(-limit) + 1 if strict else math.ceil(-limit)  # -I <= -least <= limit
        out.append(minus + _ints_ge(least) + rb"(?:\.[0-9]+)?")
    return out


def _number_fails(node: Any) -> bytes | None:
    """Regex of the number tokens a Compare/BETWEEN with number literals surely makes not TRUE."""
    if isinstance(node, Compare):
        left, right, op = node.left, node.right, node.op
        if isinstance(left, Lit):
            left, right, op = right, left, _FLIP[op]
        if not (isinstance(left, Path) and isinstance(right, Lit) and _is_number(right.value)):
            return None
        lit = right.value
        if not abs(lit) <= _REGEX_LIMIT:  # NaN, infinities and huge numbers: the slower check
            return None
        below = lambda strict: _below(lit, strict)  # noqa: E731
        above = lambda strict: _below(-lit, strict, flip=True)  # noqa: E731
        sets = {">": below(False), ">=": below(True), "<": above(False), "<=": above(True),
                "=": below(True) + above(True)}.get(op)  # fmt: skip
    elif isinstance(node, Between) and not node.negated and isinstance(node.operand, Path):
        low, high = node.low, node.high
        if not (_is_number(low) and _is_number(high) and abs(low) <= _REGEX_LIMIT and abs(high) <= _REGEX_LIMIT):
            return None
        sets = _below(low, True) + _below(-high, True, flip=True)
    else:
        return None
    return b"|".join(sets) if sets else None
