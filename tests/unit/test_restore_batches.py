"""A restore replays `<topic>.sow` a consume at a time (`SowLoop._replay_changelog` through
`SowTopicEngine.restore_many` and `PartitionStore.put_many`): the store it builds must be, key for
key and byte for byte, the one the record-at-a-time replay built (written out here as the oracle),
for JSON and Avro topics, with hash indexes and a capacity (age index), across batches, commits and
a cache that is cleared under it; what is no SOW record is passed over, said and counted."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import processor.runners.faust.loop as loop_module
from processor.contract.types import SowRecord
from processor.core.bookmarks import SEQ_PARTITION_BITS
from processor.core.changelog import MalformedSowMessage, parse_sow_message
from processor.engine.topic import SowTopicEngine
from processor.kafka.clients import read_batches, read_until
from processor.runners.faust import metrics
from processor.runners.faust.loop import SowLoop, Task
from processor.state.base import PartitionStore, open_partition_store
from processor.topology import parse_topology

from .fake_clients import Message, end_of

TOPIC = "orders.sow"
INCARNATION = 77
SCHEMA = {
    "type": "record", "name": "Order", "fields": [
        {"name": "id", "type": "long"},
        {"name": "desk", "type": ["null", "string", "long"], "default": None},
        {"name": "px", "type": "double", "default": 0.0},
        {"name": "tags", "type": {"type": "array", "items": "string"}, "default": []},
    ],
}


def spec_of(kind: str, folder: Path):
    entry = {"topic": "orders", "key": ["/id"], "partitions": 1, "persistence": "persistent",
             "hash_indexes": [["/desk"], ["/desk", "/tags"]], "capacity": 10_000}
    if kind == "avro":
        (folder / "orders.avsc").write_text(json.dumps(SCHEMA))
        entry |= {"message_type": "avro", "schema": str(folder / "orders.avsc")}
    elif kind == "plain":
        del entry["hash_indexes"], entry["capacity"]
    return parse_topology({"sow": [entry]}).sow[0]


class Consumer:
    """Hands out the changelog `size` messages a consume (what read_batches asks for, at most)."""

    def __init__(self, messages: list[Message]):
        self.messages, self.at = messages, 0

    def assign(self, partitions) -> None:
        self.at = partitions[0].offset

    def consume(self, n: int, timeout: float) -> list[Message]:
        out = self.messages[self.at:self.at + n]
        self.at += len(out)
        return out or [end_of(TOPIC, 0, self.messages[-1].offset() + 1 if self.messages else 0)]

    def close(self) -> None:
        pass


def replay(monkeypatch, engine: SowTopicEngine, store: PartitionStore, messages: list[Message]) -> int:
    """The loop's own replay of partition 0 over `messages`, from the store's position."""
    monkeypatch.setattr(loop_module, "make_consumer", lambda bootstrap, **config: Consumer(messages))
    monkeypatch.setattr(loop_module, "end_offsets", lambda consumer, topic, partitions: {0: (0, len(messages))})
    monkeypatch.setattr(loop_module, "topic_incarnation", lambda admin, topic: INCARNATION)
    loop = SowLoop.__new__(SowLoop)  # no __init__: only what the replay reads
    loop.bootstrap, loop._admin, loop.eos = "scripted:9092", object(), True
    loop._tombstones_cleaned = lambda store, topic, p: False  # a store read just now
    task = Task(engine, 0, (("orders", 0), ("orders.delta", 0), ("orders.repartition", 0)))
    count, reseed = SowLoop._replay_changelog(loop, task, store)
    assert not reseed
    return count


def one_by_one(engine: SowTopicEngine, store: PartitionStore, messages: list[Message], every: int) -> None:
    """The oracle: each message parsed, checked and staged by itself, a commit every `every`."""
    for n, msg in enumerate(messages, 1):
        try:
            change = parse_sow_message(engine.codec, msg.key(), msg.value(), msg.headers())
            seq = change.seq or 0
            if seq < 0 or seq >= 2**62:
                raise MalformedSowMessage("no event ID of a worker")
        except MalformedSowMessage:
            pass
        else:
            if seq:
                store.set_counter(max(store.counter(), seq >> SEQ_PARTITION_BITS))
            store.stage(change.key, change.record and SowRecord(change.record, seq, change.expires_at, msg.timestamp()[1]))
        if n % every == 0:
            store.set_meta("changelog", msg.offset() + 1)
            store.commit()
    store.set_meta("changelog", len(messages))
    store.set_meta("changelog_incarnation", INCARNATION)
    store.commit()


def everything(store: PartitionStore) -> list[tuple[bytes, bytes]]:
    """Every entry of the store but the instant a replay notes it read the log (a clock reading)."""
    return [(k, v) for k, v in store.backend.scan(b"", b"\xff") if k != b"mchangelog_at"]


# messages ----------------------------------------------------------------------------------------
KEYS = [b'["orders",%d]' % i for i in range(12)]
DESKS = st.sampled_from([None, "rates", "fx", "caf\u00e9", 7, "7"])
SEQS = st.one_of(*[st.integers(0, 2**62 - 1)] * 8, st.integers(2**62, 2**63 - 1), st.integers(-(2**63), -1))


@st.composite
def records(draw, avro: bool) -> dict:
    record = {"id": draw(st.integers(0, 11)), "desk": draw(DESKS), "px": draw(st.floats(-1e6, 1e6, allow_nan=False)),
              "tags": draw(st.lists(st.sampled_from(["a", "b", "\u00e9"]), max_size=2))}
    if avro and isinstance(record["desk"], int):
        record["desk"] = 7
    return record


@st.composite
def changelog(draw, codec) -> list[Message]:
    avro = codec.name == "avro"
    out = []
    for offset in range(draw(st.integers(0, 60))):
        shape = draw(st.sampled_from(["record"] * 6 + ["tombstone"] * 2 + ["spelled", "junk", "nokey", "badseq"]))
        key = draw(st.sampled_from(KEYS))
        headers = [("sow-key", key), ("sow-op", draw(st.sampled_from([b"insert", b"update", b"delete", b"expire"]))),
                   ("sow-seq", b"%d" % draw(SEQS))]
        if draw(st.booleans()):
            headers.append(("sow-expires-at", b"%d" % draw(st.one_of(st.integers(0, 10**13), st.integers(-(2**63), 2**63 - 1)))))
        value = None if shape == "tombstone" else codec.encode(draw(records(avro)))
        if shape == "spelled" and not avro:  # JSON another writer spelled: stored as orjson writes it
            value = b'{ "id" : 3, "desk": "caf\\u00e9", "px": 1.50E2, "id": 4 }'
        elif shape == "junk":
            value = b"\x01{not json"
        elif shape == "nokey":
            key = None
        elif shape == "badseq":
            headers.append(("sow-seq", draw(st.sampled_from([b"x", b"", b"9" * 30]))))
        out.append(Message(TOPIC, 0, offset, value, draw(st.integers(0, 2**40)), key=key, headers=headers))
    return out


@pytest.mark.parametrize("kind", ["json", "avro", "plain"])
@pytest.mark.parametrize("backend", ["rocksdb", "memory"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_batched_restore_builds_the_store_the_record_at_a_time_restore_built(monkeypatch, kind, backend, data):
    with tempfile.TemporaryDirectory() as folder:
        engine = SowTopicEngine(spec_of(kind, Path(folder)))
        messages = data.draw(changelog(engine.codec))
        every = data.draw(st.integers(1, 9))
        monkeypatch.setattr(loop_module, "_RESTORE_BATCH", data.draw(st.integers(1, 7)))
        monkeypatch.setattr(loop_module, "_RESTORE_COMMIT", every)
        # Read back, or cached: the bound is the process's, shared by the open stores (these two at least).
        monkeypatch.setenv("KSOW_CACHE_RECORDS", str(data.draw(st.sampled_from([8, 100_000]))))
        fast = open_partition_store(backend, f"{folder}/fast", engine.indexes)
        slow = open_partition_store(backend, f"{folder}/slow", engine.indexes)
        try:
            engine.attach(0, fast)
            assert replay(monkeypatch, engine, fast, messages) == len(messages)
            one_by_one(engine, slow, messages, every)
            assert everything(fast) == everything(slow)
        finally:
            fast.close()
            slow.close()


def test_a_restore_over_a_store_that_holds_records_replaces_their_entries(monkeypatch, tmp_path):
    """The store is behind its changelog (a crash after a transaction): the records it holds are
    read back in one multi-get and their old expiry, hash and age entries go."""
    spec = spec_of("json", tmp_path)
    engine = SowTopicEngine(spec)
    made = [Message(TOPIC, 0, i, orjson.dumps({"id": i % 5, "desk": f"d{i}", "tags": []}), 1_000 + i, key=KEYS[i % 5],
                    headers=[("sow-seq", b"%d" % ((i + 1) << 10)), ("sow-expires-at", b"%d" % (5_000 + i))]) for i in range(20)]
    fast = open_partition_store("rocksdb", str(tmp_path / "fast"), engine.indexes)
    slow = open_partition_store("rocksdb", str(tmp_path / "slow"), engine.indexes)
    for store in (fast, slow):
        one_by_one(engine, store, made[:10], 10)  # the store's first half, committed
        store.set_meta("changelog", 10)
        store.commit()
        store._committed.clear()  # as after a restart
    engine.attach(0, fast)
    reads = []
    get = fast.backend.get
    monkeypatch.setattr(fast.backend, "get", lambda key: reads.append(key) or get(key), raising=False)
    assert replay(monkeypatch, engine, fast, made) == 10
    one_by_one(engine, slow, made, 10**6)
    assert everything(fast) == everything(slow)
    assert not [key for key in reads if key.startswith(b"r")]  # no record read one at a time
    assert fast.count() == 5 and fast.get(KEYS[4].decode()).data["desk"] == "d19"


def test_records_that_are_no_sow_records_are_skipped_said_and_counted(monkeypatch, tmp_path, caplog):
    spec = spec_of("json", tmp_path)
    engine = SowTopicEngine(spec)
    store = open_partition_store("memory", None, engine.indexes)
    engine.attach(0, store)
    good = [(KEYS[i], orjson.dumps({"id": i}), [("sow-seq", b"%d" % (9 << 10))]) for i in range(4)]
    bad = [(b"k", b"{not json", [("sow-seq", b"nope")]), (None, b"{}", []), (KEYS[5], b"{}", [("sow-seq", b"%d" % 2**62)])]
    made = [Message(TOPIC, 0, i, value, 5, key=key, headers=headers) for i, (key, value, headers) in enumerate(good[:2] + bad + good[2:])]
    skipped = metrics.CHANGELOG_SKIPPED._value.get()
    monkeypatch.setattr(loop_module, "_RESTORE_BATCH", 3)
    with caplog.at_level(logging.WARNING, "ksow.loop"):
        assert replay(monkeypatch, engine, store, made) == 7
    assert metrics.CHANGELOG_SKIPPED._value.get() - skipped == 3
    said = [r.getMessage() for r in caplog.records if "not a SOW record" in r.getMessage()]
    assert [s.split(":")[0] for s in said] == ["skipped orders.sow[0]@2", "skipped orders.sow[0]@3", "skipped orders.sow[0]@4"]
    assert store.count() == 4 and store.counter() == 9 and store.meta("changelog") == 7


def test_restore_of_one_record_raises_what_is_wrong_with_it(tmp_path):
    engine = SowTopicEngine(spec_of("json", tmp_path))
    store = open_partition_store("memory", None, engine.indexes)
    with pytest.raises(MalformedSowMessage, match="not valid JSON"):
        engine.restore(0, store, b"k", b"{", [], 1)
    engine.restore(0, store, b"k", b'{"id": 1}', [("sow-seq", b"2048")], 1)
    assert store.get("k") == SowRecord({"id": 1}, 2048, None, 1) and store.counter() == 2


def test_read_batches_hands_out_what_read_until_does():
    made = [Message(TOPIC, 0, i, b"%d" % i) for i in range(0, 25, 2)]  # a compacted log: gaps
    batches = list(read_batches(Consumer(made), {(TOPIC, 0): 24}, size=4))
    assert [len(b) for b in batches] == [4, 4, 4]  # offset 24 is past the end
    assert [m.offset() for b in batches for m in b] == [m.offset() for m in read_until(Consumer(made), {(TOPIC, 0): 24})]
