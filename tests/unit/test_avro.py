"""The Avro message type: records in and out through fastavro with the topology's schema."""

import io
import itertools
import re
import struct
import subprocess
import sys
from pathlib import Path

import fastavro
import orjson
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from processor.contract.errors import ConfigError, InputError
from processor.core.codec import AvroCodec
from processor.core.keys import owner_partition
from processor.contract.types import InputMessage
from processor.testing import LocalTopic
from processor.topology import parse_topology

SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "orders.avsc"


def encode(record):
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(orjson.loads(SCHEMA.read_bytes())), record)
    return out.getvalue()


def test_codec_round_trip_and_errors():
    codec = AvroCodec(SCHEMA)
    record = {"order_id": 7, "customer": "ann", "status": "open", "qty": 5, "px": 1.5}
    assert codec.decode(codec.encode(record)) == record
    with pytest.raises(InputError, match="not valid Avro"):
        codec.decode(b"\xff\xff\xff")


def test_an_empty_value_says_why_it_is_not_avro():
    with pytest.raises(InputError, match="not valid Avro for the topic schema: it ends too soon"):
        AvroCodec(SCHEMA).decode(b"")


def test_fields_the_schema_lacks_are_named_nested_ones_too(tmp_path):
    nested = tmp_path / "nested.avsc"
    nested.write_text(orjson.dumps({"type": "record", "name": "T", "fields": [
        {"name": "id", "type": "long"},
        {"name": "leg", "type": ["null", {"type": "record", "name": "Leg", "fields": [{"name": "px", "type": "double"}]}]},
    ]}).decode())
    assert AvroCodec(SCHEMA).unknown_fields({"order_id": 1, "status": "x", "bogus": 1}) == ["/bogus"]
    assert AvroCodec(nested).unknown_fields({"id": 1, "leg": {"px": 1.0, "qty": 2}, "x": None}) == ["/leg/qty", "/x"]
    assert AvroCodec(nested).unknown_fields({"id": 1, "leg": None}) == []


def test_the_client_refuses_a_field_the_avro_schema_would_drop():
    from processor.client.sow_client import Client, ClientError

    topology = parse_topology({"sow": [{"topic": "av", "key": ["/order_id"], "message_type": "avro", "schema": str(SCHEMA)}]})
    client = Client("127.0.0.1:1", topology)
    with pytest.raises(ClientError, match=r"/bogus not in the Avro schema of av"):
        client.publish("av", {"order_id": 2, "status": "open", "bogus": 1})
    assert client._producer is None


def test_an_avro_record_deeper_than_json_output_carries_goes_to_errors(tmp_path):
    """A recursive schema can nest a record past the 254 levels orjson writes: its `.diff` (JSON)
    cannot be written, so the input is refused with the reason, not parked as an internal error."""
    schema = {"type": "record", "name": "Node", "fields": [{"name": "id", "type": "long"}, {"name": "next", "type": ["null", "Node"]}]}
    path = tmp_path / "node.avsc"
    path.write_text(orjson.dumps(schema).decode())
    spec = parse_topology({"sow": [{"topic": "nodes", "key": ["/id"], "partitions": 1, "message_type": "avro", "schema": str(path)}]}).topic("nodes")
    node = None
    for i in range(300):
        node = {"id": i, "next": node}
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), node)
    proc = LocalTopic(spec, tmp_path / "state")
    sent = proc.handle([InputMessage("nodes", 0, 0, b"k", out.getvalue(), [], 1_000)], now=5_000)
    assert [r.topic for r in sent] == ["nodes.errors"]
    assert b"objects and arrays nest at most 254 levels deep" in dict(sent[0].headers)["sow-error"]


def test_avro_topic_merges_deltas(tmp_path):
    spec = parse_topology({"sow": [{"topic": "ao", "key": ["/order_id"], "message_type": "avro", "schema": str(SCHEMA), "partitions": 2}]}).topic("ao")
    proc = LocalTopic(spec, tmp_path)
    full = {"order_id": 7, "customer": "ann", "status": "open", "qty": 5, "px": 1.5}
    p = owner_partition(spec.key_spec.sow_key(full), 2)
    proc.handle([InputMessage("ao", p, 0, None, encode(full), [], 1)], now=1)
    proc.commit(p)
    # An Avro record carries every field: in a delta, null means "not sent", so it leaves the field as it is.
    delta = {"order_id": 7, "customer": None, "status": "filled", "qty": None, "px": None}
    out = proc.handle([InputMessage("ao.delta", p, 1, None, encode(delta), [], 2)], now=2)
    sow = [r for r in out if r.topic == "ao.sow"][0]
    assert AvroCodec(SCHEMA).decode(sow.value) == {**full, "status": "filled"}
    assert orjson.loads([r for r in out if r.topic == "ao.diff"][0].value) == {"order_id": 7, "status": "filled"}


RICH = {"type": "record", "name": "Trade", "fields": [
    {"name": "id", "type": "long"},
    {"name": "at", "type": ["null", {"type": "long", "logicalType": "timestamp-millis"}], "default": None},
    {"name": "day", "type": ["null", {"type": "int", "logicalType": "date"}], "default": None},
    {"name": "ref", "type": ["null", {"type": "string", "logicalType": "uuid"}], "default": None},
    {"name": "amt", "type": ["null", {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}], "default": None},
    {"name": "tag", "type": ["null", {"type": "fixed", "name": "Tag", "size": 2}], "default": None},
    {"name": "blob", "type": ["null", "bytes"], "default": None},
    {"name": "legs", "type": {"type": "array", "items": {"type": "record", "name": "Leg", "fields": [
        {"name": "px", "type": "double"}, {"name": "fee", "type": {"type": "fixed", "name": "Fee", "size": 4, "logicalType": "decimal", "precision": 8, "scale": 3}}]}}, "default": []},
    {"name": "status", "type": ["null", "string"], "default": None}]}


