"""Stores of an older SowKey rule are found before a worker mixes both rules."""

import hashlib

import orjson
import pytest

from processor.contract.errors import ConfigError
from processor.contract.types import SowRecord
from processor.core.keys import KEY_FORMAT
from processor.state import IndexSpec, open_partition_store
from processor.state.keyformat import KeyFormatError, check_key_format

import processor.state.keyformat as keyformat
from processor.topology import SowTopic

ORDERS = SowTopic(topic="orders", key=["/id"], partitions=4)


def format1_key(domain: str, values: list) -> str:
    """The SowKey rule before key texts: a checksum over the values' JSON, types included."""
    payload = domain.encode() + b"\x1f" + orjson.dumps(values)
    return str(int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "big"))


@pytest.fixture
def store(tmp_path):
    s = open_partition_store("rocksdb", str(tmp_path / "p0"), IndexSpec())
    yield s
    s.close()


def put(store, key: str, data: dict) -> None:
    store.stage(key, SowRecord(data, 1))
    store.commit()


def test_a_store_of_format_1_with_number_keys_is_refused(store):
    put(store, ORDERS.key_spec.sow_key({"id": "a"}), {"id": "a"})
    old = format1_key("orders", [5])
    put(store, old, {"id": 5})
    with pytest.raises(KeyFormatError) as caught:
        list(check_key_format(store, ORDERS, 3, "ksow"))  # run to its end
    message = str(caught.value)
    assert isinstance(caught.value, ConfigError)
    assert message.startswith("orders partition 3: the SOW was written under an older SowKey rule")
    assert f"record {old} now has SowKey {ORDERS.key_spec.sow_key({'id': 5})}" in message
    for step in ("stop every worker of group ksow", "sow/orders", "orders.sow", "--reset-offsets --to-earliest --topic orders --topic orders.delta",
                 "--to-latest --topic orders.repartition"):
        assert step in message
    assert store.key_format() == 1  # not stamped: the next start refuses again


@pytest.mark.parametrize("records", [[], [{"id": "a"}, {"id": "b-2"}]])
def test_stores_whose_keys_did_not_change_are_stamped(tmp_path, records):
    """Empty stores, and string keys (the same under both rules), pass and are scanned only once."""
    path = str(tmp_path / "p0")
    store = open_partition_store("rocksdb", path, IndexSpec())
    for data in records:
        put(store, ORDERS.key_spec.sow_key(data), data)
    list(check_key_format(store, ORDERS, 0, "ksow"))  # run to its end
    store.commit()
    store.close()
    store = open_partition_store("rocksdb", path, IndexSpec())
    assert store.key_format() == KEY_FORMAT
    put(store, "not-a-checksum", {"id": 5})  # a stamped store is trusted: no scan at all
    list(check_key_format(store, ORDERS, 0, "ksow"))  # run to its end
    store.close()


def test_publisher_keyed_topics_never_change(store):
    put(store, "any+Base64/key=", {"whatever": 5})
    list(check_key_format(store, SowTopic(topic="t", partitions=4), 0, "ksow"))  # run to its end
    assert store.dirty  # the stamp waits for the store's next commit


def test_a_store_written_under_another_key_definition_is_refused(store):
    """The topology's key changed from /id to /code under an existing SOW: the worker kept the old
    records beside the new ones (two records for one order, updates that never found theirs)."""
    data = {"id": "a", "code": "x"}
    put(store, ORDERS.key_spec.sow_key(data), data)
    list(check_key_format(store, ORDERS, 0, "ksow"))
    store.commit()
    by_code = SowTopic(topic="orders", key=["/code"], partitions=4)
    with pytest.raises(KeyFormatError) as caught:
        list(check_key_format(store, by_code, 2, "ksow"))
    message = str(caught.value)
    assert message.startswith("orders partition 2: the SOW was written under another key definition than the topology's (key [/code], key_domain orders)")
    assert f"now has SowKey {by_code.key_spec.sow_key(data)}" in message and "Put the former key back in the topology" in message
    assert "--reset-offsets --to-earliest --topic orders --topic orders.delta" in message
    list(check_key_format(store, ORDERS, 0, "ksow"))  # the former key back: no error


