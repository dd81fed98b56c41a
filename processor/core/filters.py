"""AMPS-style content filters, parsed with lark (LALR) and compiled to Python closures.

Syntax (keywords are case-insensitive)::

    /sym IN ('IBM', 'MSFT') AND /price >= 10.5 OR NOT (/desc LIKE '^a.*z$')
    /a/b BETWEEN 1 AND 5      /x IS NOT NULL      /s BEGINS WITH ('ab', 'cd')
    LOWER(/name) = 'bob'      1=1 (everything)    1=0 (nothing)

Operators: = <> != < <= > >=, [NOT] LIKE 'regex', [NOT] IN (literals), [NOT] BETWEEN lo AND hi,
IS [NOT] NULL, [NOT] BEGINS WITH / ENDS WITH ('a', ...), the operands UPPER(x) / LOWER(x), and
NOT > AND > OR with parentheses. Strings use single quotes ('it''s'); double quotes work too.

Semantics (AMPS rules with SQL three-valued logic, so NOT never turns "don't know" into a match):

* NULL is a missing field, JSON null, or the empty string '' (the literal '' is NULL as well).
  Arrays and objects are never NULL.
* Any comparison with a NULL operand is UNKNOWN (even against an empty array); NOT UNKNOWN is
  UNKNOWN; AND/OR are Kleene; a record matches only when the whole filter is TRUE.
  IS [NOT] NULL is always TRUE or FALSE.
* Number vs number compares numerically, string vs string by code point (case-sensitive: use
  LOWER/UPPER for case-insensitive equality). Number vs string converts the string to a number
  when it is a decimal number ('10' = 10), else the comparison is UNKNOWN. Booleans compare only
  with booleans or the strings 'true'/'false' (any case), and only with = and <> (ordering is
  UNKNOWN). Any other mix, and objects, are UNKNOWN.
* A predicate on an array value is true when any element satisfies it (AMPS repeated fields); an
  empty array gives FALSE. The NOT forms negate that: /tags NOT IN ('x') means no element is 'x'.
* LIKE is a regular expression in RE2 syntax, matched anywhere in the value (the pattern is a
  regex, not a value, so LIKE '' matches any non-NULL value) in time linear in the value:
  PCRE syntax without backreferences or look-around (see processor.core.regex).
  BEGINS/ENDS WITH test string prefixes/suffixes.
  Both see numbers as Python prints them (10, 2.5, 1e+20) and booleans as true/false.
* UPPER/LOWER change strings (and the strings inside arrays) and pass other values through.
* Paths (/a/b, segments of letters, digits and _ $ @ . : -) walk nested objects only; they do
  not descend into arrays.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, replace
from decimal import Decimal
from functools import lru_cache
from typing import Any, Callable, Iterable

import orjson
from lark import Lark, Token, Transformer
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken, VisitError

from processor.core.keys import key_text
from processor.core.paths import MISSING, get_path, split_path, within
from processor.core.regex import RegexError, regex

__all__ = ["FilterError", "Filter", "compile_filter", "format_filter", "index_keys", "distinct_keys", "spelled_number", "MATCH_ALL",
           "key_texts_equal_to", "odd_key_spelling"]


class FilterError(ValueError):
    """An unparsable filter: `position` is the 0-based offset of the problem, `expected` what fits.

    str() shows the text with a caret under the position."""

    def __init__(self, text: str, position: int, expected: list[str], found: str | None = None):
        self.text = text
        self.position = position
        self.expected = expected
        self.found = found
        what = f"found {found}" if found else "invalid filter"
        where = f"position {position}"
        if "\n" in text or "\r" in text:
            line = text.count("\n", 0, position) + 1
            where += f" (line {line}, column {position - _line_start(text, position) + 1})"
        lines = [f"{what} at {where}; expected one of: {', '.join(expected)}"]
        shown, caret = _window(text, position)
        lines += [f"  {shown}", "  " + " " * caret + "^"]
        super().__init__("\n".join(lines))

    def __reduce__(self):  # picklable, e.g. across Spark/multiprocessing workers
        return FilterError, (self.text, self.position, self.expected, self.found)


def _line_start(text: str, position: int) -> int:
    return max(text.rfind("\n", 0, position), text.rfind("\r", 0, position)) + 1


def _window(text: str, position: int, width: int = 80) -> tuple[str, int]:
    """The line of the text around a position, cut to about `width` characters (an error reason
    on `.errors` must not echo a huge filter), and where the position is in it. Tabs and other
    whitespace show as one space each, so the caret lines up under them."""
    start = _line_start(text, position)
    end = min((i for i in (text.find("\n", position), text.find("\r", position)) if i >= 0), default=len(text))
    text, position = text[start:end], position - start
    head = tail = ""
    if len(text) > width:
        start = max(0, min(position - width // 2, len(text) - width))
        head, tail = "..." if start else "", "..." if start + width < len(text) else ""
        text, position = text[start : start + width], position - start
    return head + re.sub(r"\s", " ", text) + tail, position + len(head)


# ---------------------------------------------------------------------------------------------
# Syntax tree (frozen so a compiled Filter can be shared across threads and cached by text)


@dataclass(frozen=True, slots=True)
class Path:
    path: str  # '/a/b'


@dataclass(frozen=True, slots=True)
class Lit:
    value: Any  # str (never ''), int, float, bool or None for NULL


@dataclass(frozen=True, slots=True)
class Func:
    name: str  # 'UPPER' or 'LOWER'
    arg: Any


@dataclass(frozen=True, slots=True)
class Compare:
    op: str  # one of = <> < <= > >=
    left: Any
    right: Any


@dataclass(frozen=True, slots=True)
class Like:
    operand: Any
    pattern: str
    negated: bool = False


@dataclass(frozen=True, slots=True)
class In:
    operand: Any
    values: tuple  # literal values
    negated: bool = False


@dataclass(frozen=True, slots=True)
class Between:
    operand: Any
    low: Any  # literal values
    high: Any
    negated: bool = False


@dataclass(frozen=True, slots=True)
class IsNull:
    operand: Any
    negated: bool = False


@dataclass(frozen=True, slots=True)
class Affix:
    kind: str  # 'BEGINS' or 'ENDS'
    operand: Any
    values: tuple  # str, or None for a NULL ('') alternative
    negated: bool = False


@dataclass(frozen=True, slots=True)
class Not:
    expr: Any


@dataclass(frozen=True, slots=True)
class And:
    items: tuple


@dataclass(frozen=True, slots=True)
class Or:
    items: tuple


# ---------------------------------------------------------------------------------------------
# Grammar

_GRAMMAR = r"""
start: or_expr
?or_expr: and_expr (OR and_expr)*
?and_expr: not_expr (AND not_expr)*
?not_expr: NOT not_expr -> not_
         | predicate
