"""Avro values as the core keeps them: JSON values, the same whether a record was just read from
Kafka or restored from a store that keeps it as JSON.

fastavro hands back Python types JSON has no form for (bytes, Decimal, datetime, UUID, NaN), and
a record stored as JSON and read back must still fit the schema when it is written to `.sow`. So a
topic's Avro values are read without fastavro's logical-type conversion, as Avro's own JSON encoding
has them: dates, times and timestamps as their int/long numbers, uuids as strings, bytes and fixed as
strings of code points 0-255. Decimals (bytes or fixed) become the decimal's text ("12.34": exact,
and filters compare it as a number). NaN and infinite floats have no JSON form and are refused.
Writing takes those values back (and what a publisher may pass: bytes, Decimal, datetime).
Before fastavro reads a value, `wire_check` refuses bytes that it would read as another value.
"""

from __future__ import annotations

import math
import re
from decimal import MAX_EMAX, MAX_PREC, MIN_EMIN, Context, Decimal, InvalidOperation
from typing import Any, Callable

from processor.contract.errors import ConfigError, InputError

Convert = Callable[[Any], Any]


def without_logical_types(schema: Any) -> Any:
    """The schema with every logicalType annotation dropped: what fastavro reads as plain values."""
    if isinstance(schema, list):
        return [without_logical_types(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: without_logical_types(v) for k, v in schema.items() if k != "logicalType"}  # fields, items, values, unions


class _Converters:
    """Converters of a parsed schema's values, built once per schema; None where nothing changes."""

    def __init__(self, named: dict, reading: bool, tagged: bool = False):
        self.named = named  # full name -> parsed definition (fastavro's named_schemas)
        self.reading = reading  # Avro -> core (else core -> Avro)
        self.tagged = tagged  # read with return_named_type: a union's named branch comes as (full name, value)
        self.ambiguous = False  # a union of several records and maps: fastavro reads them alike (dicts), and writes a dict to the first that takes it
        self.built: dict[str, Convert | None] = {}

    def of(self, schema: Any, at: str) -> Convert | None:
        if isinstance(schema, str):
            if schema not in self.named:
                return self._scalar(schema, None, at)
            if schema in self.built:  # built, or being built (a recursive type): look it up when called
                return self.built[schema] or (lambda v: (self.built.get(schema) or _same)(v))
            return self.of(self.named[schema], at)
        if isinstance(schema, list):
            return self._union(schema, at)
        kind = schema["type"]
        if kind == "record":
            return self._record(schema, at)
        if kind == "array":
            inner = self.of(schema["items"], at + "[]")
            return None if inner is None else (lambda v: [inner(x) for x in v])
        if kind == "map":
            inner = self.of(schema["values"], at)
            return None if inner is None else (lambda v: {k: inner(x) for k, x in v.items()})
        if isinstance(kind, (dict, list)):
            return self.of(kind, at)
        return self._scalar(kind, schema, at)

    def _record(self, schema: dict, at: str) -> Convert | None:
        name = schema["name"]
        self.built[name] = None
        fields = [(f["name"], self.of(f["type"], f"{at}/{f['name']}")) for f in schema["fields"]]
        fields = [(name_, fn) for name_, fn in fields if fn is not None]
        if not fields:
            self.built.pop(name)
            return None

        copy = not self.reading  # a record being written is the core's own: leave it as it is

        def record(v: dict) -> dict:
            if isinstance(v, dict):
                if copy:
                    v = dict(v)
                for field, fn in fields:
                    if field in v and v[field] is not None:
                        v[field] = fn(v[field])
            return v

        self.built[name] = record
        return record

    def _union(self, branches: list, at: str) -> Convert | None:
        """A union's value is converted by the branch its Python type belongs to; records and maps,
        which fastavro reads alike (dicts), by the branch fastavro names (reading tagged) or by the
        first branch the value fits (writing)."""
        resolved = [self._resolve(branch) for branch in branches]
        _refuse_union(resolved, at)
        fns = [self.of(branch, at) for branch in branches]
        dicts = [(branch, schema, fn) for branch, schema, fn in zip(branches, resolved, fns) if _python_types(schema, True) == (dict,)]
        ambiguous = len(dicts) > 1
        self.ambiguous = self.ambiguous or ambiguous
        by_type: dict[type, Convert] = {}
        by_name: dict[str, Convert] = {}
        for schema, fn in zip(resolved, fns):
            if self.tagged and isinstance(schema, dict) and "name" in schema:
                by_name[schema["name"]] = fn or _same
            elif fn is not None:
                for t in _python_types(schema, self.reading):
                    by_type.setdefault(t, fn)
        if not self.reading:  # a value a plain branch takes as it is stays as it is: 5 in ["long", decimal] is a long
            for schema in resolved:
                kind = schema if isinstance(schema, str) else None if schema.get("logicalType") else schema.get("type")
                for t in _NATIVE.get(kind, ()):
                    by_type.pop(t, None)
            if ambiguous:
                by_type[dict] = self._fitting(dicts, at)
            kinds = [schema if isinstance(schema, str) else schema["type"] for schema in resolved]
            # fastavro writes a value to the first branch that takes it. A string made bytes goes to an
            # array (bytes are a sequence of ints: "\x01" came back as [1]) and is no enum's symbol:
            # a string goes to a string or enum it is, else to the bytes or fixed it is (named).
            if {"bytes", "fixed"} & set(kinds) and {"array", "enum"} & set(kinds):
                plain = [(branch, None, None) for kind, branch in zip(kinds, branches) if kind in ("string", "enum")]
                raw = [(branch, None if isinstance(schema, dict) and schema.get("logicalType") == "decimal"  # a Decimal: no array takes it
                            else schema["name"] if kind == "fixed" else "bytes", fn)
                       for kind, branch, schema, fn in zip(kinds, branches, resolved, fns) if kind in ("bytes", "fixed")]
                by_type[str] = self._first_exact(plain + raw, by_type.get(str))
            # A float takes any int (16777217 came back as 16777216.0): an int goes to its int or long.
            whole = [(branch, kind, None) for kind, branch in zip(kinds, branches) if kind in ("int", "long")]
            if whole and {"float", "double"} & set(kinds[:kinds.index(whole[0][1])]):
                by_type[int] = self._first_exact(whole, by_type.get(int))
        if not by_type and not by_name:
            return None

        def union(v: Any) -> Any:
            fn = by_type.get(type(v))
            return fn(v) if fn else v

        def named(v: Any) -> Any:
            return by_name[v[0]](v[1]) if v.__class__ is tuple else union(v)

        return named if by_name else union

    def _fitting(self, dicts: list, at: str) -> Convert:
        """A writer of a dict in a union of several records and maps: the first branch the value is
        exactly a value of as the core reads them (`_is_read_as`), which reads back as the same value;
        else (a publisher's Decimal, bytes) the first whose converter and fastavro take it. A record
        is named (fastavro's tuple notation) so that fastavro writes that branch and not another."""
        from fastavro._validation import _validate

        choices = [(branch, schema, None if schema["type"] == "map" else schema["name"], fn) for branch, schema, fn in dicts]

        def fitting(v: dict) -> Any:
            exact = [c for c in choices if _is_read_as(v, c[1], self.named)]
            for branch, schema, name, fn in exact or choices:
                try:
                    out = fn(v) if fn else v
                    if exact or _validate(out, branch, self.named, at, False, {}):
                        return out if name is None else (name, out)
                except (InputError, ValueError, TypeError, AttributeError):  # not this branch's value
                    pass
            return v  # no branch takes it: fastavro refuses it

        return fitting

    def _first_exact(self, choices: list, otherwise: Convert | None) -> Convert:
        """A writer of a value in a union that fastavro would write to another branch than its own:
        the first of `choices` (branch, tag, converter) the value is exactly a value of as the core
        reads them (`_is_read_as`), converted, and named by its tag in fastavro's tuple notation (no
        tag: no earlier branch takes the value as it is). `writer_schema` names union branches so that
        fastavro's union check finds the tag too, in a union within a union. A value no choice takes
        goes as before (`otherwise`), for fastavro to refuse."""
        def choose(v: Any) -> Any:
            for branch, tag, fn in choices:
                if _is_read_as(v, branch, self.named):
                    out = fn(v) if fn else v
                    return out if tag is None else (tag, out)
            return otherwise(v) if otherwise else v

        return choose

    def _resolve(self, schema: Any) -> Any:
        return self.named.get(schema, schema) if isinstance(schema, str) else schema

    def _scalar(self, kind: str, schema: dict | None, at: str) -> Convert | None:
        logical = schema.get("logicalType") if schema else None
        if logical == "decimal" and kind in ("bytes", "fixed"):
            return _decimal_reader(schema.get("scale", 0), schema.get("precision"), at) if self.reading else _decimal_writer(at)
        if kind in ("bytes", "fixed"):
            return _bytes_reader if self.reading else _bytes_writer(at)
        if kind in ("float", "double") and self.reading:
            return _finite(at)
        return None


_NATIVE = {"string": (str,), "int": (int,), "long": (int,), "float": (float, int), "double": (float, int)}  # what fastavro writes as is


def _python_types(schema: Any, reading: bool) -> tuple[type, ...]:
    kind = schema if isinstance(schema, str) else schema.get("type")
    if kind in ("bytes", "fixed"):
        decimal = isinstance(schema, dict) and schema.get("logicalType") == "decimal"
        return (bytes,) if reading else ((str, Decimal, int, float) if decimal else (str,))
    if kind in ("float", "double"):
        return (float,)
    if kind in ("record", "map"):
        return (dict,)
    if kind == "array":
        return (list,)
    return ()


def _is_read_as(v: Any, schema: Any, named: dict) -> bool:
    """Whether `v` is a value of the parsed `schema` exactly as the core reads one (JSON values: bytes
    as code points 0-255, a decimal as its text with `scale` digits after the point, a record with
    every field, a float or a double as a float: an int goes to an int or a long first)."""
    schema = named.get(schema, schema) if isinstance(schema, str) else schema
    if isinstance(schema, list):
        return any(_is_read_as(v, branch, named) for branch in schema)
    kind = schema if isinstance(schema, str) else schema["type"]
    if isinstance(kind, (dict, list)):
        return _is_read_as(v, kind, named)
    if kind in ("record", "error"):
        fields = {f["name"]: f["type"] for f in schema["fields"]}
        return isinstance(v, dict) and v.keys() == fields.keys() and all(_is_read_as(x, fields[k], named) for k, x in v.items())
    if kind == "map":
        return isinstance(v, dict) and all(_is_read_as(x, schema["values"], named) for x in v.values())
    if kind == "array":
        return isinstance(v, list) and all(_is_read_as(x, schema["items"], named) for x in v)
    if kind in ("bytes", "fixed") and isinstance(schema, dict) and schema.get("logicalType") == "decimal":
        scale = schema.get("scale", 0)
        return isinstance(v, str) and re.fullmatch(r"-?[0-9]+" + (rf"\.[0-9]{{{scale}}}" if scale > 0 else ""), v) is not None
    if kind in ("bytes", "fixed"):
        return isinstance(v, str) and max(v, default="\0") <= "\xff" and (kind == "bytes" or len(v) == schema["size"])
    if kind == "enum":
        return v in schema["symbols"]
    return {"null": v is None, "boolean": v.__class__ is bool, "string": isinstance(v, str),
            "int": v.__class__ is int and -(2**31) <= v < 2**31, "long": v.__class__ is int and -(2**63) <= v < 2**63,
            "float": v.__class__ is float, "double": v.__class__ is float}[kind]


def _same(v: Any) -> Any:
    return v


def _bytes_reader(v: bytes) -> str:
    return v.decode("latin-1")


def _bytes_writer(at: str) -> Convert:
    def write(v: Any) -> Any:
        if isinstance(v, str):
            try:
                return v.encode("latin-1")
            except UnicodeEncodeError:
                raise InputError(f"{at}: a bytes value is a string of code points 0-255 (Avro's JSON form)") from None
        return v

    return write


# A context that rounds nothing: a decimal of any precision is read exactly.
_EXACT = Context(prec=MAX_PREC, Emax=MAX_EMAX, Emin=MIN_EMIN)


def _decimal_reader(scale: int, precision: int | None, at: str) -> Convert:
    # A value's bytes may hold more digits than the schema declares (a megabyte of them, which
    # Python would not even turn into text): such a value is not of the schema.
    digits = precision if isinstance(precision, int) and precision > 0 else 4000
    max_bits = math.ceil(digits * math.log2(10))
    bound = 0  # 10**digits, worked out when a value first comes near it (a schema may declare any precision)

    def read(v: bytes) -> str:
        nonlocal bound
        unscaled = int.from_bytes(v, "big", signed=True)
        magnitude = abs(unscaled)
        if magnitude.bit_length() >= max_bits - 1:  # fewer bits tell a value under 10**digits at once
            bound = bound or 10**digits
            if magnitude >= bound:
                raise InputError(f"{at}: a decimal with more digits than the schema's precision ({digits})")
        # From the integer (not its text, which Python refuses past 4,300 digits), in a context that
        # rounds nothing: exact at any precision.
        return format(Decimal(unscaled).scaleb(-scale, _EXACT), "f")

    return read


def _decimal_writer(at: str) -> Convert:
    def write(v: Any) -> Any:
        if isinstance(v, bytes):
            return v
        try:
            if isinstance(v, bool):
                raise InvalidOperation
            number = v if isinstance(v, Decimal) else Decimal(str(v))
        except InvalidOperation:
            number = None
        if number is None or not number.is_finite():
            raise InputError(f"{at}: {v!r} is not a decimal number")
        return number

    return write


def _finite(at: str) -> Convert:
    def check(v: float) -> float:
        if not math.isfinite(v):
            raise InputError(f"{at}: {v} has no JSON form (NaN and infinite numbers are refused)")
        return v

    return check


_PRIMITIVE = ("null", "boolean", "int", "long", "float", "double", "bytes", "string")


def writer_schema(schema: dict, named: dict) -> dict:
    """The parsed schema, and its named types, as the writer is given them: in every union a named
    type (record, enum, fixed) defined there is named instead, and a plain type by its name alone
    (`{"type": "bytes"}` as `"bytes"`), so that a
    branch in tuple notation (name, value) is found by fastavro's writer and by its check of a union
    alike (the check finds a tuple's branch only among records and branches given by name). The
    values written are the same bytes."""
    def by_name(part: Any, in_union: bool = False) -> Any:
        if isinstance(part, list):
            return [by_name(branch, True) for branch in part]
        if not isinstance(part, dict):
            return part
        kind = part.get("type")
        if in_union and kind in ("record", "error", "enum", "fixed"):
            return part["name"]
        if in_union and kind in _PRIMITIVE and "logicalType" not in part:
            return kind
        out = {k: v for k, v in part.items() if k not in ("__fastavro_parsed", "__named_schemas")}
        if "fields" in part:
            out["fields"] = [{**f, "type": by_name(f["type"])} for f in part["fields"]]
        for k in ("items", "values", "type"):
            if isinstance(part.get(k), (dict, list)):
                out[k] = by_name(part[k])
        return out

    written = by_name(schema)
    written["__fastavro_parsed"] = True
    written["__named_schemas"] = {name: by_name(definition) for name, definition in named.items()}
    return written


def converters(schema: Any, named: dict) -> tuple[Convert | None, Convert | None, bool]:
    """(Avro -> core, core -> Avro) converters of a parsed schema's records, None where none is
    needed, and whether values are read with fastavro's return_named_type: a union of several records
    and maps (all read as dicts) tells its branch so alone. ConfigError on a union no converter can
    read or write faithfully."""
    reader = _Converters(named, True)
    to_core = reader.of(schema, "")
    if reader.ambiguous:
        to_core = _Converters(named, True, tagged=True).of(schema, "")
    return to_core, _Converters(named, False).of(schema, ""), reader.ambiguous


def _refuse_union(branches: list, at: str) -> None:
    """ConfigError on a union whose branches are read alike and converted apart with nothing to tell
    them by: two of one unnamed type (Avro forbids it; fastavro reads it), or a decimal with other
    bytes or fixed (fastavro writes bytes to the first branch that takes them)."""
    kinds = [schema if isinstance(schema, str) else schema["type"] for schema in branches]
    twice = sorted({k for k in kinds if kinds.count(k) > 1 and k not in ("record", "error", "enum", "fixed")})
    if twice:
        raise ConfigError(f"{at or '/'}: a union with more than one {twice[0]} (Avro allows one of each unnamed type)")
    raw = [schema for schema, kind in zip(branches, kinds) if kind in ("bytes", "fixed")]
    if len(raw) > 1 and any(isinstance(schema, dict) and schema.get("logicalType") == "decimal" for schema in raw):
        raise ConfigError(f"{at or '/'}: a union of a decimal and other bytes or fixed: fastavro reads them alike and "
                          "writes a value to the first that takes it, so a value could come back as another")


# fastavro reads some malformed values as other values, without a word: it looks up a union's
# branch and an enum's symbol with Python's indexing (a negative index picks one from the end),
# reads an int or a long to its last byte however many there are (its C reader wraps past 64 bits,
# its Python reader grows past them), keeps an int past 32 bits, and takes any byte but 0 as a true
# boolean (Java's reader takes 1 alone). `wire_check` walks a value's bytes as fastavro reads them
# and refuses those.

Check = Callable[[bytes, int], int]  # (a value's bytes, where a part starts) -> where it ends
Part = Check | int  # a part that always takes the same number of bytes is that number

# In a schema with no union, enum, int or boolean only a long can be malformed so (a length and a
# count are longs too), and a long past 64 bits or 10 bytes has 9 bytes in a row with their high bit
# set, which most values do not have (ASCII text, numbers under 2**56): a scan of ~0.3 us finds them.
_HIGH_BITS = bytes(b & 0x80 for b in range(256))
_NINE_HIGH = b"\x80" * 9


def wire_check(schema: Any, named: dict) -> Callable[[bytes], None]:
    """A check of values of the parsed `schema` (`named`: its named types) that raises InputError on
    bytes fastavro would read as another value. Bytes that end too soon are left to fastavro, which
    refuses them."""
    parts = _WireChecks(named)
    check = _as_check(parts.of(schema, ""))
    always = parts.always

    def check_wire(data: bytes) -> None:
        if always or _NINE_HIGH in data.translate(_HIGH_BITS):
            try:
                check(data, 0)
            except IndexError:  # read past the end: the value ends too soon
                pass

    return check_wire


def _refuse(at: str, why: str) -> InputError:
    return InputError(f"{at or '/'}: {why}")


def _varint(data: bytes, pos: int, bits: int, what: str, at: str) -> tuple[int, int]:
    """(the zig-zag varint at `pos` as written, where it ends); InputError past `bits` bits, or past
    the bytes they take."""
    n = shift = 0
    size = (bits + 6) // 7
    for end in range(pos, pos + size):
        byte = data[end]
        n |= (byte & 0x7F) << shift
        if byte < 0x80:
            if n >> bits:
                raise _refuse(at, f"{what} past {bits} bits")
            return n, end + 1
        shift += 7
    raise _refuse(at, f"{what} in more than {size} bytes")


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _as_check(part: Part) -> Check:
    return part if not isinstance(part, int) else (lambda data, pos: pos + part)


class _WireChecks:
    """Checks of a parsed schema's parts, each reading what fastavro reads; a record is built once
    (a recursive one must be), other types where they are used (their messages name that place)."""

    def __init__(self, named: dict):
        self.named = named  # full name -> parsed definition (fastavro's named_schemas)
        self.records: dict[str, Part | None] = {}  # None: being built (a recursive record)
        self.always = False  # whether a malformed value may lack a run of high bits (_NINE_HIGH)

    def of(self, schema: Any, at: str) -> Part:
        if isinstance(schema, list):
            return self._union(schema, at)
        if isinstance(schema, str) and schema in self.named:
            if schema not in self.records:
                return self.of(self.named[schema], at)
            record = self.records[schema]
            return record if record is not None else (lambda data, pos: self.records[schema](data, pos))
        kind = schema if isinstance(schema, str) else schema["type"]
        if kind in ("record", "error"):
            return self._record(schema, at)
        if kind == "enum":
            return self._enum(len(schema["symbols"]), schema["name"], at)
        if kind == "array":
            return self._blocks(self.of(schema["items"], at + "[]"), None, "an array", at)
        if kind == "map":
            return self._blocks(self.of(schema["values"], at), self._sized("a map key", at), "a map", at)
        if kind == "int":
            self.always = True
            return self._number(32, "an int", at)
        if kind == "long":
            return self._number(64, "a long", at)
        if kind == "boolean":
            self.always = True
            return self._boolean(at)
        if kind in ("string", "bytes"):
            return self._sized("a string" if kind == "string" else "a bytes value", at)
        return schema["size"] if kind == "fixed" else {"null": 0, "float": 4, "double": 8}[kind]

    def _record(self, schema: dict, at: str) -> Part:
        name = schema["name"]
        self.records[name] = None
        parts: list[Part] = []
        for field in schema["fields"]:
            part = self.of(field["type"], f"{at}/{field['name']}")
            if not isinstance(part, int):
                parts.append(part)
            elif parts and isinstance(parts[-1], int):
                parts[-1] += part  # fields of fixed sizes in a row are skipped at once
            elif part:
                parts.append(part)
        if len(parts) <= 1:
            record = parts[0] if parts else 0
        else:
            checks = [_as_check(part) for part in parts]

            def record(data: bytes, pos: int) -> int:
                for check in checks:
                    pos = check(data, pos)
                return pos

        self.records[name] = record
        return record

    def _union(self, branches: list, at: str) -> Check:
        self.always = True
        parts = [self.of(branch, at) for branch in branches]
        count = len(parts)

        def union(data: bytes, pos: int) -> int:
            n = data[pos]
            if n < 0x80:
                pos += 1
            else:
                n, pos = _varint(data, pos, 32, "a union's branch index", at)  # an int, as Avro writes it
            if n & 1 or n >> 1 >= count:
                raise _refuse(at, f"a union's branch index {_zigzag(n)} (the union has {count} branches)")
            part = parts[n >> 1]
            return pos + part if part.__class__ is int else part(data, pos)

        return union

    def _enum(self, count: int, name: str, at: str) -> Check:
        self.always = True

        def enum(data: bytes, pos: int) -> int:
            n = data[pos]
            if n < 0x80:
                pos += 1
            else:
                n, pos = _varint(data, pos, 32, "an enum's index", at)
            if n & 1 or n >> 1 >= count:
                raise _refuse(at, f"an enum's index {_zigzag(n)} (the enum {name} has {count} symbols)")
            return pos

        return enum

    def _blocks(self, item: Part, key: Check | None, what: str, at: str) -> Check:
        """An array's items or a map's entries (`key`: a map's), in blocks: a count (negative: its
        byte size follows, which fastavro reads and ignores) and that many, up to a count of 0."""
        check = _as_check(item)
        size = item if isinstance(item, int) and key is None else None  # items of a fixed size are skipped at once

        def blocks(data: bytes, pos: int) -> int:
            while True:
                n = data[pos]
                if n < 0x80:
                    pos += 1
                else:
                    n, pos = _varint(data, pos, 64, f"{what}'s block count", at)
                if not n:
                    return pos
                count = _zigzag(n)
                if count < 0:
                    count = -count
                    pos = _varint(data, pos, 64, f"{what}'s block size", at)[1]
                if size is not None:
                    pos += count * size
                else:
                    for _ in range(count):  # each reads a byte at least: the loop ends with the value
                        if key is not None:
                            pos = key(data, pos)
                        pos = check(data, pos)

        return blocks

    def _sized(self, what: str, at: str) -> Check:
        """A length, and that many bytes: a string, bytes, a map's key."""

        def sized(data: bytes, pos: int) -> int:
            n = data[pos]
            if n < 0x80:
                pos += 1
            else:
                n, pos = _varint(data, pos, 64, f"{what}'s length", at)
            if n & 1:
                raise _refuse(at, f"{what} of length {_zigzag(n)}")
            return pos + (n >> 1)

        return sized

    def _number(self, bits: int, what: str, at: str) -> Check:
        longest = (bits + 6) // 7

        def number(data: bytes, pos: int) -> int:
            if data[pos] < 0x80:
                return pos + 1
            end = pos + 1
            while data[end] > 0x7F:
                end += 1
            # shorter than the longest, a number fits its bits: only a longest one is read for them
            return end + 1 if end - pos < longest - 1 else _varint(data, pos, bits, what, at)[1]

        return number

    def _boolean(self, at: str) -> Check:
        def boolean(data: bytes, pos: int) -> int:
            if data[pos] > 1:
                raise _refuse(at, f"a boolean's byte {data[pos]} (Avro writes 0 for false, 1 for true)")
            return pos + 1

        return boolean
