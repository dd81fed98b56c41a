"""Message types: bytes on Kafka <-> records (dicts) in the core. JSON via orjson, Avro via fastavro."""

from __future__ import annotations

import functools
import io
import json
import sys
from pathlib import Path
from typing import Protocol

import orjson

from processor.contract.errors import ConfigError, InputError


class Codec(Protocol):
    name: str
    # How values are written: two codecs with one `encoding` read each other's bytes. A store is stamped
    # with it (processor.state.keyformat), so a changed schema or message_type is found at start.
    encoding: str
    trims_deltas: bool  # whether delta_fields changes anything (the hot path skips the call otherwise)

    def decode(self, data: bytes) -> dict: ...

    def encode(self, record: dict) -> bytes: ...

    def unknown_fields(self, record: dict) -> list[str]:
        """Paths of fields the type cannot carry (encode would drop them)."""
        ...

    def delta_fields(self, record: dict) -> dict:
        """The fields a delta publish actually sends."""
        ...


# orjson reads an integer outside [-2**63, 2**64) as a float, without a word: two order IDs that
# differ in their last digits would get one SowKey, and the record would not say what was sent.
# Such an integer has 20 digits or more, or is negative with 19, so only a value with a run of 20
# digits and minus signs (a quick scan, ~0.3 us a record: each made a 9) is read again, exactly.
_DIGITS_AS_NINES = bytes.maketrans(b"-012345678", b"9999999999")
_TWENTY = b"9" * 20
_INT_RANGE = (-(1 << 63), 1 << 64)


def check_integers(data: bytes) -> None:
    """Raise InputError when the JSON `data` holds an integer that would not be kept exactly."""
    if _TWENTY not in data.translate(_DIGITS_AS_NINES):
        return
    # Read again with every integer exact (the standard library's parser): a run of digits may
    # be in a string, which the quick scan cannot tell.

    def exact(text: str) -> int:
        if len(text) > 21 or not _INT_RANGE[0] <= (value := int(text)) < _INT_RANGE[1]:
            shown = text if len(text) <= 30 else text[:27] + "..."
            raise InputError(f"integer {shown} is outside the 64-bit range a JSON number is kept in: send it as a string")
        return value

    try:
        json.loads(data, parse_int=exact)
    except RecursionError:  # orjson reads deeper than the standard library can
        raise InputError("value nests too deep to check that its integers are kept exactly") from None


# orjson reads 1024 levels of objects and arrays but writes 254, and a record travels inside other
# JSON (a query's answer, a held view event, a CLI line): records may nest 200 levels, which leaves
# room for those and is far more than data needs.
MAX_NESTING = 200


def check_nesting(record: dict) -> None:
    """Raise InputError when objects and arrays in `record` nest deeper than MAX_NESTING."""
    todo = [(record, 1)]
    while todo:
        value, level = todo.pop()
        if level > MAX_NESTING:
            raise InputError(f"value nests objects and arrays deeper than {MAX_NESTING} levels")
        children = value.values() if isinstance(value, dict) else value
        todo += [(child, level + 1) for child in children if isinstance(child, (dict, list))]


class JsonCodec:
    name = encoding = "json"
    trims_deltas = False

    def decode(self, data: bytes) -> dict:
        try:
            record = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise InputError(f"value is not valid JSON: {exc}") from None
        check_integers(data)
        if not isinstance(record, dict):
            raise InputError(f"value must be a JSON object, got {type(record).__name__}")
        # A record nested MAX_NESTING levels has twice as many brackets: most records are shorter,
        # and pay one comparison (a count costs ~1 ns a byte).
        if len(data) > 2 * MAX_NESTING and data.count(b"{") + data.count(b"[") > MAX_NESTING:
            check_nesting(record)
        return record

    def encode(self, record: dict) -> bytes:
        return orjson.dumps(record)

    def unknown_fields(self, record: dict) -> list[str]:
        return []

    def delta_fields(self, record: dict) -> dict:
        return record


