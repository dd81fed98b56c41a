"""Message types: bytes on Kafka <-> records (dicts) in the core. JSON via orjson, Avro via fastavro."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Protocol

import orjson

from processor.contract.errors import InputError


class Codec(Protocol):
    name: str
    trims_deltas: bool  # whether delta_fields changes anything (the hot path skips the call otherwise)

    def decode(self, data: bytes) -> dict: ...

    def encode(self, record: dict) -> bytes: ...

    def delta_fields(self, record: dict) -> dict:
        """The fields a delta publish actually sends."""
        ...


class JsonCodec:
    name = "json"
    trims_deltas = False

    def decode(self, data: bytes) -> dict:
        try:
            record = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise InputError(f"value is not valid JSON: {exc}") from None
        if not isinstance(record, dict):
            raise InputError(f"value must be a JSON object, got {type(record).__name__}")
        return record

    def encode(self, record: dict) -> bytes:
        return orjson.dumps(record)

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

        self._fastavro = fastavro
        self.schema = fastavro.parse_schema(json.loads(Path(schema_path).read_text()))

    def decode(self, data: bytes) -> dict:
        try:
            record = self._fastavro.schemaless_reader(io.BytesIO(data), self.schema, None)
        except Exception as exc:  # fastavro raises many types for malformed bytes
            raise InputError(f"value is not valid Avro for the topic schema: {exc}") from None
        if not isinstance(record, dict):
            raise InputError("Avro value must be a record")
        return record

    def encode(self, record: dict) -> bytes:
        out = io.BytesIO()
        self._fastavro.schemaless_writer(out, self.schema, record)
        return out.getvalue()

    def delta_fields(self, record: dict) -> dict:
        """An Avro record always carries every field: in a delta, null means "not sent"."""
        return {k: self.delta_fields(v) if isinstance(v, dict) else v for k, v in record.items() if v is not None}


def codec_for(message_type: str, schema: str | None = None, base: Path | None = None) -> Codec:
    if message_type == "json":
        return JsonCodec()
    if message_type == "avro":
        path = Path(schema or "")
        if not path.is_absolute() and base is not None:
            path = base / path
        return AvroCodec(path)
    raise ValueError(f"unknown message_type {message_type!r}")