?predicate: "(" or_expr ")"
          | operand COMPOP operand                              -> compare
          | operand NOT? LIKE STRING                            -> like
          | operand NOT? IN "(" literal ("," literal)* ")"      -> in_
          | operand NOT? BETWEEN literal AND literal            -> between
          | operand IS NOT? NULL                                -> is_null
          | operand NOT? AFFIX WITH affixes                     -> affix
affixes: STRING | "(" STRING ("," STRING)* ")"
?operand: PATH                    -> path
        | FUNC "(" operand ")"    -> func
        | literal
literal: STRING | NUMBER | NULL | TRUE | FALSE

OR: /or\b/i
AND: /and\b/i
NOT: /not\b/i
LIKE: /like\b/i
IN: /in\b/i
BETWEEN: /between\b/i
IS: /is\b/i
NULL: /null\b/i
TRUE: /true\b/i
FALSE: /false\b/i
AFFIX: /(begins|ends)\b/i
WITH: /with\b/i
FUNC: /(upper|lower)\b/i
COMPOP: /<>|!=|<=|>=|=|<|>/
PATH: /(\/[\w$@.:-]+)+/
STRING: /'(?:[^']|'')*'/ | /"(?:[^"]|"")*"/
NUMBER: /-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?/
%ignore /\s+/
"""

# What each terminal means to a person reading the error.
_TERMINAL_NAMES = {
    "PATH": "a field path like /name",
    "STRING": "a string",
    "NUMBER": "a number",
    "NULL": "NULL",
    "TRUE": "TRUE",
    "FALSE": "FALSE",
    "FUNC": "UPPER(",
    "COMPOP": "a comparison operator (= <> < <= > >=)",
    "LPAR": "'('",
    "RPAR": "')'",
    "COMMA": "','",
    "$END": "the end of the filter",
    "AFFIX": "BEGINS WITH/ENDS WITH",
}


def _unquote(token: Token) -> str:
    quote = token[0]
    return token[1:-1].replace(quote * 2, quote)


def _literal_value(token: Token) -> Any:
    kind = token.type
    if kind == "STRING":
        return _unquote(token) or None  # '' is NULL
    if kind == "NUMBER":
        return float(token) if any(c in token for c in ".eE") else int(token)
    return {"NULL": None, "TRUE": True, "FALSE": False}[kind]


def _negated(items: list) -> bool:
    return any(isinstance(t, Token) and t.type == "NOT" for t in items)


class _Build(Transformer):
    """Parse tree -> frozen syntax tree; knows the text so a bad regex can be pointed at."""

    def __init__(self, text: str):
        super().__init__()
        self._text = text
        self._patterns: set[str] = set()  # the filter's LIKE patterns so far, and their RE2 instructions
        self._program = 0  # (MAX_FILTER_PROGRAM; a pattern repeated is compiled once)

    def start(self, items):
        return items[0]

    def or_expr(self, items):
        return Or(_flatten(Or, [i for i in items if not isinstance(i, Token)]))

    def and_expr(self, items):
        return And(_flatten(And, [i for i in items if not isinstance(i, Token)]))

    def not_(self, items):
        return Not(items[1])

    def compare(self, items):
        left, op, right = items
        return Compare("<>" if op == "!=" else str(op), left, right)

    def like(self, items):
        token = items[-1]
        pattern = _unquote(token)
        try:
            compiled = regex(pattern)
        except RegexError as exc:
            # Position in the filter text: each quote before it was written doubled.
            at = exc.position + pattern.count(token[0], 0, exc.position)
            expected = [f"a valid regular expression ({exc.reason})"]
            raise FilterError(self._text, token.start_pos + 1 + at, expected) from None
        if pattern not in self._patterns:
            self._patterns.add(pattern)
            self._program += compiled.size
        if self._program > MAX_FILTER_PROGRAM:
            raise FilterError(self._text, token.start_pos, [f"LIKE patterns of at most {MAX_FILTER_PROGRAM:,} RE2 instructions in all"],
                              f"{self._program:,} by here")
        return Like(items[0], pattern, _negated(items[1:]))

    def in_(self, items):
        values = tuple(i.value for i in items[1:] if isinstance(i, Lit))
        return In(items[0], values, _negated(items[1:2]))

    def between(self, items):
        low, high = (i.value for i in items[1:] if isinstance(i, Lit))
        return Between(items[0], low, high, _negated(items[1:2]))

    def is_null(self, items):
        return IsNull(items[0], _negated(items))

    def affix(self, items):
        kind = next(t for t in items if isinstance(t, Token) and t.type == "AFFIX")
        return Affix(kind.upper(), items[0], items[-1], _negated(items[1:]))

    def affixes(self, items):
        return tuple(_unquote(t) or None for t in items)

    def path(self, items):
        split_path(str(items[0]))  # validates
        return Path(str(items[0]))

    def func(self, items):
        return Func(items[0].upper(), items[1])

    def literal(self, items):
        return Lit(_literal_value(items[0]))


def _flatten(kind: type, items: list) -> tuple:
    out: list = []
    for item in items:
        out.extend(item.items if isinstance(item, kind) else (item,))
    return tuple(out)


_PARSER = Lark(_GRAMMAR, parser="lalr", maybe_placeholders=False)


# Parsing costs ~60 us a term here: this bound keeps any one filter (from a header, a query or a
# subscription) under ~0.4 s of a worker's time.
MAX_FILTER_CHARS = 65_536
# RE2 instructions all the LIKE patterns of one filter may compile to (each at most MAX_PROGRAM):
# what compiling it, and keeping it in the cache, may cost (a filter of 1,941 patterns of 62,000
# instructions each took minutes to compile and gigabytes that stayed).
MAX_FILTER_PROGRAM = 20_000


def _parse(text: str) -> Any:
    if len(text) > MAX_FILTER_CHARS:
        raise FilterError(text, MAX_FILTER_CHARS, [f"a filter of at most {MAX_FILTER_CHARS:,} characters"], f"{len(text):,} characters")
    if not text.strip():
        text = "1=1"  # an empty or blank filter matches everything, as no filter does
    try:
        tree = _PARSER.parse(text)
    except UnexpectedToken as exc:
        end = exc.token.type == "$END"
        position = len(text) if end else exc.token.start_pos
        found = "the end of the filter" if end else repr(str(exc.token))
        raise FilterError(text, position, _describe(exc.accepts or exc.expected), found) from None
    except UnexpectedCharacters as exc:
        pos = exc.pos_in_stream
        found = "an unterminated string" if text[pos] in "'\"" else repr(text[pos])
        expected = _describe(_accepts_after(text[:pos], exc.allowed))
        raise FilterError(text, pos, expected, found) from None
    except UnexpectedInput as exc:  # pragma: no cover - other lark input errors
        raise FilterError(text, getattr(exc, "pos_in_stream", 0) or 0, ["a valid filter"]) from None
    too_deep = FilterError(text, 0, [f"a filter nested at most {MAX_DEPTH} levels deep"], "deeper nesting")
    try:
        ast = _Build(text).transform(tree)
    except VisitError as exc:
        raise exc.orig_exc from None
    except RecursionError:  # lark transforms recursively: thousands of NOTs get here
        raise too_deep from None
    if _depth(ast) > MAX_DEPTH:
        raise too_deep
    return ast


# Compiling and matching recurse once per level of NOT, AND/OR, UPPER/LOWER: a filter from a
# header or a query must not be able to exhaust the interpreter's stack.
MAX_DEPTH = 64


def _depth(ast: Any) -> int:
    """Levels of the syntax tree (iteratively: the tree may be deeper than the stack allows)."""
    deepest, todo = 0, [(ast, 1)]
    while todo:
        node, level = todo.pop()
        deepest = max(deepest, level)
        if isinstance(node, (And, Or)):
            todo += [(item, level + 1) for item in node.items]
        elif isinstance(node, Not):
            todo.append((node.expr, level + 1))
        elif isinstance(node, Func):
            todo.append((node.arg, level + 1))
        elif isinstance(node, Compare):
            todo += [(node.left, level + 1), (node.right, level + 1)]
        elif hasattr(node, "operand"):
            todo.append((node.operand, level + 1))
    return deepest


def _accepts_after(prefix: str, fallback) -> set[str]:
    """What the parser accepts after a prefix (the lexer's list is wider: LALR shares states)."""
    try:
        interactive = _PARSER.parse_interactive(prefix)
        interactive.exhaust_lexer()
        return interactive.accepts()
    except UnexpectedInput:  # pragma: no cover - the prefix lexed and parsed already
        return fallback


def _describe(terminals) -> list[str]:
    names = {_TERMINAL_NAMES.get(t, t) for t in terminals}
    if "UPPER(" in names:
        names.add("LOWER(")
    return sorted(names)


# ---------------------------------------------------------------------------------------------
# Value semantics (the slow, general path; compiled closures take shortcuts for common cases)

_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?", re.ASCII)  # unambiguous: linear on digit runs; ASCII digits only
_BOOL_TEXT = {"true": True, "false": False}


def spelled_number(s: str) -> Decimal | None:
    """The exact number a string spells, as filters read it ('10', '-2.50', '1e3'), or None."""
    return Decimal(s) if _NUMBER.fullmatch(s) else None


def _to_number(s: str) -> int | float | None:
    """The number a string spells (AMPS converts strings compared with numbers), else None."""
    if not _NUMBER.fullmatch(s):
        return None
    try:
        return int(s)
    except ValueError:
        return float(s)


def _is_null(v: Any) -> bool:
    return v is None or v is MISSING or (type(v) is str and not v)


def _is_number(v: Any) -> bool:
    t = type(v)
    return t is int or t is float


def _text(v: Any) -> str | None:
    """The text LIKE and BEGINS/ENDS WITH see: strings as-is, numbers/booleans as JSON text."""
    t = type(v)
    if t is str:
        return v
    if t is bool:
        return "true" if v else "false"
    if t is int or t is float:
        return str(v)
    return None


def _kleene_or(results) -> bool | None:
    unknown = False
    for r in results:
        if r is True:
            return True
        if r is None:
            unknown = True
    return None if unknown else False


def _lift(fn: Callable[[Any], bool | None]) -> Callable[[Any], bool | None]:
    """A scalar predicate extended to NULL (UNKNOWN), arrays (any element) and objects (UNKNOWN)."""

    def lifted(v: Any) -> bool | None:
        if _is_null(v):
            return None
        t = type(v)
        if t is list:
            return _kleene_or(map(lifted, v))
        if t is dict:
            return None
        return fn(v)

    return lifted


_OPS = {"=": operator.eq, "<>": operator.ne, "<": operator.lt, "<=": operator.le,
        ">": operator.gt, ">=": operator.ge}  # fmt: skip
_FLIP = {"=": "=", "<>": "<>", "<": ">", "<=": ">=", ">": "<", ">=": "<="}


def _compare_scalars(op: Callable, a: Any, b: Any) -> bool | None:
    ta, tb = type(a), type(b)
    if _is_number(a):
        if tb is str:
            b = _to_number(b)
        elif not _is_number(b):
            return None
        return None if b is None else op(a, b)
    if ta is str:
        if tb is str:
            return op(a, b)
        if _is_number(b):
            a = _to_number(a)
            return None if a is None else op(a, b)
        if tb is bool:
            a = _BOOL_TEXT.get(a.lower())
    if tb is str and ta is bool:
        b = _BOOL_TEXT.get(b.lower())
    if type(a) is bool and type(b) is bool and (op is operator.eq or op is operator.ne):
        return op(a, b)
    return None


def _compare_values(op: Callable, a: Any, b: Any) -> bool | None:
    """Compare two record values: NULL and objects give UNKNOWN, arrays match on any element."""
    if _is_null(a) or _is_null(b):
        return None
    if type(a) is list:
        if type(b) is list:
            return _compare_arrays(op, _leaves(a), _leaves(b))
        return _kleene_or(_compare_values(op, x, b) for x in _leaves(a))
    if type(b) is list:
        return _kleene_or(_compare_values(op, a, y) for y in _leaves(b))
    if type(a) is dict or type(b) is dict:
        return None
    return _compare_scalars(op, a, b)


def _leaves(value: list) -> list:
    """The values of nested arrays, flattened (without recursion: arrays nest up to 200 deep)."""
    out: list = []
    todo = [value]
    while todo:
        for v in todo.pop():
            (todo if type(v) is list else out).append(v)
    return out


class _Side:
    """One operand's array elements, grouped by how `_compare_scalars` treats them."""

    __slots__ = ("null", "obj", "nums", "strs", "str_nums", "bools", "str_bools", "odd_strs", "not_bool_strs")

    def __init__(self, leaves: list):
        self.null = self.obj = self.odd_strs = self.not_bool_strs = False
        self.nums: list = []
        self.strs: list = []
        self.str_nums: list = []
        self.bools: set = set()
        self.str_bools: set = set()
        for v in leaves:
            t = type(v)
            if _is_null(v):
                self.null = True
            elif t is dict:
                self.obj = True
            elif t is int or t is float:
                self.nums.append(v)
            elif t is bool:
                self.bools.add(v)
            elif t is str:
                self.strs.append(v)
                n = _to_number(v)
                if n is None:
                    self.odd_strs = True
                else:
                    self.str_nums.append(n)
                b = _BOOL_TEXT.get(v.lower())
                if b is None:
                    self.not_bool_strs = True
                else:
                    self.str_bools.add(b)
            else:  # no JSON value; as _compare_scalars: incomparable
                self.obj = True

    def scalars(self) -> bool:
        return bool(self.nums or self.strs or self.bools or self.obj)


def _any_pair(op: Callable, xs, ys) -> bool:
    """Whether op(x, y) holds for some x of xs and y of ys (values of one ordered kind), in time
    linear in their sizes: the Kleene OR over the pairs of two arrays, without the pairs."""
    if not xs or not ys:
        return False
    if op is operator.eq:
        return not set(xs).isdisjoint(ys)
    if op is operator.ne:
        return len(set(xs) | set(ys)) > 1
    if op is operator.lt or op is operator.le:
        return op(min(xs), max(ys))
    return op(max(xs), min(ys))


def _compare_arrays(op: Callable, a: list, b: list) -> bool | None:
    """The Kleene OR of comparing each element of `a` with each of `b` (as `_compare_values` does
    pairwise, which takes time len(a) * len(b): two arrays of 100,000 numbers held a worker for
    hours) grouped by kind. An element of `a` that is NULL is UNKNOWN even against no elements."""
    x, y = _Side(a), _Side(b)
    found = (
        _any_pair(op, x.nums, y.nums + y.str_nums)
        or _any_pair(op, x.str_nums, y.nums)
        or _any_pair(op, x.strs, y.strs)
        or ((op is operator.eq or op is operator.ne)
            and (_any_pair(op, x.bools, y.bools | y.str_bools) or _any_pair(op, x.str_bools, y.bools)))
    )
    if found:
        return True
    ordering = not (op is operator.eq or op is operator.ne)
    unknown = (
        x.null
        or (x.scalars() and (y.null or y.obj))
        or (x.obj and (y.scalars() or y.null))
        or (x.nums and (y.odd_strs or y.bools))
        or (x.odd_strs and y.nums)
        or (x.bools and (y.nums or y.not_bool_strs))
        or (x.not_bool_strs and y.bools)
        or (ordering and ((x.bools and (y.strs or y.bools)) or (x.strs and y.bools)))
    )
    return None if unknown else False


def _case(fn: Callable[[str], str], v: Any) -> Any:
    if type(v) is str:
        return fn(v)
    if type(v) is list:
        return [_case(fn, x) for x in v]
    return v


def _in_scalar(values: tuple) -> Callable[[Any], bool | None]:
    """`v IN (values)` for one non-NULL scalar: the Kleene OR of v = each value, via set lookups."""
    strs = frozenset(v for v in values if type(v) is str)
    nums = frozenset(v for v in values if _is_number(v))
    bools = frozenset(v for v in values if type(v) is bool)
    has_null = None in values
    str_nums = frozenset(n for s in strs if (n := _to_number(s)) is not None)
    str_bools = frozenset(_BOOL_TEXT[s.lower()] for s in strs if s.lower() in _BOOL_TEXT)
    # When no value equals v, the answer is UNKNOWN if some value was incomparable, else FALSE.
    num_miss = None if has_null or bools or any(_to_number(s) is None for s in strs) else False
    bool_words = all(s.lower() in _BOOL_TEXT for s in strs)
    bool_miss = None if has_null or nums or not bool_words else False

    def in_scalar(v: Any) -> bool | None:
        t = type(v)
        if t is str:
            if v in strs:
                return True
            unknown = has_null
            if nums:
                n = _to_number(v)
                if n is None:
                    unknown = True
                elif n in nums:
                    return True
            if bools:
                b = _BOOL_TEXT.get(v.lower())
                if b is None:
                    unknown = True
                elif b in bools:
                    return True
            return None if unknown else False
        if t is int or t is float:
            return True if v in nums or v in str_nums else num_miss
        if t is bool:
            return True if v in bools or v in str_bools else bool_miss
        return None

    return in_scalar


# ---------------------------------------------------------------------------------------------
# Compilation: each node becomes a closure record -> True / False / None (UNKNOWN)

Pred = Callable[[dict], Any]


def _compile_operand(node: Any) -> Callable[[dict], Any]:
    """A getter record -> raw value (MISSING, None and '' all read as NULL later)."""
    if isinstance(node, Path):
        parts = split_path(node.path)
        if len(parts) == 1:
            (key,) = parts
            return lambda rec: rec.get(key)
        if len(parts) == 2:
            outer, inner = parts

            def get2(rec):
                v = rec.get(outer)
                return v.get(inner) if type(v) is dict else None

            return get2
        return lambda rec: get_path(rec, parts)
    if isinstance(node, Lit):
        value = node.value
        return lambda rec: value
    arg = _compile_operand(node.arg)
    fn = str.upper if node.name == "UPPER" else str.lower
    return lambda rec: _case(fn, arg(rec))


def _constant(value: bool | None) -> Pred:
    return lambda rec: value


def _compile_compare(node: Compare) -> Pred:
    left, right, opname = node.left, node.right, node.op
    if isinstance(left, Lit) and isinstance(right, Lit):
        return _constant(_compare_values(_OPS[opname], left.value, right.value))
    if isinstance(left, Lit):
        left, right, opname = right, left, _FLIP[opname]
    op = _OPS[opname]
    get = _compile_operand(left)
    if not isinstance(right, Lit):
        get_r = _compile_operand(right)
        return lambda rec: _compare_values(op, get(rec), get_r(rec))
    lit = right.value
    if lit is None:
        return _constant(None)
    # Fast paths for a value of the literal's own type; anything else takes the general route.
    if type(lit) is str:

        def cmp_str(rec):
            v = get(rec)
            if type(v) is str and v:
                return op(v, lit)
            return _compare_values(op, v, lit)

        return cmp_str
    if _is_number(lit):

        def cmp_num(rec):
            v = get(rec)
            t = type(v)
            if t is int or t is float:
                return op(v, lit)
            return _compare_values(op, v, lit)

        return cmp_num
    return lambda rec: _compare_values(op, get(rec), lit)


def _compile_in(node: In) -> Pred:
    lifted = _lift(_in_scalar(node.values))
    if isinstance(node.operand, Lit):
        return _constant(lifted(node.operand.value))
    get = _compile_operand(node.operand)
    strs = frozenset(v for v in node.values if type(v) is str)

    def in_(rec):
        v = get(rec)
        if type(v) is str and v in strs:
            return True
        return lifted(v)

    return in_


def _compile_predicate(node: Any) -> Pred:
    """The leaf predicates other than = and IN, each via a scalar function lifted over arrays."""
    get = _compile_operand(node.operand)
    if isinstance(node, IsNull):
        if node.negated:
            return lambda rec: not _is_null(get(rec))
        return lambda rec: _is_null(get(rec))
    if isinstance(node, Like):
        search = regex(node.pattern).search

        def scalar(v):
            s = _text(v)
            return None if s is None else search(s)

    elif isinstance(node, Between):
        low, high = node.low, node.high
        numeric = _is_number(low) and _is_number(high)

        def scalar(v):
            if numeric and (type(v) is int or type(v) is float):
                return low <= v <= high
            a = _compare_values(operator.ge, v, low)
            b = _compare_values(operator.le, v, high)
            return False if a is False or b is False else (None if a is None or b is None else True)

    else:  # Affix
        options = tuple(v for v in node.values if v is not None)
        miss = None if None in node.values else False
        starts = node.kind == "BEGINS"

        def scalar(v):
            s = _text(v)
            if s is None:
                return None
            hit = s.startswith(options) if starts else s.endswith(options)
            return True if hit else miss

    lifted = _lift(scalar)

    def predicate(rec):
        v = get(rec)
        t = type(v)
        if (t is str and v) or t is int or t is float:  # skip the NULL/array/object checks
            return scalar(v)
        return lifted(v)

    return predicate


def _compile(node: Any) -> Pred:
    if isinstance(node, Compare):
        return _compile_compare(node)
    if isinstance(node, (And, Or)):
        return _compile_bool(node)
    if isinstance(node, Not):
        inner = _compile(node.expr)

        def not_(rec):
            v = inner(rec)
            return None if v is None else not v

        return not_
    fn = _compile_in(node) if isinstance(node, In) else _compile_predicate(node)
    if getattr(node, "negated", False) and not isinstance(node, IsNull):
        positive = fn

        def fn(rec):
            v = positive(rec)
            return None if v is None else not v

    return fn


def _compile_bool(node: And | Or) -> Pred:
    """Kleene AND/OR with short-circuit: FALSE decides an AND, TRUE decides an OR."""
    parts = [_compile(item) for item in node.items]
    decisive = isinstance(node, Or)  # the value that settles the result
    if len(parts) == 2:
        f, g = parts
        if decisive:

            def or2(rec):
                a = f(rec)
                if a is True:
                    return True
                b = g(rec)
                if a is False or b is True:
                    return b
                return None

            return or2

        def and2(rec):
            a = f(rec)
            if a is False:
                return False
            b = g(rec)
            if a is True or b is False:
                return b
            return None

        return and2

    def many(rec):
        unknown = False
        for part in parts:
            v = part(rec)
            if v is decisive:
                return decisive
            if v is None:
                unknown = True
        return None if unknown else not decisive

    return many


# ---------------------------------------------------------------------------------------------
# Public API


class Filter:
    """A compiled filter. Immutable and thread-safe; get one from compile_filter (cached)."""

    __slots__ = ("text", "_ast", "_fn")

    def __init__(self, text: str, ast: Any):
        self.text = text
        self._ast = ast
        self._fn = _compile(ast)

    def matches(self, record: dict) -> bool:
        """True only when the filter is TRUE for the record (FALSE and UNKNOWN do not match)."""
        return self._fn(record) is True

    def equality_terms(self) -> dict[str, tuple] | None:
        """{path: values} from top-level AND terms `path = literal` / `path IN (...)`, for indexes.

        A record can match only if, for every path, its value equals one of the values; the
        caller narrows candidates with that and still applies matches(). Because AMPS compares
        across types ('10' = 10), a string literal that spells a number or boolean also adds that
        number/boolean; index records under index_keys(value) so these lookups find them all (the
        values are `distinct_keys`). No values means nothing can match. None when the filter is not such a conjunction (an
        OR or NOT on top, or no equality term at all); {} for a constant TRUE filter like 1=1.
        """
        terms = self._conjunction_terms(lambda values: distinct_keys(k for v in values for k in index_keys(v)))
        if terms:
            return terms
        node = self._ast
        if isinstance(node, Compare) and isinstance(node.left, Lit) and isinstance(node.right, Lit):
            return {} if self._fn({}) is True else None
        return None

    def literal_terms(self) -> dict[str, tuple]:
        """{path: literals} from the same top-level AND terms as equality_terms(), the literals as
        written (`/id = '5'` gives ('5',), `/id IN (5, 6)` (5, 6)): a record can match only if its
        value at each path equals one of them. {} when there is no such term."""
        return self._conjunction_terms(tuple)

    def _conjunction_terms(self, values_of: Callable[[tuple], tuple]) -> dict[str, tuple]:
        node = self._ast
        terms: dict[str, tuple] = {}
        for item in node.items if isinstance(node, And) else (node,):
            term = _equality_term(item)
            if term is not None:
                path, values = term[0], values_of(term[1])
                # Keep the smaller set; intersecting is wrong for arrays (['x','y'] = 'x' and 'y').
                if path not in terms or len(values) < len(terms[path]):
                    terms[path] = values
        return terms

    def fields(self) -> set[str]:
        """Every field path the filter reads, e.g. {'/a', '/b/c'}."""
        return _fields(self._ast, set())

    def seen_through(self, select: list[str]) -> Filter:
        """The filter as it reads a record cut to a select list: a field the list leaves out (one
        neither selected nor inside a selected one) reads NULL, as on the cut record itself, so a
        view's caller filters what the view shows, not the fields its select list hides."""
        selected = {split_path(path): path for path in select}
        ast = _seen_through(self._ast, selected)
        return self if ast is self._ast else Filter(_format(ast), ast)

    def __repr__(self) -> str:
        return f"Filter({self.text!r})"

    def __reduce__(self):  # pickles as its text (Spark ships filters to its Python workers)
        return compile_filter, (self.text,)


def _equality_term(node: Any) -> tuple[str, tuple] | None:
    """(path, literals) of a `path = literal` or `path IN (literals)` term, else None."""
    if isinstance(node, Compare) and node.op == "=":
        left, right = node.left, node.right
        if isinstance(left, Lit):
            left, right = right, left
        if isinstance(left, Path) and isinstance(right, Lit):
            return left.path, (right.value,)
    if isinstance(node, In) and not node.negated and isinstance(node.operand, Path):
        return node.operand.path, tuple(node.values)
    return None


def key_texts_equal_to(literal: Any) -> tuple[frozenset[str], bool]:
    """The key texts (`processor.core.keys.key_text`) of every key value `=` finds equal to
    `literal`, and whether that holds only while no key value is a string spelling a number or
    boolean otherwise than its key text does (`odd_key_spelling`): a number equals '05', '5.0' and
    '5e0', each a SowKey of its own, and `true` equals 'TRUE'. A string literal equals strings
    exactly, and the one number or boolean it may spell: its texts are whole. NULL equals nothing."""
    kind = type(literal)
    if literal is None:
        return frozenset(), False
    if kind is str:
        texts = {literal}
        number = _to_number(literal)
        if number is not None:
            texts |= _number_texts(number)
        truth = _BOOL_TEXT.get(literal.lower())
        if truth is not None:
            texts.add(key_text(truth))
        return frozenset(texts), False
    if kind is bool:
        return frozenset((key_text(literal),)), True
    return frozenset(_number_texts(literal)), True


def _number_texts(number: int | float) -> set[str]:
    """The key texts of the numbers equal to `number`: past 2**53 an int and a float can be equal
    with texts of their own (2**60 and 2.0**60)."""
    texts = {key_text(number)}
    if type(number) is float:
        if number.is_integer():
            texts.add(key_text(int(number)))
    else:
        try:
            as_float = float(number)
        except OverflowError:
            return texts
        if as_float == number:
            texts.add(key_text(as_float))
    return texts


def odd_key_spelling(value: Any) -> bool:
    """True for a key value that is a string a filter finds equal to a number or boolean whose key
    text is another ('05', '5.0', 'TRUE'): while a partition holds none, `key_texts_equal_to` of a
    number or boolean literal is whole there."""
    if type(value) is not str:
        return False
    number = _to_number(value)
    if number is not None:
        return value not in _number_texts(number)
    truth = _BOOL_TEXT.get(value.lower())
    return truth is not None and value != key_text(truth)


def distinct_keys(keys: Iterable) -> tuple:
    """Index keys without repeats, told apart as an index hashes them (their JSON): a Python set
    takes True for 1, False for 0 and 2.0**60 for 2**60, and would keep one key of each pair, so
    the records keyed by the other would be missed."""
    return tuple({orjson.dumps(k): k for k in keys}.values())


def index_keys(value: Any) -> list:
    """Hash-index keys for a record value: values that compare equal share at least one key.

    Index a record under every key of its field value and look up equality_terms() values:
    strings also key as the number or boolean they spell ('10' -> 10), integral floats key as
    ints, arrays as all their elements; NULL and objects have no keys (they equal nothing).
    """
    if _is_null(value) or type(value) is dict:
        return []
    if type(value) is list:
        return [k for v in value for k in index_keys(v)]
    if type(value) is not str:
        return _number_keys(value)
    keys = [value]
    n = _to_number(value)
    if n is not None:
        keys += _number_keys(n)
    b = _BOOL_TEXT.get(value.lower())
    if b is not None:
        keys.append(b)
    return keys


_EXACT = 1 << 53  # integers up to this are exact as floats
_INT64 = (-(1 << 63), 1 << 64)  # what orjson (and so an index's hash) writes as an integer


def _number_keys(v: Any) -> list:
    """A number's keys: integral floats as ints (10.0 -> 10), so keys agree once serialised (orjson,
    hashes). Past 2**53 a number keys both ways, as an int (within 64 bits, all an index can hash;
    its digits past that) and as the float it equals exactly: 2**60 equals 2.0**60, and 10**20 (a
    filter's literal, over 64 bits) equals a record's 1e20. Other values key as themselves."""
    kind = type(v)
    if kind is float:
        if not v.is_integer():
            return [v]
        as_int = int(v)
        if -_EXACT < as_int < _EXACT:
            return [as_int]
        return [v, as_int] if _INT64[0] <= as_int < _INT64[1] else [v]
    if kind is not int or -_EXACT < v < _EXACT:
        return [v]
    # Over 64 bits, its digits stand for it (a record's string that spells it keys the same way).
    keys = [v] if _INT64[0] <= v < _INT64[1] else [str(v)]
    try:
        as_float = float(v)
    except OverflowError:  # past any float: only its digits (above) can equal it
        return keys
    return keys + [as_float] if as_float == v else keys


def _map_paths(node: Any, fn: Callable[[Path], Any]) -> Any:
    """The tree with every field path replaced by fn(path); the same object when nothing changes."""
    if isinstance(node, Path):
        return fn(node)
    if isinstance(node, (And, Or)):
        items = tuple(_map_paths(item, fn) for item in node.items)
        return node if all(a is b for a, b in zip(items, node.items)) else type(node)(items)
    if isinstance(node, Lit):
        return node
    field = ("expr" if isinstance(node, Not) else "arg" if isinstance(node, Func)
             else "left" if isinstance(node, Compare) else "operand")  # fmt: skip
    changes = {field: _map_paths(getattr(node, field), fn)}
    if isinstance(node, Compare):
        changes["right"] = _map_paths(node.right, fn)
    if all(value is getattr(node, name) for name, value in changes.items()):
        return node
    return replace(node, **changes)


def _seen_through(node: Any, selected: dict[tuple[str, ...], str]) -> Any:
    """`Filter.seen_through` of a tree. A field above selected ones (/n with /n/x selected) is on
    the cut record only when one of those is, as an object: every predicate on it is UNKNOWN there
    but IS [NOT] NULL, which asks about those fields instead (reading NULL, `/n IS NOT NULL` was
    FALSE for records the view shows with /n). A selected field that is JSON null or '' still
    keeps /n on the cut record, which no filter can tell from a missing one."""
    if isinstance(node, (And, Or)):
        items = tuple(_seen_through(item, selected) for item in node.items)
        return node if all(a is b for a, b in zip(items, node.items)) else type(node)(items)
    if isinstance(node, Not):
        expr = _seen_through(node.expr, selected)
        return node if expr is node.expr else Not(expr)
    if isinstance(node, IsNull):
        operand = node.operand
        while isinstance(operand, Func):
            operand = operand.arg
        if isinstance(operand, Path) and not within(parts := split_path(operand.path), selected):
            below = [IsNull(Path(path), node.negated) for s, path in selected.items() if s[: len(parts)] == parts]
            if below:
                return below[0] if len(below) == 1 else (Or if node.negated else And)(tuple(below))
    return _map_paths(node, lambda path: path if within(split_path(path.path), selected) else Lit(None))


def _fields(node: Any, out: set[str]) -> set[str]:
    _map_paths(node, lambda path: out.add(path.path) or path)
    return out


@lru_cache(maxsize=4096)
def compile_filter(text: str) -> Filter:
    """Parse and compile a filter; raises FilterError. Cached by text: subscriptions repeat."""
    return Filter(text, _parse(text))


def format_filter(f: Filter) -> str:
    """Canonical text of a filter: compile_filter(format_filter(f)) is equivalent to f."""
    return _format(f._ast)


def _format_literal(v: Any) -> str:
    if v is None:
        return "NULL"
    if v is True:
        return "TRUE"
    if v is False:
        return "FALSE"
    if type(v) is str:
        return "'" + v.replace("'", "''") + "'"
    if type(v) is float and math.isinf(v):
        return "1e999" if v > 0 else "-1e999"
    return repr(v)


def _format(node: Any) -> str:
    if isinstance(node, Or):
        return " OR ".join(_format(i) for i in node.items)
    if isinstance(node, And):
        return " AND ".join(f"({_format(i)})" if isinstance(i, Or) else _format(i)
                            for i in node.items)  # fmt: skip
    if isinstance(node, Not):
        inner = _format(node.expr)
        return f"NOT ({inner})" if isinstance(node.expr, (And, Or)) else f"NOT {inner}"
    if isinstance(node, Path):
        return node.path
    if isinstance(node, Lit):
        return _format_literal(node.value)
    if isinstance(node, Func):
        return f"{node.name}({_format(node.arg)})"
    if isinstance(node, Compare):
        return f"{_format(node.left)} {node.op} {_format(node.right)}"
    subject = _format(node.operand) + (" NOT" if node.negated else "")
    if isinstance(node, IsNull):
        return _format(node.operand) + (" IS NOT NULL" if node.negated else " IS NULL")
    if isinstance(node, Like):
        return f"{subject} LIKE {_format_literal(node.pattern)}"
    if isinstance(node, In):
        return f"{subject} IN ({', '.join(map(_format_literal, node.values))})"
    if isinstance(node, Between):
        return f"{subject} BETWEEN {_format_literal(node.low)} AND {_format_literal(node.high)}"
    values = ", ".join(_format_literal(v if v is not None else "") for v in node.values)
    return f"{subject} {node.kind} WITH ({values})"


MATCH_ALL = compile_filter("1=1")