def test_avro_logical_types_bytes_and_decimals_survive_the_store_as_json_values(tmp_path):
    """The store keeps records as JSON: an Avro record is read as Avro's JSON encoding has it
    (logical types as their numbers, bytes as code points 0-255, decimals as their text), so a delta
    applied to a restored record still writes `.sow` in the schema. Before, bytes and decimals went
    to `.errors`, and a delta to a stored timestamp failed as an internal error."""
    import datetime
    import decimal
    import uuid

    path = tmp_path / "trade.avsc"
    path.write_text(orjson.dumps(RICH).decode())
    spec = parse_topology({"sow": [{"topic": "tr", "key": ["/id"], "partitions": 1, "message_type": "avro", "schema": str(path)}]}).topic("tr")
    parsed = fastavro.parse_schema(RICH)

    def avro(record: dict) -> bytes:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, parsed, record)
        return out.getvalue()

    ref = uuid.UUID(int=7)
    at = datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    full = {"id": 1, "at": at, "day": datetime.date(2024, 1, 2), "ref": ref, "amt": decimal.Decimal("-12.34"),
            "tag": b"\x00\xff", "blob": b"\x01z", "legs": [{"px": 1.5, "fee": decimal.Decimal("0.125")}], "status": "open"}
    proc = LocalTopic(spec, tmp_path / "state")
    out = proc.handle([InputMessage("tr", 0, 0, None, avro(full), [], 1_000)], now=1_000)
    assert [r.topic for r in out] == ["tr.sow", "tr.diff"], out
    assert orjson.loads(out[1].value) == {"id": 1, "at": 1704164645000, "day": 19724, "ref": str(ref), "amt": "-12.34", "tag": "\x00\xff",
                                          "blob": "\x01z", "legs": [{"px": 1.5, "fee": "0.125"}], "status": "open"}
    assert out[0].value == avro(full)  # `.sow` carries the same Avro bytes
    proc.commit(0)
    proc.close()
    restored = LocalTopic(spec, tmp_path / "state")
    delta = {**{k: None for k in full}, "id": 1, "status": "done", "legs": []}
    out = restored.handle([InputMessage("tr.delta", 0, 1, None, avro(delta), [], 2_000)], now=2_000)
    assert [r.topic for r in out] == ["tr.sow", "tr.diff"], out
    assert out[0].value == avro({**full, "status": "done", "legs": []})
    assert AvroCodec(path).decode(out[0].value)["amt"] == "-12.34"
    nan = restored.handle([InputMessage("tr", 0, 2, None, avro({**full, "id": 2, "legs": [{"px": float("nan"), "fee": decimal.Decimal("0")}]}), [], 3_000)], now=3_000)
    assert [r.topic for r in nan] == ["tr.errors"]
    assert dict(nan[0].headers)["sow-error"] == b"/legs[]/px: nan has no JSON form (NaN and infinite numbers are refused)"