def test_a_key_definition_that_gives_the_same_sowkeys_is_stamped_and_not_scanned_again(store, monkeypatch):
    """Another key domain over an empty store changes no SowKey: stamped, and the next start reads
    the stamp instead of the records."""
    other = SowTopic(topic="orders", key=["/id"], key_domain="orders-v2", partitions=4)
    list(check_key_format(store, ORDERS, 0, "ksow"))
    store.commit()
    list(check_key_format(store, other, 0, "ksow"))
    store.commit()
    monkeypatch.setattr(keyformat, "stale_key", lambda store, spec: pytest.fail("scanned again"))
    assert list(check_key_format(store, other, 0, "ksow")) == []


def run(steps):
    """A check generator run to its end: its value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def avro(tmp_path, name: str, *fields: dict, doc: str = ""):
    from processor.core.codec import codec_for

    path = tmp_path / f"{name}.avsc"
    path.write_text(orjson.dumps({"type": "record", "name": "Order", "doc": doc, "fields": [
        {"name": "id", "type": "long"}, {"name": "status", "type": "string"}, *fields]}).decode())
    return codec_for("avro", str(path))


AVRO_ORDERS = SowTopic(topic="orders", key=["/id"], partitions=4, message_type="avro", schema="v2.avsc")


def test_a_changed_encoding_makes_the_partition_write_its_records_again_once(tmp_path, store):
    from processor.core.codec import JsonCodec

    put(store, "k1", {"id": 1, "status": "new"})
    assert run(keyformat.check_encoding(store, ORDERS, JsonCodec(), 0)) is False  # no stamp yet (an earlier release): stamped
    store.commit()
    assert run(keyformat.check_encoding(store, ORDERS, JsonCodec(), 0)) is False
    v1 = avro(tmp_path, "v1")
    assert run(keyformat.check_encoding(store, AVRO_ORDERS, v1, 0)) is True  # json -> avro
    store.commit()
    assert run(keyformat.check_encoding(store, AVRO_ORDERS, v1, 0)) is False
    v2 = avro(tmp_path, "v2", {"name": "qty", "type": "long", "default": 0})
    assert run(keyformat.check_encoding(store, AVRO_ORDERS, v2, 0)) is True  # a field added with a default
    store.commit()
    same_bytes = avro(tmp_path, "v2doc", {"name": "qty", "type": "long", "default": 7}, doc="what an order is")
    assert run(keyformat.check_encoding(store, AVRO_ORDERS, same_bytes, 0)) is False  # docs and defaults do not change the bytes


def test_an_empty_store_is_stamped_without_writing_anything_again(tmp_path, store):
    from processor.core.codec import JsonCodec

    run(keyformat.check_encoding(store, ORDERS, JsonCodec(), 0))
    store.commit()
    assert run(keyformat.check_encoding(store, AVRO_ORDERS, avro(tmp_path, "v1"), 0)) is False
    assert store.meta("encoding") == keyformat.encoding_definition(avro(tmp_path, "v1"))


def test_a_record_the_new_encoding_cannot_write_stops_the_worker_before_anything_is_written(tmp_path, store):
    v1 = avro(tmp_path, "v1")
    put(store, "k1", {"id": 1, "status": "new"})
    run(keyformat.check_encoding(store, AVRO_ORDERS, v1, 2))
    store.commit()
    stamped = store.meta("encoding")
    v2 = avro(tmp_path, "v2", {"name": "qty", "type": "long"})  # required, no default: the records lack it
    with pytest.raises(keyformat.EncodingChangeError) as caught:
        run(keyformat.check_encoding(store, AVRO_ORDERS, v2, 2))
    assert isinstance(caught.value, ConfigError)
    message = str(caught.value)
    assert message.startswith("orders partition 2: the topic's encoding changed (avro, schema v2.avsc) since its records were written to orders.sow")
    assert "its record k1 cannot be written in the new one" in message and "qty" in message
    assert store.meta("encoding") == stamped


def test_a_changed_schema_leaves_the_store_holding_what_the_new_one_reads_back(tmp_path, store, monkeypatch):
    """A field dropped from the Avro schema and one added with a default: the re-seed writes the
    records to `.sow` in the new shape, and the store held the old one until each record changed (a
    query to the worker and a read of `.sow` differed). The store's records are now what the new
    schema reads back, with their event IDs, instants and counts as they were, committed a step at
    a time; the new stamp stays staged (a crash before the re-seed ends projects and re-seeds again)."""
    monkeypatch.setattr(keyformat, "SCAN_STEP", 5)
    v1 = avro(tmp_path, "v1", {"name": "desk", "type": "string", "default": ""})
    run(keyformat.check_encoding(store, AVRO_ORDERS, v1, 0))
    for i in range(12):
        store.stage(f"k{i}", SowRecord({"id": i, "status": "new", "desk": "d"}, 100 + i, 5_000 + i if i % 2 else None, 7 + i))
    store.commit()
    stamped = store.meta("encoding")
    v2 = avro(tmp_path, "v2", {"name": "qty", "type": "long", "default": 0})  # desk dropped, qty added
    assert run(keyformat.check_encoding(store, AVRO_ORDERS, v2, 0)) is True
    store.rollback()  # as a crash before the re-seed's last step: the records' commits stay, the stamp does not
    assert store.meta("encoding") == stamped and store.count() == 12
    assert {k: (r.data, r.seq, r.expires_at, r.updated_at) for k, r in store.records()} == {
        f"k{i}": ({"id": i, "status": "new", "qty": 0}, 100 + i, 5_000 + i if i % 2 else None, 7 + i) for i in range(12)}
    assert sorted(at for at, _ in store.due(10_000)) == [5_000 + i for i in range(1, 12, 2)]  # expiry entries as they were
    assert run(keyformat.check_encoding(store, AVRO_ORDERS, v2, 0)) is True  # again, changing nothing more
    assert {k: r.data for k, r in store.records()}["k3"] == {"id": 3, "status": "new", "qty": 0}


def test_records_keep_their_shape_while_a_recreated_changelog_replay_is_staged(tmp_path, store):
    """`project=False` (the loop's, while a recreated changelog's replay waits for its re-seed to
    commit): nothing is committed under it."""
    v1 = avro(tmp_path, "v1", {"name": "desk", "type": "string", "default": ""})
    run(keyformat.check_encoding(store, AVRO_ORDERS, v1, 0))
    put(store, "k1", {"id": 1, "status": "new", "desk": "d"})
    store.set_meta("changelog_incarnation", 9)  # staged by the replay
    v2 = avro(tmp_path, "v2", {"name": "qty", "type": "long", "default": 0})
    assert run(keyformat.check_encoding(store, AVRO_ORDERS, v2, 0, project=False)) is True
    store.rollback()
    assert store.committed("k1").data == {"id": 1, "status": "new", "desk": "d"} and store.meta("changelog_incarnation") == 0


def test_a_record_the_new_encoding_does_not_read_back_is_kept_as_it_is(tmp_path, store, monkeypatch):
    """A value too deep for the codec's reader: the worker must not stop at restore over it."""
    from processor.contract.errors import InputError

    v1 = avro(tmp_path, "v1", {"name": "desk", "type": "string", "default": ""})
    run(keyformat.check_encoding(store, AVRO_ORDERS, v1, 0))
    put(store, "k1", {"id": 1, "status": "new", "desk": "d"})
    put(store, "k2", {"id": 2, "status": "new", "desk": "d"})
    v2 = avro(tmp_path, "v2")  # desk dropped
    decode = v2.decode

    def refuse_k1(data: bytes) -> dict:
        record = decode(data)
        if record["id"] == 1:
            raise InputError("value nests too deep for the topic's recursive Avro schema")
        return record

    monkeypatch.setattr(v2, "decode", refuse_k1)
    assert run(keyformat.check_encoding(store, AVRO_ORDERS, v2, 0)) is True
    assert {k: r.data for k, r in store.records()} == {"k1": {"id": 1, "status": "new", "desk": "d"}, "k2": {"id": 2, "status": "new"}}
