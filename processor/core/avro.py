"""Avro values as the core keeps them: JSON values, the same whether a record was just read from
Kafka or restored from a store that keeps it as JSON.

fastavro hands back Python types JSON has no form for (bytes, Decimal, datetime, UUID, NaN), and
a record stored as JSON and read back must still fit the schema when it is written to `.sow`. So a
topic's Avro values are read without fastavro's logical-type conversion, as Avro's own JSON encoding
has them: dates, times and timestamps as their int/long numbers, uuids as strings, bytes and fixed as
strings of code points 0-255. Decimals (bytes or fixed) become the decimal's text ("12.34": exact,
and filters compare it as a number). NaN and infinite floats have no JSON form and are refused.
Writing takes those values back (and what a publisher may pass: bytes, Decimal, datetime).
"""

from __future__ import annotations

import math
from decimal import MAX_EMAX, MAX_PREC, MIN_EMIN, Context, Decimal, InvalidOperation
from typing import Any, Callable

from processor.contract.errors import InputError

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

    def __init__(self, named: dict, reading: bool):
        self.named = named  # full name -> parsed definition (fastavro's named_schemas)
        self.reading = reading  # Avro -> core (else core -> Avro)
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
        """A union's value is converted by the branch its Python type belongs to."""
        by_type: dict[type, list] = {}
        for branch in branches:
            fn = self.of(branch, at)
            if fn is not None:
                for t in _python_types(self._resolve(branch), self.reading):
                    by_type.setdefault(t, []).append((self._resolve(branch), fn))
        if not by_type:
            return None
        if not self.reading:  # a value a plain branch takes as it is stays as it is: 5 in ["long", decimal] is a long
            for branch in branches:
                kind = self._resolve(branch)
                kind = kind if isinstance(kind, str) else None if kind.get("logicalType") else kind.get("type")
                for t in _NATIVE.get(kind, ()):
                    by_type.pop(t, None)
            if not by_type:
                return None

        def union(v: Any) -> Any:
            candidates = by_type.get(type(v))
            if not candidates:
                return v
            if len(candidates) > 1 and isinstance(v, dict):  # several records: the one whose fields the value has
                candidates = [c for c in candidates if isinstance(c[0], dict) and set(v) <= {f["name"] for f in c[0].get("fields", ())}] or candidates
            return candidates[0][1](v)

        return union

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


def converters(schema: Any, named: dict) -> tuple[Convert | None, Convert | None]:
    """(Avro -> core, core -> Avro) converters of a parsed schema's records; None where none is needed."""
    return _Converters(named, True).of(schema, ""), _Converters(named, False).of(schema, "")