def test_the_client_publishes_avro_logical_values_and_keys_them_as_the_worker_reads_them(tmp_path):
    import datetime
    import decimal

    from processor.client.sow_client import Client, ClientError

    path = tmp_path / "trade.avsc"
    path.write_text(orjson.dumps({**RICH, "fields": [{"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}}, *RICH["fields"][1:]]}).decode())
    topology = parse_topology({"sow": [{"topic": "tr", "key": ["/at"], "message_type": "avro", "schema": str(path)}]})
    client = Client("127.0.0.1:1", topology)
    at = datetime.datetime(2024, 1, 2, tzinfo=datetime.timezone.utc)
    value, data = client._encode(topology.topic("tr"), {"at": at, "amt": "12.5", "blob": "\x00\xff"})
    assert data["at"] == 1704153600000 and data["amt"] == "12.50" and data["blob"] == "\x00\xff"
    assert client._encode(topology.topic("tr"), {"at": 1704153600000, "amt": decimal.Decimal("12.50"), "blob": b"\x00\xff"})[0] == value
    assert topology.topic("tr").key_spec.sow_key(data) == topology.topic("tr").key_spec.sow_key({"at": 1704153600000})
    with pytest.raises(ClientError, match=r"/amt: 'lots' is not a decimal number"):
        client._encode(topology.topic("tr"), {"at": 1, "amt": "lots"})
    for nan in (decimal.Decimal("NaN"), "Infinity"):
        with pytest.raises(ClientError, match=r"/amt: .* is not a decimal number"):
            client._encode(topology.topic("tr"), {"at": 1, "amt": nan})
    with pytest.raises(ClientError, match=r"/blob: a bytes value is a string of code points 0-255"):
        client._encode(topology.topic("tr"), {"at": 1, "blob": "€"})


def test_an_avro_value_with_bytes_left_over_goes_to_errors_naming_confluent_framing():
    """Confluent's serializers put a magic byte 0 and a 4-byte schema id before the record: read as
    plain Avro it decoded to a made-up record (order 0, px 4.8e180), and two of them overwrote each
    other without a word. Any bytes left after the record now refuse the value (this one is refused
    before: read as plain Avro, its fifth byte is a union's branch index -1)."""
    codec = AvroCodec(SCHEMA)
    good = encode({"order_id": 301, "status": "open"})
    with pytest.raises(InputError, match=r"\(it starts as Confluent's wire format does: magic byte 0, schema id 1;"):
        codec.decode(b"\x00" + (1).to_bytes(4, "big") + good)
    with pytest.raises(InputError, match=r"8 bytes left after it$"):
        codec.decode(good + b"trailing")
    assert codec.decode(good)["order_id"] == 301


@pytest.mark.parametrize("text", ["12345678901234567890123456789012.345678", "-0.000001", "0.000000", "7.000000"])
def test_a_decimal_reads_as_its_exact_text_at_any_precision(tmp_path, text):
    import decimal

    schema = {"type": "record", "name": "D", "fields": [{"name": "id", "type": "long"},
              {"name": "amt", "type": {"type": "bytes", "logicalType": "decimal", "precision": 38, "scale": 6}}]}
    path = tmp_path / "d.avsc"
    path.write_text(orjson.dumps(schema).decode())
    codec = AvroCodec(path)
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), {"id": 1, "amt": decimal.Decimal(text)})
    assert codec.decode(out.getvalue())["amt"] == text
    assert codec.encode({"id": 1, "amt": text}) == out.getvalue()


def test_an_avro_delta_on_no_record_stores_what_sow_carries(tmp_path):
    """The delta's fields alone were kept, while `.sow` carried every field (nulls for those not
    sent): a query changed its answer once a worker restored the partition from `.sow`."""
    spec = parse_topology({"sow": [{"topic": "ao", "key": ["/order_id"], "message_type": "avro", "schema": str(SCHEMA), "partitions": 1}]}).topic("ao")
    proc = LocalTopic(spec, tmp_path)
    delta = {"order_id": 5, "customer": None, "status": None, "qty": 50, "px": 1.25}
    out = proc.handle([InputMessage("ao.delta", 0, 0, None, encode(delta), [], 1)], now=1)
    stored = proc.stores[0].get(spec.key_spec.sow_key(delta)).data
    assert stored == AvroCodec(SCHEMA).decode(out[0].value) == delta
    assert orjson.loads(out[1].value) == delta


def test_an_avro_topic_s_diff_carries_json_for_removals_too(tmp_path):
    """`.diff` of an Avro topic carries JSON (README): its delete, expire and evict events carried
    the record in Avro, so a reader of `.diff` had to pick a decoder by sow-op. `EXP.` and `.dead`
    keep the record as it was, in Avro."""
    spec = parse_topology({"sow": [{"topic": "ao", "key": ["/order_id"], "message_type": "avro", "schema": str(SCHEMA),
                                    "partitions": 1, "expiration": "1s", "capacity": 1}]}).topic("ao")
    proc = LocalTopic(spec, tmp_path)
    first, second = ({"order_id": n, "customer": "ann", "status": "open", "qty": 5, "px": 1.5} for n in (1, 2))
    proc.handle([InputMessage("ao", 0, 0, None, encode(first), [], 1_000)], now=1_000)
    out = proc.handle([InputMessage("ao", 0, 1, None, encode(second), [], 1_500)], now=1_500)  # evicts the first record
    out += proc.handle([InputMessage("ao", 0, 2, None, encode(second), [("sow-command", b"sow_delete")], 1_600)], now=1_600)
    out += proc.handle([InputMessage("ao", 0, 3, None, encode(first), [], 1_700)], now=1_700)
    proc.commit()
    out += proc.expire_due(0, 5_000)
    removals = [(r.topic, dict(r.headers)["sow-op"], r.value) for r in out if r.value is not None and dict(r.headers)["sow-op"] != b"insert"]
    codec = AvroCodec(SCHEMA)
    assert [(topic, op, orjson.loads(value) if topic == "ao.diff" else codec.decode(value)) for topic, op, value in removals] == [
        ("ao.diff", b"evict", first), ("ao.dead", b"evict", first), ("ao.diff", b"delete", second),
        ("ao.diff", b"expire", first), ("EXP.ao", b"expire", first)]


def test_a_union_writes_a_plain_value_to_its_plain_branch(tmp_path):
    """A number in a union of a long and a decimal stays a long, a string in a union of a string and
    bytes stays a string: only values no plain branch takes are converted."""
    schema = {"type": "record", "name": "U", "fields": [{"name": "id", "type": "long"},
              {"name": "n", "type": ["null", "long", {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2}]},
              {"name": "s", "type": ["null", "string", "bytes"]}]}
    path = tmp_path / "u.avsc"
    path.write_text(orjson.dumps(schema).decode())
    codec = AvroCodec(path)
    assert codec.decode(codec.encode({"id": 1, "n": 5, "s": "x"})) == {"id": 1, "n": 5, "s": "x"}
    assert codec.decode(codec.encode({"id": 1, "n": "5.25", "s": None})) == {"id": 1, "n": "5.25", "s": None}


@pytest.mark.parametrize("union, values", [
    ([{"type": "array", "items": "int"}, "bytes"], ["\x01", "", "\x01\x02", [1, 2], []]),
    ([{"type": "enum", "name": "E", "symbols": ["AB"]}, {"type": "fixed", "name": "F", "size": 3}], ["AB", "XYZ"]),
    (["null", {"type": "array", "items": "long"}, {"type": "fixed", "name": "G", "size": 1}, "string"], ["\x05", "text", [5], None]),
])
def test_a_string_in_a_union_of_bytes_with_an_array_or_an_enum_is_written_back_to_its_own_branch(tmp_path, union, values):
    """fastavro writes bytes to an earlier array branch ("\\x01" came back as [1], "" as []) and
    could not write a symbol beside a fixed of another size once it was made bytes (refused): such
    a string goes to the first branch it is a value of, taken as it is before converted."""
    schema = {"type": "record", "name": "R", "fields": [{"name": "u", "type": union}]}
    path = tmp_path / "u.avsc"
    path.write_text(orjson.dumps(schema).decode())
    codec = AvroCodec(path)
    for value in values:
        assert codec.decode(codec.encode({"u": value})) == {"u": value}


@pytest.mark.parametrize("union, value", [(["null", "float", "int"], 16_777_217), (["null", "float", "int"], 5),
                                          (["double", {"type": "long"}], 2**60 + 1), (["float", "int", "long"], 2**40)])
def test_a_whole_number_in_a_union_with_a_float_before_its_int_is_written_to_the_int(tmp_path, union, value):
    """fastavro writes an int to the first branch that takes it, and a float takes any: 16777217 came
    back as 16777216.0 (and 5 as 5.0), found by the round-trip property."""
    schema = {"type": "record", "name": "R", "fields": [{"name": "n", "type": union}]}
    path = tmp_path / "n.avsc"
    path.write_text(orjson.dumps(schema).decode())
    codec = AvroCodec(path)
    read = codec.decode(codec.encode({"n": value}))["n"]
    assert read == value and type(read) is int


@pytest.mark.parametrize("union, written, values", [
    ([{"type": "map", "values": "bytes"}, {"type": "record", "name": "T", "fields": [{"name": "ok", "type": "boolean"}]}],
     [("map", {"ok": b"\x01"}), ("T", {"ok": False})], [{"ok": False}, {"ok": "\xff"}, {}, {"ok": "x", "no": ""}]),
    ([{"type": "record", "name": "A", "fields": [{"name": "x", "type": "bytes"}]}, {"type": "record", "name": "B", "fields": [{"name": "x", "type": "string"}]},
      {"type": "record", "name": "C", "fields": [{"name": "x", "type": "bytes"}, {"name": "y", "type": ["null", "A", "B"]}]}],
     [("A", {"x": b"\xff"}), ("B", {"x": "s"}), ("C", {"x": b"", "y": ("B", {"x": "\u20ac"})})],
     [{"x": "s"}, {"x": "\u20ac"}, {"x": "\xff", "y": {"x": "\u20ac"}}, {"x": "", "y": None}]),
])
def test_a_union_of_records_and_maps_reads_each_branch_as_its_own_and_writes_it_back(tmp_path, union, written, values):
    """fastavro reads a map and records alike (dicts): a value of one branch was converted by another's
    converter ('bool' object has no attribute 'decode', on .errors). They are read with the branch's
    name, by both of fastavro's readers, and written to the first branch the value fits."""
    schema = {"type": "record", "name": "R", "fields": [{"name": "u", "type": union}]}
    path = tmp_path / "u.avsc"
    path.write_text(orjson.dumps(schema).decode())
    codec, python_reader = AvroCodec(path), AvroCodec(path)
    python_reader._c_reader_bytes = -1  # every value to fastavro's Python reader
    parsed = fastavro.parse_schema(schema)
    for value in written:  # (branch, value): fastavro's tuple notation
        out = io.BytesIO()
        fastavro.schemaless_writer(out, parsed, {"u": value})
        read = _as_json(fastavro.schemaless_reader(io.BytesIO(out.getvalue()), parsed, None))
        assert codec.decode(out.getvalue()) == python_reader.decode(out.getvalue()) == read
        assert codec.decode(codec.encode(read)) == read
    for value in values:
        data = codec.encode({"u": value})
        assert codec.decode(data) == python_reader.decode(data) == {"u": value}


@pytest.mark.parametrize("union, why", [
    ([{"type": "map", "values": "bytes"}, {"type": "map", "values": "string"}], "a union with more than one map"),
    (["string", "null", "string"], "a union with more than one string"),
    (["bytes", {"type": "fixed", "name": "F", "size": 2, "logicalType": "decimal", "precision": 4, "scale": 2}], "a union of a decimal and other bytes or fixed"),
])
def test_a_union_whose_branches_nothing_tells_apart_is_refused_with_the_schema(tmp_path, union, why):
    path = tmp_path / "u.avsc"
    path.write_text(orjson.dumps({"type": "record", "name": "R", "fields": [{"name": "u", "type": union}]}).decode())
    with pytest.raises(ConfigError, match=f"/u: {why}"):
        AvroCodec(path)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out) + bytes([n])


def _unsigned(v: int) -> int:  # zig-zag
    return 2 * v if v >= 0 else -2 * v - 1


def _zigzag(n: int) -> bytes:
    """An Avro long as it is written (zig-zag varint), for hand-made values."""
    return _varint(_unsigned(n))


NODE = {"type": "record", "name": "Node", "fields": [{"name": "id", "type": "long"}, {"name": "next", "type": ["null", "Node"]}]}


def test_an_avro_value_of_a_recursive_schema_nesting_thousands_deep_goes_to_errors_not_down_with_the_worker(tmp_path):
    """fastavro's C reader recurses once a level without a check: ~4,600 levels of a linked list
    (9 KB) overflow the C stack and kill the process (SIGSEGV). Run in a child process: the test
    must see the crash, not be it."""
    path = tmp_path / "node.avsc"
    path.write_text(orjson.dumps(NODE).decode())
    child = f"""
from processor.contract.errors import InputError
from processor.core.codec import AvroCodec
codec = AvroCodec({str(path)!r})
for depth in (400, 5_000, 100_000):
    try:
        codec.decode(b"\\x02\\x02" * depth + b"\\x02\\x00")
        print(depth, "read", flush=True)
    except Exception as exc:
        print(depth, type(exc).__name__, "nests too deep" in str(exc), flush=True)
"""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60, cwd=SCHEMA.parents[1])
    assert done.returncode == 0, f"the decoding process died ({done.returncode}): {done.stdout!r} {done.stderr[-500:]!r}"
    assert done.stdout.split("\n")[:3] == ["400 InputError True", "5000 InputError True", "100000 InputError True"], done.stdout


def test_a_large_shallow_value_of_a_recursive_schema_reads_as_a_small_one(tmp_path):
    path = tmp_path / "node.avsc"
    path.write_text(orjson.dumps(NODE).decode())
    node = None
    for i in range(120):  # 10-byte ids: ~1.3 KB
        node = {"id": (1 << 62) + i, "next": node}
    codec = AvroCodec(path)
    data = codec.encode(node)
    assert len(data) > 1_000
    assert codec.decode(data) == node


@pytest.mark.parametrize("items", ["null", {"type": "fixed", "name": "Nothing", "size": 0}, {"type": "record", "name": "Empty", "fields": []},
                                   {"type": "record", "name": "Nulls", "fields": [{"name": "n", "type": "null"}]}])
def test_an_array_of_items_that_take_no_bytes_is_refused_with_the_schema(tmp_path, items):
    """Such an array is a count alone: a value of a dozen bytes claiming 2**62 items would keep a
    worker appending them (no byte read, no end) until its memory ran out."""
    schema = {"type": "record", "name": "R", "fields": [{"name": "id", "type": "long"}, {"name": "marks", "type": {"type": "array", "items": items}}]}
    path = tmp_path / "r.avsc"
    path.write_text(orjson.dumps(schema).decode())
    with pytest.raises(ConfigError, match=r"/marks: an array of items that take no bytes"):
        AvroCodec(path)


def test_a_map_of_nulls_and_an_array_of_unions_are_read_as_usual(tmp_path):
    """A map's keys and a union's branch index take bytes: a count cannot outrun the value."""
    schema = {"type": "record", "name": "R", "fields": [{"name": "m", "type": {"type": "map", "values": "null"}},
                                                        {"name": "a", "type": {"type": "array", "items": ["null", "long"]}}]}
    path = tmp_path / "r.avsc"
    path.write_text(orjson.dumps(schema).decode())
    codec = AvroCodec(path)
    assert codec.decode(codec.encode({"m": {"x": None}, "a": [None, 1]})) == {"m": {"x": None}, "a": [None, 1]}
    with pytest.raises(InputError, match="ends too soon"):
        codec.decode(_zigzag(1 << 62) + _zigzag(0) + _zigzag(0))


def test_a_decimal_with_more_digits_than_its_precision_is_an_input_error(tmp_path):
    """A megabyte of decimal bytes made Python refuse the integer's text (ValueError: an "internal
    error" on `.errors`); any value past the schema's precision is not of the schema."""
    schema = {"type": "record", "name": "R", "fields": [{"name": "amt", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}}]}
    path = tmp_path / "r.avsc"
    path.write_text(orjson.dumps(schema).decode())
    codec = AvroCodec(path)
    widest = (10**12 - 1).to_bytes(6, "big", signed=True)
    assert codec.decode(_zigzag(len(widest)) + widest) == {"amt": "9999999999.99"}
    for size in (8, 1 << 20):
        with pytest.raises(InputError, match=r"/amt: a decimal with more digits than the schema's precision \(12\)"):
            codec.decode(_zigzag(size) + b"\x7f" + b"\xff" * (size - 1))