class AvroCodec:
    """Schemaless Avro (the writer's schema comes from the topology), as fastavro reads and writes it.

    Full records use the topology's schema. Partial records (diffs) do not fit a record schema with
    required fields, so `.diff` of an Avro topic carries JSON (documented in the README).
    """

    name = "avro"
    trims_deltas = True

    def __init__(self, schema_path: str | Path):
        import fastavro
        from fastavro import _read_py  # fastavro's pure-Python reader (its own fallback without the C extension)

        from processor.core.avro import converters, wire_check, without_logical_types, writer_schema

        self._fastavro = fastavro
        try:
            raw = json.loads(Path(schema_path).read_text())
            named: dict = {}
            self.schema = fastavro.parse_schema(raw, named_schemas=named)
        except OSError as exc:
            raise ConfigError(f"cannot read the Avro schema {schema_path}: {exc.strerror or exc}") from None
        except (ValueError, TypeError, KeyError, AttributeError, fastavro.schema.SchemaParseException) as exc:  # JSON, UTF-8, schema
            raise ConfigError(f"the Avro schema {schema_path} is not a valid schema: {exc}") from None
        # Read without logical types, so values are the JSON ones a store keeps (processor.core.avro).
        wire_named: dict = {}
        self._wire = fastavro.parse_schema(without_logical_types(raw), named_schemas=wire_named)
        try:
            self._to_core, self._to_avro, named_branches = converters(self.schema, named)
            containers, recursive = _schema_shape(self.schema, named)
        except ConfigError as exc:
            raise ConfigError(f"the Avro schema {schema_path}: {exc}") from None
        # A value longer than this may nest deep enough to overflow the C reader's stack (_C_READER_LEVELS).
        self._c_reader_bytes = _C_READER_LEVELS // containers if recursive else sys.maxsize
        self._check_wire = wire_check(self._wire, wire_named)
        self._writer_schema = writer_schema(self.schema, named)
        # Avro's Parsing Canonical Form: what decides the bytes (not docs, defaults, aliases).
        self.encoding = "avro " + fastavro.schema.to_parsing_canonical_form(self.schema)
        # A union of several records and maps (all dicts) is read with its named branch's name, which
        # its converter takes off: the C reader and the Python one alike.
        self._c_reader, self._python_reader = fastavro.schemaless_reader, _read_py.schemaless_reader
        if named_branches:
            self._c_reader, self._python_reader = (functools.partial(read, return_named_type=True)
                                                   for read in (self._c_reader, self._python_reader))

    def decode(self, data: bytes) -> dict:
        buffer = io.BytesIO(data)
        # fastavro's C reader recurses without a check, into a segfault past ~9,000 records, arrays,
        # maps and unions deep: a long value of a recursive schema goes to its Python reader, which
        # stops at Python's recursion limit (RecursionError).
        read = self._c_reader if len(data) <= self._c_reader_bytes else self._python_reader
        try:
            self._check_wire(data)  # bytes fastavro would read as another value
            record = read(buffer, self._wire, None)
        except RecursionError:
            raise InputError(_TOO_DEEP) from None
        except Exception as exc:  # fastavro raises many types for malformed bytes
            why = str(exc) or ("it ends too soon" if isinstance(exc, EOFError) else type(exc).__name__)
            raise InputError(f"value is not valid Avro for the topic schema: {why}{_wire_format_hint(data)}") from None
        if (left := len(data) - buffer.tell()) > 0:  # a value of another schema, or of another framing
            raise InputError(f"value is not a record of the topic's Avro schema: {left} bytes left after it{_wire_format_hint(data)}")
        try:
            record = self._to_core(record) if self._to_core else record
        except RecursionError:  # the converters of a recursive schema recurse a few frames a level
            raise InputError(_TOO_DEEP) from None
        if not isinstance(record, dict):  # after the converters: a union's record may be read as (name, record)
            raise InputError("Avro value must be a record")
        return record

    def encode(self, record: dict) -> bytes:
        out = io.BytesIO()
        try:
            self._fastavro.schemaless_writer(out, self._writer_schema, self._to_avro(record) if self._to_avro else record)
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:  # fastavro's refusals of a value
            raise InputError(f"the record does not fit the topic's Avro schema: {exc}") from None
        return out.getvalue()

    def check(self, record: dict) -> None:
        """InputError unless fastavro's validation takes `record` as a value of the schema: outside a
        union its writer writes int(value) to an int or long (1.5 as 1, True as 1), which a union
        refuses. For what a client publishes: a worker writes only values it read."""
        from fastavro.validation import ValidationError, validate

        try:
            validate(self._to_avro(record) if self._to_avro else record, self._writer_schema, raise_errors=True)
        except ValidationError as exc:
            raise InputError(f"the record does not fit the topic's Avro schema: {'; '.join(map(str, exc.errors))}") from None

    def unknown_fields(self, record: dict) -> list[str]:
        """Paths of the fields of `record` that the schema lacks: the writer would drop them."""
        return _unknown_fields(self.schema, record, "")

    def delta_fields(self, record: dict) -> dict:
        """An Avro record always carries every field: in a delta, null means "not sent"."""
        return {k: self.delta_fields(v) if isinstance(v, dict) else v for k, v in record.items() if v is not None}