@pytest.mark.parametrize("holder", [
    {"type": "record", "name": "Loop", "fields": [{"name": "self", "type": "Loop"}]},
    {"type": "record", "name": "A", "fields": [{"name": "b", "type": {"type": "record", "name": "B", "fields": [{"name": "a", "type": "A"}]}}]},
])
def test_a_record_that_holds_itself_through_fields_alone_is_refused_with_the_schema(tmp_path, holder):
    """Such a record has no finite value, and fastavro's C reader recurses into it without reading a
    byte: a 2-byte value choosing it in a union was a segfault however short (the byte bound on the C
    reader assumes every level of a recursive value takes a byte)."""
    schema = {"type": "record", "name": "R", "fields": [{"name": "id", "type": "long"}, {"name": "x", "type": ["null", holder]}]}
    path = tmp_path / "r.avsc"
    path.write_text(orjson.dumps(schema).decode())
    with pytest.raises(ConfigError, match=r"/x/(self|b/a): the record (Loop|A) holds itself through record fields alone"):
        AvroCodec(path)
    assert AvroCodec(SCHEMA).decode(AvroCodec(SCHEMA).encode({"order_id": 1})) == {"order_id": 1, "customer": None, "status": None, "qty": None, "px": None}


@pytest.mark.parametrize("precision, unscaled, read", [(12, 10**12 - 1, "9999999999.99"), (12, 10**12, None), (12, 2**40 - 1, None),
                                                       (2, 127, None), (3, 1000, None), (5000, -(10**4400), "-1" + "0" * 4398 + ".00")],
                         ids=["12 digits", "13 digits", "13 digits in 40 bits", "127 in 2", "1000 in 3", "4401 digits in 5000"])