# fastavro's C reader takes ~850 bytes of C stack for each record, array, map and union it is in,
# unchecked: ~9,000 of them overflow an 8 MB stack (measured: a linked list 4,600 deep, a chain of 4
# records and a union 2,100). A value of a recursive schema goes a level deeper for at least one
# byte (a union's index, an array's or a map's count), through at most every one of the schema's
# records, arrays, maps and unions: a value of at most _C_READER_LEVELS // (their number) bytes
# keeps the C reader under _C_READER_LEVELS of them, a fifth of what overflows.
_C_READER_LEVELS = 2_000
_TOO_DEEP = "value nests too deep for the topic's recursive Avro schema"


def _schema_shape(schema, named: dict) -> tuple[int, bool]:
    """(how many records, arrays, maps and unions the parsed `schema` has, whether a named type in it
    holds itself); ConfigError on an array whose items take no bytes: such an array is a count
    alone, and a value of a dozen bytes could claim 2**62 items that fastavro would append forever."""
    containers, recursive, open_names = 0, False, []

    def walk(node, at: str, bare: int) -> None:
        # open_names[bare:]: the records entered since the last union, array or map (none of which
        # a value passes without a byte)
        nonlocal containers, recursive
        if isinstance(node, str):
            recursive = recursive or node in open_names  # a reference to a type being defined
            if node in open_names[bare:]:
                raise ConfigError(f"{at or '/'}: the record {node} holds itself through record fields alone (no union, "
                                  "array or map on the way): it has no finite value, and reading one could recurse without "
                                  "reading a byte until the reader's stack overflows (make the field a union with null)")
        elif isinstance(node, list):
            containers += 1
            for branch in node:
                walk(branch, at, len(open_names))
        elif node["type"] in ("record", "error"):
            containers += 1
            open_names.append(node["name"])
            for field in node["fields"]:
                walk(field["type"], f"{at}/{field['name']}", bare)
            open_names.pop()
        elif node["type"] == "array":
            containers += 1
            if _takes_no_bytes(node["items"], named, ()):
                raise ConfigError(f"{at or '/'}: an array of items that take no bytes (null, a fixed of size 0, "
                                  "a record of only such fields) is a count alone, which a value could make any number")
            walk(node["items"], at + "[]", len(open_names))
        elif node["type"] == "map":
            containers += 1
            walk(node["values"], at, len(open_names))

    walk(schema, "", 0)
    return max(containers, 1), recursive


def _takes_no_bytes(schema, named: dict, seen: tuple) -> bool:
    """Whether a value of the parsed `schema` is written as no bytes at all."""
    if isinstance(schema, str):
        if schema in named:
            return schema not in seen and _takes_no_bytes(named[schema], named, seen + (schema,))
        return schema == "null"
    if isinstance(schema, list):  # a union writes its branch's index
        return False
    kind = schema["type"]
    if kind in ("record", "error"):
        return all(_takes_no_bytes(f["type"], named, seen + (schema["name"],)) for f in schema["fields"])
    return kind == "null" or (kind == "fixed" and schema["size"] == 0)


def _wire_format_hint(data: bytes) -> str:
    """What a value that starts as Confluent's serializers frame Avro most likely is."""
    if len(data) > 5 and data[0] == 0:
        return (f" (it starts as Confluent's wire format does: magic byte 0, schema id {int.from_bytes(data[1:5], 'big')}; "
                "ksow reads plain schemaless Avro written with the topic's schema)")
    return ""


def _unknown_fields(schema, value, at: str) -> list[str]:
    if isinstance(schema, list):  # a union: look into its record branch when there is just one
        records = [branch for branch in schema if isinstance(branch, dict) and branch.get("type") == "record"]
        return _unknown_fields(records[0], value, at) if len(records) == 1 else []
    if not (isinstance(schema, dict) and schema.get("type") == "record" and isinstance(value, dict)):
        return []
    fields = {f["name"]: f["type"] for f in schema["fields"]}
    out = []
    for name, inner in value.items():
        out += _unknown_fields(fields[name], inner, f"{at}/{name}") if name in fields else [f"{at}/{name}"]
    return out


def codec_for(message_type: str, schema: str | None = None, base: Path | None = None) -> Codec:
    if message_type == "json":
        return JsonCodec()
    if message_type == "avro":
        path = Path(schema or "")
        if not path.is_absolute() and base is not None:
            path = base / path
        return AvroCodec(path)
    raise ValueError(f"unknown message_type {message_type!r}")