def test_a_decimal_is_read_up_to_its_precision_exactly_at_any_precision(tmp_path, precision, unscaled, read):
    """The bit length let a digit more than the precision through (127 with precision 2, 13 digits
    with 12: refused only when `.sow` was written, by fastavro's own check), and a value of a schema
    whose precision is over 4,300 digits was an internal error (Python refuses such an integer's text)."""
    schema = {"type": "record", "name": "R", "fields": [{"name": "amt", "type": {"type": "bytes", "logicalType": "decimal", "precision": precision, "scale": 2}}]}
    path = tmp_path / "r.avsc"
    path.write_text(orjson.dumps(schema).decode())
    codec = AvroCodec(path)
    raw = unscaled.to_bytes((unscaled.bit_length() + 8) // 8, "big", signed=True)
    if read is None:
        with pytest.raises(InputError, match=rf"/amt: a decimal with more digits than the schema's precision \({precision}\)"):
            codec.decode(_zigzag(len(raw)) + raw)
    else:
        assert codec.decode(_zigzag(len(raw)) + raw) == {"amt": read}


def _codec(tmp_path, fields) -> AvroCodec:
    path = tmp_path / "r.avsc"
    path.write_text(orjson.dumps({"type": "record", "name": "R", "fields": fields}).decode())
    return AvroCodec(path)


def test_a_negative_union_branch_or_enum_index_goes_to_errors_not_to_a_branch_from_the_end(tmp_path):
    """fastavro looks a union's branch and an enum's symbol up with Python's indexing: index -1 of
    ["null", "string", "long"] read the next bytes as the long, and -1 of an enum was its last symbol."""
    schema = {"type": "record", "name": "R", "fields": [{"name": "id", "type": "long"}, {"name": "v", "type": ["null", "string", "long"]},
                                                        {"name": "side", "type": {"type": "enum", "name": "Side", "symbols": ["BUY", "SELL"]}}]}
    path = tmp_path / "r.avsc"
    path.write_text(orjson.dumps(schema).decode())
    spec = parse_topology({"sow": [{"topic": "t", "key": ["/id"], "partitions": 1, "message_type": "avro", "schema": str(path)}]}).topic("t")
    proc = LocalTopic(spec, tmp_path / "state")
    cases = [(_zigzag(-1) + _zigzag(21) + _zigzag(0), b"/v: a union's branch index -1 (the union has 3 branches)"),
             (_zigzag(3) + _zigzag(0), b"/v: a union's branch index 3 (the union has 3 branches)"),
             (_zigzag(0) + _zigzag(-1), b"/side: an enum's index -1 (the enum Side has 2 symbols)")]
    for offset, (tail, why) in enumerate(cases):
        sent = proc.handle([InputMessage("t", 0, offset, None, _zigzag(7) + tail, [], 1_000)], now=1_000)
        assert [r.topic for r in sent] == ["t.errors"], sent
        assert dict(sent[0].headers)["sow-error"] == b"value is not valid Avro for the topic schema: " + why
    assert AvroCodec(path).decode(_zigzag(7) + _zigzag(2) + _zigzag(21) + _zigzag(1)) == {"id": 7, "v": 21, "side": "SELL"}


@pytest.mark.parametrize("fields, data, why", [
    ([{"name": "n", "type": "long"}], b"\x80" * 10 + b"\x01", "/n: a long in more than 10 bytes"),  # read as 32
    ([{"name": "n", "type": "long"}], b"\x80" * 9 + b"\x02", "/n: a long past 64 bits"),  # read as 0
    ([{"name": "s", "type": "string"}], b"\x82" + b"\x80" * 9 + b"\x00ab", "/s: a string's length in more than 10 bytes"),
    ([{"name": "n", "type": "int"}], _zigzag(2**31), "/n: an int past 32 bits"),  # kept as 2147483648
    ([{"name": "n", "type": "int"}], b"\x82\x80\x80\x80\x80\x00", "/n: an int in more than 5 bytes"),
    ([{"name": "b", "type": "boolean"}], b"\x02", "/b: a boolean's byte 2 (Avro writes 0 for false, 1 for true)"),  # read as true
], ids=["long in 11 bytes", "long past 64 bits", "length in 11 bytes", "int past 32 bits", "int in 6 bytes", "boolean 2"])
def test_a_number_past_its_bits_or_bytes_or_a_boolean_past_1_is_refused_not_read_as_another(tmp_path, fields, data, why):
    """fastavro read a varint to its last byte however long (its C reader wrapping past 64 bits),
    kept an int past 32 bits, and took any byte but 0 as true (Java's reader takes 1 alone)."""
    with pytest.raises(InputError, match="^value is not valid Avro for the topic schema: " + re.escape(why) + "$"):
        _codec(tmp_path, fields).decode(data)


def test_the_widest_numbers_and_padded_ones_within_their_bytes_are_read(tmp_path):
    codec = _codec(tmp_path, [{"name": "n", "type": "long"}, {"name": "i", "type": "int"}, {"name": "s", "type": "string"}])
    assert codec.decode(_zigzag(-(2**63)) + _zigzag(2**31 - 1) + _zigzag(0)) == {"n": -(2**63), "i": 2**31 - 1, "s": ""}
    assert codec.decode(b"\x82" + b"\x80" * 8 + b"\x00" + b"\x82\x80\x80\x80\x00" + b"\x84\x00ab") == {"n": 1, "i": 1, "s": "ab"}


# Properties of the wire check over random schemas: records of enums, fixed, arrays, maps, unions,
# references to named types, and records that hold themselves through a union or an array.

SIMPLE = ["boolean", "int", "long", "float", "double", "bytes", "string"]


@st.composite
def schemas(draw) -> tuple[dict, dict]:
    """(a record schema, its named types by name)."""
    names = (f"T{i}" for i in itertools.count())
    named: dict = {}
    open_records = ["Root"]

    def of(depth: int, kind: str | None = None):
        kind = kind or draw(st.sampled_from(SIMPLE + ["enum", "fixed", "itself"] + ["named"] * bool(named)
                                            + (["array", "map", "record", "union"] if depth < 3 else [])))
        if kind in SIMPLE:
            return kind
        if kind == "named":
            return draw(st.sampled_from(sorted(named)))
        if kind == "itself":  # a record being defined, through a union with null or an array
            name = draw(st.sampled_from(open_records))
            return draw(st.sampled_from([["null", name], {"type": "array", "items": name}]))
        if kind == "union":  # of types a union may hold: each once, no union
            union = ["null"] if draw(st.booleans()) else []
            kinds = draw(st.lists(st.sampled_from(SIMPLE + ["enum", "fixed", "array", "map", "record"] + ["named"] * bool(named)),
                                  min_size=1, max_size=3)
                         | st.lists(st.sampled_from(["map", "record"] + ["named"] * bool(named)), min_size=2, max_size=3))  # dicts, read alike
            # each unnamed type once (Avro's rule); records, enums, fixed and named ones any number of times
            kinds = [k for i, k in enumerate(kinds) if k in ("record", "enum", "fixed", "named") or k not in kinds[:i]]
            for branch in kinds:
                if branch != "named":
                    union.append(of(depth + 1, branch))
                elif others := sorted(set(named) - set(map(_name, union))):
                    union.append(draw(st.sampled_from(others)))
            return union
        if kind == "array":
            return {"type": "array", "items": of(depth + 1)}
        if kind == "map":
            return {"type": "map", "values": "null" if draw(st.booleans()) else of(depth + 1)}
        schema = {"type": kind, "name": next(names)}
        if kind == "enum":
            schema["symbols"] = [f"S{i}" for i in range(draw(st.integers(1, 4)))]
        elif kind == "fixed":
            schema["size"] = draw(st.integers(1, 4))
        else:
            open_records.append(schema["name"])
            schema["fields"] = [{"name": f"f{i}", "type": of(depth + 1)} for i in range(draw(st.integers(1, 3)))]
            open_records.pop()
        named[schema["name"]] = schema
        return schema

    root = {"type": "record", "name": "Root", "fields": [{"name": f"f{i}", "type": of(0)} for i in range(draw(st.integers(1, 4)))]}
    named["Root"] = root
    return root, named


def _name(schema) -> str:
    return schema if isinstance(schema, str) else schema.get("name", schema["type"])


def _padded(n: int, size: int) -> bytes:
    """The varint of `n` in `size` bytes (as Avro writers may: its value is the same), or as short as it gets."""
    short = _varint(n)
    return short if len(short) >= size else short[:-1] + bytes([short[-1] | 0x80]) + b"\x80" * (size - len(short) - 1) + b"\x00"


@st.composite
def values(draw, schema, named: dict, depth: int = 0):
    """(bytes as Avro writers may write a value of `schema`: numbers padded, arrays and maps in blocks,
    some with their byte size; the record the codec reads; the value fastavro's writer takes; where
    a number, an index or a boolean is: (start, end, kind, bits, count of the union or enum))."""
    out, spots = bytearray(), []
    deep = depth > 4  # a record that holds itself stops here: its unions are null, its arrays empty

    def number(v: int, bits: int, kind: str = "number", count: int = 0) -> None:
        written = _padded(_unsigned(v), draw(st.integers(1, (bits + 6) // 7)))
        spots.append((len(out), len(out) + len(written), kind, bits, count))
        out.extend(written)

    def nested(inner) -> tuple:
        data, core, value, inner_spots = draw(values(inner, named, depth + 1))
        spots.extend((start + len(out), end + len(out), *rest) for start, end, *rest in inner_spots)
        out.extend(data)
        return core, value

    schema = named.get(schema, schema) if isinstance(schema, str) else schema
    kind = "union" if isinstance(schema, list) else schema if isinstance(schema, str) else schema["type"]
    if kind == "null":
        return b"", None, None, []
    if kind == "boolean":
        v = draw(st.booleans())
        return bytes([v]), v, v, [(0, 1, "boolean", 0, 0)]
    if kind in ("int", "long"):
        bits = 32 if kind == "int" else 64
        v = draw(st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1))
        number(v, bits)
        return bytes(out), v, v, spots
    if kind in ("float", "double"):
        v = draw(st.floats(width=32, allow_nan=False, allow_infinity=False))  # exact in either branch fastavro's writer picks
        return struct.pack("<f" if kind == "float" else "<d", v), v, v, []
    if kind in ("bytes", "string", "fixed"):
        v = draw(st.text() if kind == "string" else st.binary(min_size=schema["size"], max_size=schema["size"]) if kind == "fixed" else st.binary())
        raw = v.encode() if kind == "string" else v
        if kind != "fixed":
            number(len(raw), 64)
        out.extend(raw)
        return bytes(out), v if kind == "string" else v.decode("latin-1"), v, spots
    if kind == "enum":
        i = draw(st.integers(0, len(schema["symbols"]) - 1))
        number(i, 32, "index", len(schema["symbols"]))
        return bytes(out), schema["symbols"][i], schema["symbols"][i], spots
    if kind == "union":
        i = 0 if deep and schema[0] == "null" else draw(st.integers(0, len(schema) - 1))
        number(i, 32, "index", len(schema))
        core, value = nested(schema[i])
        return bytes(out), core, value, spots
    if kind == "record":
        cores, values_ = {}, {}
        for field in schema["fields"]:
            cores[field["name"]], values_[field["name"]] = nested(field["type"])
        return bytes(out), cores, values_, spots
    # an array or a map, in blocks of a count and its items; a negative count has the block's byte size after it
    items = draw(st.lists(st.text(), unique=True, max_size=0 if deep else 3) if kind == "map" else st.lists(st.none(), max_size=0 if deep else 3))
    cores, values_ = ({}, {}) if kind == "map" else ([], [])
    while items:
        block = items[: draw(st.integers(1, len(items)))]
        items = items[len(block):]
        sized = draw(st.booleans())
        number(-len(block) if sized else len(block), 64)
        start, first_spot = len(out), len(spots)
        for key in block:
            if kind == "map":
                number(len(key.encode()), 64)
                out.extend(key.encode())
            core, value = nested(schema["values"] if kind == "map" else schema["items"])
            if kind == "map":
                cores[key], values_[key] = core, value
            else:
                cores.append(core)
                values_.append(value)
        if sized:
            size = _zigzag(len(out) - start)
            out[start:start] = size
            spots[first_spot:] = [(start, start + len(size), "number", 64, 0)] + [(a + len(size), b + len(size), *rest) for a, b, *rest in spots[first_spot:]]
    number(0, 64)
    return bytes(out), cores, values_, spots


def _codec_of(tmp_path_factory, schema: dict) -> AvroCodec:
    path = tmp_path_factory.getbasetemp() / "property.avsc"
    path.write_text(orjson.dumps(schema).decode())
    return AvroCodec(path)


@given(st.data())
def test_a_value_of_any_schema_reads_as_written_by_fastavro_or_with_blocks_and_padded_numbers(tmp_path_factory, data):
    schema, named = data.draw(schemas())
    codec = _codec_of(tmp_path_factory, schema)
    written, record, value, _ = data.draw(values(schema, named))
    assert codec.decode(written) == record
    out = io.BytesIO()
    parsed = fastavro.parse_schema(schema)
    fastavro.schemaless_writer(out, parsed, value)  # it may write a value to another branch (an int as a float)
    assert codec.decode(out.getvalue()) == _as_json(fastavro.schemaless_reader(io.BytesIO(out.getvalue()), parsed, None))


@settings(max_examples=500, deadline=None)  # a union of records and maps in ~1 schema of 16
@given(st.data())
def test_a_value_of_any_schema_is_written_back_as_the_same_value(tmp_path_factory, data):
    """Through the core -> Avro converters and fastavro's writer: a union of records and maps is
    written to a branch that reads back as the same value."""
    schema, named = data.draw(schemas())
    codec = _codec_of(tmp_path_factory, schema)
    _, record, _, _ = data.draw(values(schema, named))
    codec.check(record)  # what the client checks before it publishes: every value the core reads passes
    assert codec.decode(codec.encode(record)) == record


def _as_json(value):
    """A value fastavro read as the codec reads it (bytes as code points 0-255)."""
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_json(v) for v in value]
    return value.decode("latin-1") if isinstance(value, bytes) else value


@given(st.data())
def test_a_number_index_or_boolean_out_of_its_range_anywhere_in_a_value_is_refused(tmp_path_factory, data):
    schema, named = data.draw(schemas())
    codec = _codec_of(tmp_path_factory, schema)
    written, _, _, spots = data.draw(values(schema, named))
    assume(spots)
    start, end, kind, bits, count = data.draw(st.sampled_from(spots))
    if kind == "boolean":
        bad = bytes([data.draw(st.integers(2, 255))])
    elif kind == "index":
        bad = _zigzag(data.draw(st.integers(-(2 ** (bits - 1)), -1) | st.integers(count, 2 ** (bits - 1) - 1)))
    else:
        longest = (bits + 6) // 7
        bad = data.draw(st.integers(0, 2**80).map(lambda n: _padded(n, longest + 1))  # too many bytes
                        | st.integers(2**bits, 2 ** (7 * longest) - 1).map(_varint))  # too many bits
    with pytest.raises(InputError, match="^value is not valid Avro for the topic schema: /"):
        codec.decode(written[:start] + bad + written[end:])


@given(st.data())
def test_any_bytes_read_as_a_record_or_are_refused(tmp_path_factory, data):
    schema, _ = data.draw(schemas())
    codec = _codec_of(tmp_path_factory, schema)
    try:
        assert isinstance(codec.decode(data.draw(st.binary(max_size=64))), dict)
    except InputError:
        pass


@pytest.mark.parametrize("record, why", [
    ({"order_id": 1.5}, r"<1\.5> of type <class 'float'> expected long"),
    ({"order_id": True}, r"<True> of type <class 'bool'> expected long"),
])
def test_the_client_refuses_a_value_the_avro_writer_would_turn_into_another(record, why):
    """Outside a union fastavro writes int(value): {"order_id": 1.5} was published as order_id 1 (and
    replaced that record), True as 1; in a union ["null", "long"] both are refused."""
    from processor.client.sow_client import Client, ClientError

    topology = parse_topology({"sow": [{"topic": "av", "key": ["/order_id"], "message_type": "avro", "schema": str(SCHEMA)}]})
    client = Client("127.0.0.1:1", topology)
    with pytest.raises(ClientError, match=why):
        client.publish("av", record)
    assert client._encode(topology.topic("av"), {"order_id": 2, "qty": 3, "px": 1})[1] == {
        "order_id": 2, "customer": None, "status": None, "qty": 3, "px": 1.0}
    assert client._producer is None
