"""The worker loop at interleavings a broker gives only by chance (scripted clients: fake_clients):
a pause across a rebalance, a resume while the log grew, a wait clock across a slow assignment, a
changelog re-seed whose transaction does not commit, an output topic deleted under the loop, one
that takes smaller messages than ksow's limits. Each failed before its fix."""

from __future__ import annotations

import time

import orjson
import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from processor.contract.errors import ConfigError
from processor.contract.types import SowRecord
from processor.core.keys import KEY_FORMAT
from processor.runners.faust.loop import Guarantee
from processor.state.base import IndexSpec, open_partition_store
from processor.topology import parse_topology

import processor.runners.faust.loop as loop_module

from .fake_clients import INPUTS, Message, applied_inputs, assign, end_of, now_ms, revoke, scripted_loop


def _record(i: int, **fields) -> bytes:
    return orjson.dumps({"id": i, **fields})


def test_a_partition_paused_before_a_rebalance_is_fetched_again_once_assigned_back(monkeypatch, tmp_path):
    """librdkafka keeps a paused partition paused through a revocation and its new assignment; the
    loop forgot the pause with the revocation, so nothing would ever resume it."""
    loop, consumer, _ = scripted_loop(monkeypatch, tmp_path, queue_high=4, guarantee=Guarantee.AT_LEAST_ONCE)
    assign(loop, consumer)
    # orders' queue fills while orders.delta has said nothing yet (behind): the merge waits, orders is paused.
    consumer.script.append([Message("orders", 0, i, _record(i), now_ms() - 1000 + i) for i in range(5)])
    loop.cycle()
    assert ("orders", 0) in consumer.paused
    revoke(loop, consumer)
    assign(loop, consumer)
    assert ("orders", 0) not in consumer.paused


def _publishes_at_their_end(consumer, n: int, t0: int) -> None:
    """The next consume hands out n publishes on orders (t0 + offset ms), its end and that of
    orders.repartition; orders.delta says nothing, so it is behind."""
    consumer.script.append([Message("orders", 0, i, _record(i), t0 + i) for i in range(n)]
                           + [end_of("orders", 0, n), end_of("orders.repartition", 0, 0)])


def test_an_input_resumed_after_its_end_is_behind_until_fetched_again(monkeypatch, tmp_path):
    """orders reached its end, was paused while orders.delta was behind, and resumed: what was
    appended to it meanwhile is not fetched yet, so a later delta must wait for it."""
    loop, consumer, _ = scripted_loop(monkeypatch, tmp_path, queue_high=4, commit_interval_ms=0, guarantee=Guarantee.AT_LEAST_ONCE)
    applied = applied_inputs(loop)
    assign(loop, consumer)
    t0 = now_ms() - 10_000
    _publishes_at_their_end(consumer, 5, t0)
    loop.cycle()
    assert applied == [] and ("orders", 0) in consumer.paused  # paused at its end, orders.delta behind
    consumer.script.append([Message("orders.delta", 0, 0, _record(0, x=1), t0 + 100), end_of("orders.delta", 0, 1)])
    loop.cycle()
    assert applied == [("orders", i) for i in range(5)] and ("orders", 0) not in consumer.paused
    # While orders was paused, orders@5 (t0 + 6 s) was appended, then orders.delta@1 (t0 + 7 s). The
    # delta is fetched first.
    consumer.script.append([Message("orders.delta", 0, 1, _record(0, x=2), t0 + 7000), end_of("orders.delta", 0, 2)])
    loop.cycle()
    consumer.script.append([Message("orders", 0, 5, _record(0, x=0), t0 + 6000), end_of("orders", 0, 6)])
    loop.cycle()
    time.sleep(0.05)  # past the order grace
    loop.cycle()
    assert applied[5:] == [("orders.delta", 0), ("orders", 5), ("orders.delta", 1)]  # by timestamp: 100, 6000, 7000


def test_an_input_served_again_by_the_consumer_is_applied_once(monkeypatch, tmp_path):
    """Offsets already filed that a fetch serves again (librdkafka resumes a paused partition from
    its application position) are not applied a second time: their outputs would repeat."""
    loop, consumer, _ = scripted_loop(monkeypatch, tmp_path, commit_interval_ms=0, guarantee=Guarantee.AT_LEAST_ONCE)
    applied = applied_inputs(loop)
    assign(loop, consumer)
    t0 = now_ms() - 10_000
    ends = [end_of("orders.delta", 0, 0), end_of("orders.repartition", 0, 0)]
    consumer.script.append([Message("orders", 0, i, _record(i), t0 + i) for i in range(3)] + [end_of("orders", 0, 3), *ends])
    loop.cycle()
    consumer.script.append([Message("orders", 0, i, _record(i), t0 + i) for i in range(1, 5)] + [end_of("orders", 0, 5), *ends])
    loop.cycle()
    assert applied == [("orders", i) for i in range(5)]


def test_the_wait_for_an_input_behind_starts_again_after_an_assignment(monkeypatch, tmp_path):
    """A merge waiting on an input when a rebalance came: the time the new assignment took (waiting
    for a previous owner's transaction) must not count, or the first merge after it is forced past
    an input not fetched since."""
    loop, consumer, _ = scripted_loop(monkeypatch, tmp_path, max_idle_ms=500, commit_interval_ms=0, guarantee=Guarantee.AT_LEAST_ONCE)
    applied = applied_inputs(loop)
    monkeypatch.setattr(loop, "_await_previous_owner", lambda tasks: time.sleep(0.6))
    assign(loop, consumer)
    t0 = now_ms() - 10_000
    consumer.script.append([Message("orders", 0, 0, _record(0), t0 + 10), end_of("orders.repartition", 0, 0)])
    loop.cycle()
    assert applied == []  # orders.delta not heard from: the merge waits
    revoke(loop, consumer)
    assign(loop, consumer)  # 0.6 s, past max_idle_ms
    consumer.script.append([Message("orders", 0, 0, _record(0), t0 + 10), end_of("orders", 0, 1), end_of("orders.repartition", 0, 0)])
    loop.cycle()
    consumer.script.append([Message("orders.delta", 0, 0, _record(0, x=1), t0 + 5), end_of("orders.delta", 0, 1)])
    loop.cycle()
    time.sleep(0.05)
    loop.cycle()
    assert applied == [("orders.delta", 0), ("orders", 0)]


def test_a_partition_restoring_holds_up_neither_the_others_nor_itself_past_its_restore(monkeypatch, tmp_path):
    """Partition 1 restores 6 `.sow` batches, one a cycle here (KSOW_RESTORE_SLICE_MS 1): partition 0
    applies its inputs meanwhile, up to one whose SowKey partition 1 owns (sent to partition 0), which
    waits, with what follows it, for the end of the restore: not into a half-built store, not
    through `.repartition` (where it could come after partition 1's later inputs). Partition 1's own
    delta then merges into its restored record."""
    from processor.core.keys import owner_partition

    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, topic={"partitions": 2}, restore_slice_ms=1, commit_interval_ms=0)
    spec = loop.engines["orders"].spec
    ids = {p: [i for i in range(100) if owner_partition(spec.key_spec.sow_key({"id": i}), 2) == p] for p in (0, 1)}
    changelog = [Message("orders.sow", 1, n, _record(i, restored=True), now_ms() - 60_000, key=spec.key_spec.sow_key({"id": i}).encode(),
                         headers=[("sow-seq", b"%d" % ((n + 1) << 10 | 1))]) for n, i in enumerate(ids[1][:12])]

    def read_batches(consumer, ends, size):
        for at in range(0, len(changelog), 2):
            time.sleep(0.002)  # past the slice: a cycle restores one batch
            yield changelog[at:at + 2]

    monkeypatch.setattr(loop_module, "read_batches", read_batches)
    monkeypatch.setattr(loop_module, "end_offsets", lambda c, topic, partitions, timeout=30.0: {
        p: (0, len(changelog)) if (topic, p) == ("orders.sow", 1) else (0, 0) for p in partitions})
    applied = applied_inputs(loop)
    loop._on_assign(consumer, [TopicPartition(t, p) for t in INPUTS for p in (0, 1)])
    t0 = now_ms() - 10_000
    consumer.script.append([Message("orders", 0, 0, _record(ids[0][0]), t0), Message("orders", 0, 1, _record(ids[1][0], misrouted=True), t0 + 1),
                            Message("orders.delta", 1, 0, _record(ids[1][1], delta=True), t0 + 2), Message("orders", 0, 2, _record(ids[0][1]), t0 + 3)]
                           + [end_of(t, p, 0 if (t, p) != ("orders", 0) else 3) for t in INPUTS for p in (0, 1)]
                           + [end_of("orders.delta", 1, 1)])
    loop.cycle()
    assert applied == [("orders", 0)]  # partition 0's first, while partition 1 restores
    assert not loop.tasks[("orders", 1)].restored and loop.served("orders") == [0]
    for _ in range(10):
        loop.cycle()
        if loop.tasks[("orders", 1)].restored:
            break
        assert applied == [("orders", 0)]  # the next waits for partition 1
    assert loop.tasks[("orders", 1)].restored and loop.served("orders") == [0, 1]
    assert applied == [("orders", 0), ("orders", 1), ("orders.delta", 0), ("orders", 2)]
    assert not [topic for p in producers for topic, *_ in p.delivered if topic == "orders.repartition"]
    store = loop.tasks[("orders", 1)].store
    assert store.count() == 12
    assert store.get(spec.key_spec.sow_key({"id": ids[1][1]})).data == {"id": ids[1][1], "restored": True, "delta": True}
    assert store.get(spec.key_spec.sow_key({"id": ids[1][0]})).data == {"id": ids[1][0], "misrouted": True}
    assert sorted(loop.engines["orders"].partitions) == [0, 1]


def test_a_partition_revoked_in_the_middle_of_its_restore_keeps_only_what_the_restore_committed(monkeypatch, tmp_path):
    """Revoked (or its batch aborted) between two slices, a restore stops: its changelog consumer
    closes and the store goes back to the restore's last commit, whose position matches it. The
    same worker given the partition back goes on from there, with the same store."""
    loop, consumer, _ = scripted_loop(monkeypatch, tmp_path, restore_slice_ms=1, commit_interval_ms=0)
    spec = loop.engines["orders"].spec
    changelog = [Message("orders.sow", 0, n, _record(n), now_ms(), key=spec.key_spec.sow_key({"id": n}).encode(),
                         headers=[("sow-seq", b"%d" % ((n + 1) << 10))]) for n in range(12)]
    closed = []

    def read_batches(consumer, ends, size):
        try:
            for at in range(0, len(changelog), 2):
                time.sleep(0.002)  # past the slice: a cycle restores one batch
                yield changelog[at:at + 2]
        finally:
            closed.append(len(closed))

    monkeypatch.setattr(loop_module, "read_batches", read_batches)
    monkeypatch.setattr(loop_module, "_RESTORE_COMMIT", 4)
    monkeypatch.setattr(loop_module, "end_offsets", lambda c, topic, partitions, timeout=30.0: {
        p: (0, len(changelog)) if topic == "orders.sow" else (0, 0) for p in partitions})
    assign(loop, consumer)
    for _ in range(3):  # three batches: six records staged, the first four committed
        loop.cycle()
    task = loop.tasks[("orders", 0)]
    store = task.store
    key = lambda n: spec.key_spec.sow_key({"id": n})  # noqa: E731
    assert not task.restored and task.replay is not None and store.get(key(5)) is not None
    revoke(loop, consumer)
    assert closed == [0] and store.get(key(5)) is None and store.get(key(3)) is not None and store.meta("changelog") == 4
    assign(loop, consumer)
    for _ in range(10):
        loop.cycle()
    assert loop.tasks[("orders", 0)].restored and loop.tasks[("orders", 0)].store is store
    assert store.count() == 12 and store.meta("changelog") == 12


def test_a_changelog_reseed_whose_transaction_aborts_is_done_again(monkeypatch, tmp_path):
    """The store is ahead of a recreated, empty `.sow`: it writes its records back. When that
    transaction aborts, the next restore must find the store still ahead and write them again."""
    spec = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1}]}).topic("orders")
    store = open_partition_store("rocksdb", str(tmp_path / "sow" / "orders" / "p0"), IndexSpec())
    for i in range(3):
        store.put(spec.key_spec.sow_key({"id": i}), SowRecord({"id": i}, (i + 1) << 10, None, 1_000 + i))
    store.set_meta("changelog", 10)
    store.set_key_format(KEY_FORMAT)
    store.commit()
    store.close()
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, topic={"persistence": "persistent"}, commit_interval_ms=0)
    assign(loop, consumer)
    producers[-1].fail_next_commit = KafkaError(KafkaError._TIMED_OUT)  # abortable: the batch is aborted
    loop.cycle()
    assert producers[-1].aborted == 1 and not producers[-1].delivered
    loop.cycle()  # the restore again
    reseeded = [(value, offset) for p in producers for topic, _, offset, value in p.delivered if topic == "orders.sow"]
    assert sorted(orjson.loads(v)["id"] for v, _ in reseeded) == [0, 1, 2]
    assert loop.tasks[("orders", 0)].store.meta("changelog") == 3  # the end of what it wrote


def test_a_reseed_after_a_recreated_changelog_writes_the_versions_the_new_log_gave(monkeypatch, tmp_path):
    """The store is ahead of a recreated `.sow` on which another worker already wrote (a newer
    version of record 1, a tombstone of record 2): the replay stages those over the store's
    records, and the re-seed must write record 1 as the new log has it and leave record 2 out. It
    wrote the store's committed versions: `.sow` ended with the old record 1 and record 2 back,
    unlike the store."""
    spec = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1}]}).topic("orders")
    key = lambda n: spec.key_spec.sow_key({"id": n})  # noqa: E731
    store = open_partition_store("rocksdb", str(tmp_path / "sow" / "orders" / "p0"), IndexSpec())
    for i in range(3):
        store.put(key(i), SowRecord({"id": i, "v": "old"}, (i + 1) << 10, None, 1_000 + i))
    store.set_meta("changelog", 10)  # no incarnation: a log that ends before the store's position was recreated
    store.set_key_format(KEY_FORMAT)
    store.commit()
    store.close()
    new_log = [Message("orders.sow", 0, 0, orjson.dumps({"id": 1, "v": "new"}), 5_000, key=key(1).encode(),
                       headers=[("sow-op", b"update"), ("sow-seq", b"99999")]),
               Message("orders.sow", 0, 1, None, 5_001, key=key(2).encode(), headers=[("sow-op", b"delete")])]
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, topic={"persistence": "persistent"}, commit_interval_ms=0)
    monkeypatch.setattr(loop_module, "end_offsets", lambda c, topic, partitions, timeout=30.0: {
        p: (0, len(new_log)) if topic == "orders.sow" else (0, 0) for p in partitions})
    monkeypatch.setattr(loop_module, "read_batches", lambda consumer, ends, size: iter([new_log]))
    assign(loop, consumer)
    loop.cycle()
    assert loop.tasks[("orders", 0)].restored
    written = {orjson.loads(v)["id"]: orjson.loads(v) for p in producers for topic, _, _, v in p.delivered if topic == "orders.sow"}
    assert written == {0: {"id": 0, "v": "old"}, 1: {"id": 1, "v": "new"}}
    assert loop.tasks[("orders", 0)].store.get(key(2)) is None


def test_a_reseed_keeps_its_timestamps_within_what_the_changelog_takes(monkeypatch, tmp_path):
    """A re-seed writes each record with its last-change instant. With message.timestamp.before.max.ms
    set on `.sow` (a day here), the broker refuses an older one, and the batch holding the re-seed
    each time it is redone: such instants are written as the oldest the topic takes, with a
    minute's margin; younger ones stay as they are."""
    spec = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1}]}).topic("orders")
    store = open_partition_store("rocksdb", str(tmp_path / "sow" / "orders" / "p0"), IndexSpec())
    day, now = 86_400_000, now_ms()
    for i, updated in enumerate((1_000, now - 2 * day, now - 3_600_000)):
        store.put(spec.key_spec.sow_key({"id": i}), SowRecord({"id": i}, (i + 1) << 10, None, updated))
    store.set_meta("changelog_incarnation", 7)
    store.set_meta("encoding", 1234)  # written in another encoding: re-seeded
    store.set_key_format(KEY_FORMAT)
    store.commit()
    store.close()
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, topic={"persistence": "persistent"}, commit_interval_ms=0)
    loop.admin.configs["orders.sow"] = {"cleanup.policy": "compact", "message.timestamp.type": "CreateTime",
                                        "message.timestamp.before.max.ms": str(day)}
    loop.ensure_topics()
    assign(loop, consumer)
    loop.cycle()
    stamps = {orjson.loads(v)["id"]: stamp for p in producers for (topic, _, _, v), (_, stamp) in zip(p.delivered, p.stamps) if topic == "orders.sow"}
    assert set(stamps) == {0, 1, 2}
    assert now - day + 60_000 <= stamps[0] == stamps[1] <= now_ms() - day + 60_000  # the oldest it takes, a minute in
    assert stamps[2] == now - 3_600_000


@pytest.mark.parametrize("setting", ["message.timestamp.before.max.ms", "message.timestamp.difference.max.ms"])
def test_an_input_read_long_after_it_arrived_is_written_within_what_the_changelog_takes(monkeypatch, tmp_path, caplog, setting):
    """A record's `.sow` message carries its last-change instant: the input's timestamp. A worker
    two days behind (stopped that long), with `.sow` set to take at most a day, had every batch
    refused, each time it was redone: such an instant is written as the oldest `.sow` takes, a
    minute in; a younger one as it is. `.diff` takes the broker's time, as before. The warning
    names the setting that bounds it (difference.max.ms: brokers before Kafka 3.6)."""
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, commit_interval_ms=0, guarantee=Guarantee.EXACTLY_ONCE)
    day, now = 86_400_000, now_ms()
    loop.admin.configs["orders.sow"] = {"cleanup.policy": "compact", "message.timestamp.type": "CreateTime", setting: str(day)}
    loop.ensure_topics()
    assign(loop, consumer)
    consumer.script.append([Message("orders", 0, 0, _record(0), now - 2 * day), Message("orders", 0, 1, _record(1), now - 3_600_000),
                            end_of("orders", 0, 2), end_of("orders.delta", 0, 0), end_of("orders.repartition", 0, 0)])
    loop.cycle()
    stamps = {(topic, orjson.loads(v)["id"]): stamp for p in producers for (topic, _, _, v), (_, stamp) in zip(p.delivered, p.stamps)
              if topic == "orders.sow"}
    assert set(stamps) == {("orders.sow", 0), ("orders.sow", 1)}
    assert now - day + 60_000 <= stamps["orders.sow", 0] <= now_ms() - day + 60_000  # the oldest it takes, a minute in
    assert stamps["orders.sow", 1] == now - 3_600_000
    assert [stamp for p in producers for (topic, *_), (_, stamp) in zip(p.delivered, p.stamps) if topic == "orders.diff"] == [0, 0]
    assert f"orders.sow takes no timestamp older than {day} ms ({setting})" in caplog.text


def test_a_reseed_takes_a_transaction_a_step_and_is_done_again_from_the_start_after_an_abort(monkeypatch, tmp_path):
    """The topic's encoding changed (the store is stamped with another): its 12 records go back to
    `.sow` 5 a step, each step in the transaction of the cycle it ran in (one transaction for a
    whole SOW outlasted the transaction timeout: a million records took 7 s). The stamp becomes
    durable only with the store commit after the last step; when a step's transaction aborts, the
    re-seed starts again from the first record, and the partition is served only once it is done."""
    from processor.core.codec import JsonCodec
    from processor.state.base import _INT, _META
    from processor.state.keyformat import encoding_definition

    spec = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1}]}).topic("orders")
    store = open_partition_store("rocksdb", str(tmp_path / "sow" / "orders" / "p0"), IndexSpec())
    for i in range(12):
        store.put(spec.key_spec.sow_key({"id": i}), SowRecord({"id": i}, (i + 1) << 10, None, 1_000 + i))
    store.set_meta("changelog_incarnation", 7)  # the log the scripted admin names: not recreated
    store.set_meta("encoding", 1234)  # written in another encoding
    store.set_key_format(KEY_FORMAT)
    store.commit()
    store.close()
    monkeypatch.setattr(loop_module, "_RESEED_STEP", 5)
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, topic={"persistence": "persistent"}, commit_interval_ms=0, restore_slice_ms=1)
    assign(loop, consumer)

    def stamp() -> int:  # the committed one
        return _INT.unpack(loop.tasks[("orders", 0)].store.backend.get(_META + b"encoding"))[0]

    def written() -> list[int]:
        return [orjson.loads(v)["id"] for p in producers for topic, _, _, v in p.delivered if topic == "orders.sow"]

    order = [i for _, i in sorted((spec.key_spec.sow_key({"id": i}).encode(), i) for i in range(12))]  # SowKey byte order
    loop.cycle()
    assert written() == order[:5] and stamp() == 1234  # the stamp is not durable yet
    producers[-1].fail_next_commit = KafkaError(KafkaError._TIMED_OUT)  # the second step's transaction aborts
    loop.cycle()
    assert producers[-1].aborted == 1 and len(written()) == 5 and stamp() == 1234
    assert not loop.tasks[("orders", 0)].restored
    for _ in range(5):
        loop.cycle()
    assert loop.tasks[("orders", 0)].restored
    assert written()[5:] == order  # again from the start
    assert stamp() == encoding_definition(JsonCodec())


@pytest.mark.parametrize("read_ago_ms, kept", [(3_600_000, 3), (2 * 86_400_000, 0)])
def test_a_store_that_read_its_changelog_longer_ago_than_tombstones_are_kept_is_rebuilt(monkeypatch, tmp_path, read_ago_ms, kept):
    """A store parked (on disk, or in a worker) while other workers owned its partition replays
    `.sow` from its position when it comes back. Past delete.retention.ms (a day by default) the log
    cleaner may have removed the tombstones of records deleted meanwhile, and the replay would keep
    those records: such a store is rebuilt from the start of the log instead (here a log whose
    records were all cleaned away). One that read it an hour ago keeps its records."""
    spec = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1}]}).topic("orders")
    store = open_partition_store("rocksdb", str(tmp_path / "sow" / "orders" / "p0"), IndexSpec())
    for i in range(3):
        store.put(spec.key_spec.sow_key({"id": i}), SowRecord({"id": i}, (i + 1) << 10, None, 1_000 + i))
    store.set_meta("changelog", 10)
    store.set_meta("changelog_incarnation", 7)  # the log the scripted admin names: not recreated
    store.set_meta("changelog_at", now_ms() - read_ago_ms)
    store.set_key_format(KEY_FORMAT)
    store.commit()
    store.close()
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, topic={"persistence": "persistent"}, commit_interval_ms=0)
    monkeypatch.setattr(loop_module, "end_offsets", lambda c, topic, partitions, timeout=30.0: {p: (0, 10) if topic == "orders.sow" else (0, 0) for p in partitions})
    monkeypatch.setattr(loop_module, "read_batches", lambda consumer, ends, size: iter(()))  # offsets 0-9 all cleaned away
    assign(loop, consumer)
    loop.cycle()
    store = loop.tasks[("orders", 0)].store
    assert store.count() == kept
    assert store.meta("changelog") == 10


def test_an_owned_store_of_a_quiet_topic_notes_it_is_current_and_is_not_rebuilt(monkeypatch, tmp_path):
    """A partition owned with no commit for longer than delete.retention.ms (a quiet topic) is still
    current: no other worker wrote its changelog. Its store notes so every minute between
    transactions, so the next rebalance replays it from its position instead of rebuilding it."""
    spec = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1}]}).topic("orders")
    store = open_partition_store("rocksdb", str(tmp_path / "sow" / "orders" / "p0"), IndexSpec())
    for i in range(3):
        store.put(spec.key_spec.sow_key({"id": i}), SowRecord({"id": i}, (i + 1) << 10, None, 1_000 + i))
    store.set_meta("changelog", 10)
    store.set_meta("changelog_incarnation", 7)
    store.set_meta("changelog_at", now_ms())
    store.set_key_format(KEY_FORMAT)
    store.commit()
    store.close()
    loop, consumer, _ = scripted_loop(monkeypatch, tmp_path, topic={"persistence": "persistent"}, commit_interval_ms=0)
    monkeypatch.setattr(loop_module, "end_offsets", lambda c, topic, partitions, timeout=30.0: {p: (0, 10) if topic == "orders.sow" else (0, 0) for p in partitions})
    monkeypatch.setattr(loop_module, "read_batches", lambda consumer, ends, size: iter(()))
    assign(loop, consumer)
    loop.cycle()
    owned = loop.tasks[("orders", 0)].store
    owned.set_meta("changelog_at", now_ms() - 2 * 86_400_000)  # its last commit, two days ago
    owned.commit()
    loop._noted_at = 0  # a minute has passed since the last note
    loop.cycle()  # no input: between transactions
    assert now_ms() - owned.meta("changelog_at") < 60_000
    revoke(loop, consumer)
    assign(loop, consumer)
    loop.cycle()
    assert loop.tasks[("orders", 0)].store.count() == 3  # replayed from its position, not rebuilt


def test_a_producer_that_could_not_be_replaced_is_replaced_at_the_next_abort(monkeypatch, tmp_path):
    """A failed abort needs a new transactional producer; when making it fails too (the broker is
    away), the next abort must try again instead of keeping the one that cannot begin a transaction."""
    import processor.runners.faust.loop as loop_module

    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, commit_interval_ms=0)
    assign(loop, consumer)
    first = producers[-1]
    first.fail_next_commit = KafkaError(KafkaError._TIMED_OUT)

    def abort_fails(timeout=None):
        raise KafkaException(KafkaError(KafkaError._STATE))

    first.abort_transaction = abort_fails
    make = loop_module.make_producer

    def unreachable(*args, **config):
        producer = make(*args, **config)
        producer.init_transactions = lambda timeout=None: abort_fails()
        monkeypatch.setattr(loop_module, "make_producer", make)  # the broker is back for the next one
        return producer

    monkeypatch.setattr(loop_module, "make_producer", unreachable)
    consumer.script.append([Message("orders", 0, 0, _record(0), now_ms() - 1000), end_of("orders", 0, 1),
                            end_of("orders.delta", 0, 0), end_of("orders.repartition", 0, 0)])
    try:
        for _ in range(3):
            loop.cycle()
    except KafkaException as exc:  # as SowLoop.run() takes a cycle's broker error
        loop._recover(exc)
    assert loop.producer is producers[-1] and loop.producer is not first and len(producers) == 3


def test_a_topic_incarnation_is_unknown_when_the_cluster_gives_no_topic_id():
    """0 (unknown) sends a restore back to telling a recreated log by its offsets: a zero ID (a
    cluster without topic IDs) or a refused request must not read as one unchanging incarnation."""
    from concurrent.futures import Future

    from processor.kafka.clients import topic_incarnation

    class Uuid:
        def __init__(self, high: int, low: int):
            self.bits = (high, low)

        def get_most_significant_bits(self) -> int:
            return self.bits[0]

        def get_least_significant_bits(self) -> int:
            return self.bits[1]

    class Admin:
        def __init__(self, answer):
            self.answer = answer

        def describe_topics(self, topics, request_timeout=None):
            future: Future = Future()
            if isinstance(self.answer, Exception):
                future.set_exception(self.answer)
            else:
                future.set_result(type("Description", (), {"topic_id": self.answer})())
            return {"t": future}

    assert topic_incarnation(Admin(Uuid(0, 0)), "t") == 0
    assert topic_incarnation(Admin(KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))), "t") == 0
    one, other = topic_incarnation(Admin(Uuid(-5, 17)), "t"), topic_incarnation(Admin(Uuid(-5, 18)), "t")
    assert one > 0 and other > 0 and one != other


def test_a_worker_behind_its_inputs_expires_records_at_the_time_of_its_next_input(monkeypatch, tmp_path):
    """A delta that reached Kafka before its record's instant, applied late (a backlog, a restart):
    the record was still there for it. The sweep ran by the wall clock and expired the record first,
    and the delta became the whole record (seed 000: a delta publish before expiry resets it)."""
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, {"expiration": "1s"}, commit_interval_ms=0,
                                              expiry_tick_ms=1, guarantee=Guarantee.AT_LEAST_ONCE)
    assign(loop, consumer)
    t0 = now_ms() - 10_000
    # orders is behind (no end yet); the other two inputs are at their ends.
    consumer.script.append([Message("orders", 0, 0, _record(1, status="open", qty=1), t0),
                            end_of("orders.delta", 0, 0), end_of("orders.repartition", 0, 0)])
    loop.cycle()
    time.sleep(0.01)
    loop.cycle()  # a sweep while behind: the record's instant (t0 + 1 s) has passed by the clock, not by the inputs
    delta = [("sow-command", b"delta_publish")]
    consumer.script.append([Message("orders", 0, 1, _record(1, qty=2), t0 + 500, headers=delta), end_of("orders", 0, 2)])
    loop.cycle()
    time.sleep(0.01)
    loop.cycle()  # caught up: now it expires, by the clock
    sow = [orjson.loads(v) if v else None for topic, _, _, v in producers[-1].delivered if topic == "orders.sow"]
    assert sow == [{"id": 1, "status": "open", "qty": 1}, {"id": 1, "status": "open", "qty": 2}, None]
    expired = [orjson.loads(v) for topic, _, _, v in producers[-1].delivered if topic == "EXP.orders"]
    assert expired == [{"id": 1, "status": "open", "qty": 2}]


def test_after_the_loop_stood_still_its_inputs_are_behind_until_the_broker_says_otherwise(monkeypatch, tmp_path):
    """A worker stopped (SIGSTOP, a long stall) while a delta was sent before its record's instant:
    its inputs' last end events said "caught up", so the first sweep after it went on expired the
    record by the clock, and the delta became the whole record (an exploratory run, SIGSTOP 7 s)."""
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, {"expiration": "1s"}, commit_interval_ms=0,
                                              expiry_tick_ms=1, guarantee=Guarantee.AT_LEAST_ONCE)
    assign(loop, consumer)
    t0 = now_ms() - 500  # the record's instant: t0 + 1 s, half a second from now
    consumer.script.append([Message("orders", 0, 0, _record(1, status="open", qty=1), t0),
                            end_of("orders", 0, 1), end_of("orders.delta", 0, 0), end_of("orders.repartition", 0, 0)])
    loop.cycle()
    consumer.highs.update({("orders", 0): 1, ("orders.delta", 0): 1})  # meanwhile a delta came, at t0 + 300
    time.sleep(1.1)  # the loop stands still (longer than STALL_SECONDS), and the instant passes
    loop.cycle()  # its sweep must not expire: orders.delta is behind
    consumer.script.append([Message("orders.delta", 0, 0, _record(1, qty=2), t0 + 300), end_of("orders.delta", 0, 1)])
    loop.cycle()
    time.sleep(0.01)
    loop.cycle()
    sow = [orjson.loads(v) if v else None for topic, _, _, v in producers[-1].delivered if topic == "orders.sow"]
    assert sow == [{"id": 1, "status": "open", "qty": 1}, {"id": 1, "status": "open", "qty": 2}, None]


def test_a_session_timeout_the_coordinator_refuses_stops_the_worker(monkeypatch, tmp_path):
    """Audit: with KSOW_SESSION_TIMEOUT_MS outside the broker's bounds, JoinGroup failed every 2 s
    and the worker stayed up for good with no partitions. The error is a setting no retry mends."""
    loop, consumer, _ = scripted_loop(monkeypatch, tmp_path)
    consumer.script.append([Message("orders", 0, error=KafkaError(KafkaError.INVALID_SESSION_TIMEOUT, "JoinGroup failed: Broker: Invalid session timeout"))])
    with pytest.raises(ConfigError, match="KSOW_SESSION_TIMEOUT_MS"):
        loop.cycle()
    consumer.script.append([Message("orders", 0, error=KafkaError(KafkaError._TRANSPORT, "broker down"))])
    loop.cycle()  # a passing error is only logged


def test_an_input_whose_new_messages_wait_behind_another_topics_backlog_holds_expiry_back(monkeypatch, tmp_path):
    """Audit: a delta that reached Kafka before its record's instant was fetched, but the consumer
    handed out another topic's backlog first; the input's last end-of-partition event still said
    "caught up", so a sweep expired the record by the clock (102 of 102 records in the audit's run),
    and the delta became the whole record."""
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, {"expiration": "1s"}, commit_interval_ms=0,
                                              expiry_tick_ms=1, guarantee=Guarantee.AT_LEAST_ONCE)
    assign(loop, consumer)
    t0 = now_ms() - 700  # the record's instant: t0 + 1 s, 0.3 s from now
    consumer.script.append([Message("orders", 0, 0, _record(1, status="open", qty=1), t0),
                            end_of("orders", 0, 1), end_of("orders.delta", 0, 0), end_of("orders.repartition", 0, 0)])
    loop.cycle()
    consumer.highs.update({("orders", 0): 1, ("orders.delta", 0): 1})  # the delta (t0 + 600) is fetched, not handed out
    for _ in range(5):  # the instant passes while the loop goes on (no stall)
        time.sleep(0.1)
        loop.cycle()
    consumer.script.append([Message("orders.delta", 0, 0, _record(1, qty=2), t0 + 600), end_of("orders.delta", 0, 1)])
    loop.cycle()
    sow = [orjson.loads(v) if v else None for topic, _, _, v in producers[-1].delivered if topic == "orders.sow"]
    assert sow[:2] == [{"id": 1, "status": "open", "qty": 1}, {"id": 1, "status": "open", "qty": 2}]
    assert not [v for topic, _, _, v in producers[-1].delivered if topic == "EXP.orders" and orjson.loads(v)["qty"] == 1]


def test_an_input_left_with_an_open_transaction_holds_expiry_back_no_longer_than_the_idle_bound(monkeypatch, tmp_path):
    """An input's end moved past its last end event and nothing comes (a producer that died with a
    transaction open): expiry waits for it `max_idle_ms` at most, not until the broker aborts it."""
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, {"expiration": "1s"}, commit_interval_ms=0,
                                              expiry_tick_ms=1, max_idle_ms=200, guarantee=Guarantee.AT_LEAST_ONCE)
    assign(loop, consumer)
    t0 = now_ms() - 2_000  # due already
    consumer.script.append([Message("orders", 0, 0, _record(1, status="open"), t0),
                            end_of("orders", 0, 1), end_of("orders.delta", 0, 0), end_of("orders.repartition", 0, 0)])
    consumer.highs.update({("orders", 0): 1, ("orders.repartition", 0): 3})
    loop.cycle()
    time.sleep(0.05)
    loop.cycle()
    assert not [t for t, _, _, _ in producers[-1].delivered if t == "EXP.orders"]  # held while it may still come
    time.sleep(0.25)
    loop.cycle()
    assert len([t for t, _, _, _ in producers[-1].delivered if t == "EXP.orders"]) == 1


def _backlog() -> list:
    """A full batch (batch_max 3) of another input's events: the consumer's own queue holds more."""
    return [end_of("orders.repartition", 0, 0)] * 3


def test_while_the_consumer_is_backlogged_expiry_waits_for_the_broker_to_say_an_input_ended(monkeypatch, tmp_path):
    """Audit: with another topic's backlog growing, librdkafka fetched nothing more of an input (its
    queue was full), so neither its end event nor its cached end knew of a delta sent before its
    record's instant; the sweep expired the record by the clock (20 to 40 of 100 records)."""
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, {"expiration": "1s"}, commit_interval_ms=0,
                                              expiry_tick_ms=1, batch_max=3, guarantee=Guarantee.AT_LEAST_ONCE)
    assign(loop, consumer)
    admin = loop_module.make_admin("scripted:9092")
    t0 = now_ms() - 700  # the record's instant: t0 + 1 s, 0.3 s from now
    consumer.script.append([Message("orders", 0, 0, _record(1, status="open", qty=1), t0),
                            end_of("orders", 0, 1), end_of("orders.delta", 0, 0), end_of("orders.repartition", 0, 0)])
    loop.cycle()
    admin.ends.update({("orders", 0): 1, ("orders.delta", 0): 1})  # the delta (t0 + 600) is on the broker, not fetched
    for _ in range(6):  # the instant passes while the consumer hands out nothing but the backlog
        consumer.script.append(_backlog())
        time.sleep(0.1)
        loop.cycle()
    assert admin.asked and ("orders.delta", 0) in admin.asked[-1]
    consumer.script.append([Message("orders.delta", 0, 0, _record(1, qty=2), t0 + 600), end_of("orders.delta", 0, 1)])
    loop.cycle()
    sow = [orjson.loads(v) if v else None for topic, _, _, v in producers[-1].delivered if topic == "orders.sow"]
    assert sow[:2] == [{"id": 1, "status": "open", "qty": 1}, {"id": 1, "status": "open", "qty": 2}]


def _a_due_record(monkeypatch, tmp_path) -> tuple:
    """A loop whose first consume hands out a record due already and a full batch (batch_max 3), and
    an admin that will say nothing more is on the broker anywhere."""
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, {"expiration": "1s"}, commit_interval_ms=0,
                                              expiry_tick_ms=1, batch_max=3, guarantee=Guarantee.AT_LEAST_ONCE)
    assign(loop, consumer)
    admin = loop_module.make_admin("scripted:9092")
    consumer.script.append([Message("orders", 0, 0, _record(1, status="open"), now_ms() - 2_000),
                            end_of("orders", 0, 1), end_of("orders.delta", 0, 0), end_of("orders.repartition", 0, 0)])
    admin.ends.update({("orders", 0): 1})
    return loop, consumer, producers, admin


def test_while_the_consumer_is_backlogged_records_expire_once_the_broker_says_the_inputs_ended(monkeypatch, tmp_path):
    loop, consumer, producers, admin = _a_due_record(monkeypatch, tmp_path)
    for _ in range(4):
        loop.cycle()
        consumer.script.append(_backlog())
        time.sleep(0.03)
    loop.cycle()
    assert len([t for t, _, _, _ in producers[-1].delivered if t == "EXP.orders"]) == 1


def test_a_backlogged_sweep_goes_by_the_answer_to_the_question_the_sweep_before_asked(monkeypatch, tmp_path):
    """A sweep takes the broker's answer before it works out the expiry clocks. Taken after them, it
    bounded only the sweep after next: two gaps between sweeps (one of them a commit) of lateness."""
    loop, consumer, producers, admin = _a_due_record(monkeypatch, tmp_path)
    loop.cycle()  # a full batch: the consumer is backlogged, and the record's own input holds it back until asked about
    assert loop._backlogged
    out = loop._open or loop_module._Batch(loop)
    loop._open = None
    asked = lambda: any(("orders", 0) in question for question in admin.asked)  # noqa: E731
    for _ in range(3):
        if asked():
            break
        loop._next_sweep = 0.0
        loop._sweep_if_due(out)
    assert asked() and "EXP.orders" not in out.topics
    assert not [t for t, _, _, _ in producers[-1].delivered if t == "EXP.orders"]
    loop._next_sweep = 0.0
    loop._sweep_if_due(out)  # the answer came: nothing more anywhere, so the record expires now
    assert out.topics.get("EXP.orders") == 1
    loop._commit(out, out.offsets, out.applied)
    assert len([t for t, _, _, _ in producers[-1].delivered if t == "EXP.orders"]) == 1


def test_a_forced_merge_applies_all_that_waited_while_records_may_come_due(monkeypatch, tmp_path):
    """While records may come due, a merge takes a chunk at a time. Once an input behind has held the
    merge for max_idle_ms, the whole cycle goes, not its first chunk alone: that chunk reset the
    wait, and the next chunk waited the whole max_idle_ms again."""
    loop, consumer, _ = scripted_loop(monkeypatch, tmp_path, {"expiration": "1h"}, commit_interval_ms=0, max_idle_ms=50,
                                      guarantee=Guarantee.AT_LEAST_ONCE)
    applied = applied_inputs(loop)
    assign(loop, consumer)
    t0 = now_ms() - 10_000
    _publishes_at_their_end(consumer, 600, t0)
    loop.cycle()
    assert applied == []  # orders.delta has said nothing yet (behind): the merge waits
    time.sleep(0.1)
    loop.cycle()
    assert applied == [("orders", i) for i in range(600)]


def test_a_cycle_of_slow_inputs_ends_on_time_and_leaves_the_rest_queued(monkeypatch, tmp_path):
    """Review: a cycle applied every input consume() gave it before the next consume(). Inputs can
    each take a delete's filter budget (30 s): 20 of them in one batch kept the loop from consume()
    past max.poll.interval.ms (600 s), librdkafka took the worker out of its group, and the batch
    aborted. A cycle now stops after `max_cycle_ms` (after one input at least); the rest stay queued,
    in order, for the next cycles, which consume() first (here an input takes 0.1 s, a cycle 0.15 s)."""
    loop, consumer, _ = scripted_loop(monkeypatch, tmp_path, commit_interval_ms=0, guarantee=Guarantee.AT_LEAST_ONCE)
    loop.settings.max_cycle_ms = 150
    applied = applied_inputs(loop)
    engine = loop.engines["orders"]
    handle_one = engine.handle_one

    def slow(msg, now, out):
        time.sleep(0.1)
        return handle_one(msg, now, out)

    monkeypatch.setattr(engine, "handle_one", slow)
    consumes: list[int] = []  # inputs applied when consume() was called
    consume = consumer.consume
    monkeypatch.setattr(consumer, "consume", lambda n, timeout: consumes.append(len(applied)) or consume(n, timeout))
    assign(loop, consumer)
    t0 = now_ms() - 10_000
    consumer.script.append([Message("orders", 0, i, _record(i), t0 + i) for i in range(6)]
                           + [end_of("orders", 0, 6), end_of("orders.delta", 0, 0), end_of("orders.repartition", 0, 0)])
    loop.cycle()
    first = len(applied)
    assert 1 <= first <= 2 and consumer.offsets[("orders", 0)] == first  # what waits is not committed
    for _ in range(10):
        if len(applied) == 6:
            break
        loop.cycle()
    assert applied == [("orders", i) for i in range(6)]
    assert len(consumes) >= 3 and all(b - a <= 2 for a, b in zip(consumes, consumes[1:] + [6]))


def test_a_revoked_store_is_kept_if_assigned_back_and_let_go_of_if_not(monkeypatch, tmp_path):
    """A revoked partition's store stays open until the new assignment is known: given back, the
    same store serves on; left out, it is closed, so the worker of this host that took the
    partition opens it (RocksDB lets one process at a time) instead of rebuilding elsewhere."""
    loop, consumer, _ = scripted_loop(monkeypatch, tmp_path, topic={"persistence": "persistent"}, commit_interval_ms=0)
    assign(loop, consumer)
    loop.cycle()
    first = loop.tasks[("orders", 0)].store
    revoke(loop, consumer)
    assign(loop, consumer)
    loop.cycle()
    assert loop.tasks[("orders", 0)].store is first
    revoke(loop, consumer)
    loop._on_assign(consumer, [])  # the partition went to another worker
    other = open_partition_store("rocksdb", str(tmp_path / "sow" / "orders" / "p0"), IndexSpec())  # that worker's open
    other.close()
    assert not loop._parked


def test_a_batch_that_fails_on_a_deleted_output_topic_creates_it_again_and_is_redone(monkeypatch, tmp_path):
    """`.diff` deleted under the running loop: its batch fails (UNKNOWN_TOPIC_OR_PART from the
    transaction coordinator) and every later one would too. The abort creates the topology's
    missing topics again (at most once in _TOPICS_CHECK_S), and a new producer, which does not
    hold the topic as gone, redoes the batch: each input's events once."""
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, commit_interval_ms=0)
    admin = loop.admin
    assign(loop, consumer)
    t0 = now_ms() - 10_000
    batch = [Message("orders", 0, i, _record(i), t0 + i) for i in range(3)] + [end_of(t, 0, 3 if t == "orders" else 0) for t in INPUTS]
    consumer.script.append(list(batch))
    admin.gone = {"orders.diff"}
    producers[-1].fail_next_commit = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
    loop.cycle()
    assert admin.gone == set() and admin.ensured == 1 and len(producers) == 2
    assert producers[0].aborted == 1 and not producers[0].delivered
    consumer.script.append(list(batch))
    loop.cycle()
    diff = [orjson.loads(value)["id"] for topic, _, _, value in producers[1].delivered if topic == "orders.diff"]
    assert sorted(diff) == [0, 1, 2]
    loop._abort(KafkaError(KafkaError._TIMED_OUT))  # another failure at once: no second look
    assert admin.ensured == 1


def test_an_input_the_group_does_not_assign_holds_nothing_up(monkeypatch, tmp_path):
    """`orders.delta` deleted: the group assigns `orders` and `orders.repartition` alone. The merge
    took the missing input for one behind and waited `max_idle_ms` (10 s) before each input of
    `orders` it applied; there is nothing to wait for."""
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, commit_interval_ms=0)
    applied = applied_inputs(loop)
    loop._on_assign(consumer, [TopicPartition("orders", 0), TopicPartition("orders.repartition", 0)])
    consumer.script.append([Message("orders", 0, i, _record(i), now_ms() - 1000 + i) for i in range(3)]
                           + [end_of("orders", 0, 3), end_of("orders.repartition", 0, 0)])
    loop.cycle()
    assert applied == [("orders", i) for i in range(3)]


def test_partitions_revoked_before_their_restore_began_are_forgotten(monkeypatch, tmp_path):
    """Two partitions assigned: a cycle's restore slice ended in the first, the second's restore was
    made but not begun (its store not opened yet). A rebalance then (a worker joining) crashed the
    worker: its revocation rolled back a store that was not there."""
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, topic={"partitions": 2}, restore_slice_ms=0)
    both = [TopicPartition(t, p) for t in INPUTS for p in (0, 1)]
    loop._on_assign(consumer, both)
    loop.cycle()
    assert [t.store is None for t in loop.tasks.values()] == [False, True] and all(t.replay is not None or t.restored for t in loop.tasks.values())
    loop._on_revoke(consumer, both)
    assert not loop.tasks and list(loop._parked) == [("orders", 0)]
    loop._on_assign(consumer, both)  # back: the parked store is taken again, the other restored anew
    loop.cycle()
    loop.cycle()
    assert all(t.restored for t in loop.tasks.values())


def test_an_input_topic_deleted_under_the_loop_is_created_again_and_the_group_told(monkeypatch, tmp_path):
    """`orders.delta` deleted under the running loop: the group stops assigning it and the consumer
    says it is gone; its publishers' sends fail. The loop creates it again and, once it has leaders,
    subscribes again, so that the group assigns it at once rather than after the consumer's next
    metadata refresh (5 min); the producer, which does not write to it, stays."""
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, commit_interval_ms=0)
    assign(loop, consumer)
    loop.admin.gone = {"orders.delta"}
    consumer.script.append([Message("orders.delta", 0, error=KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, "Subscribed topic not available"))])
    loop.cycle()
    assert loop.admin.ensured == 0  # within a cycle: looked at before the next one
    loop.cycle()
    assert loop.admin.ensured == 1 and loop.admin.gone == set()
    assert consumer.subscriptions == [list(INPUTS)] and len(producers) == 1


def test_a_topic_created_again_with_a_smaller_limit_makes_one_new_producer(monkeypatch, tmp_path):
    """`.diff` deleted and created again with a smaller max.message.bytes: the look that creates it
    reads the new limit and makes the producer anew for it, and the recreation made another right
    after it (two init_transactions in a row, each fencing the last)."""
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, commit_interval_ms=0)
    assign(loop, consumer)
    consumer.script.append([Message("orders", 0, 0, _record(0), now_ms() - 10_000)] + [end_of(t, 0, 1 if t == "orders" else 0) for t in INPUTS])
    loop.admin.gone = {"orders.diff"}
    loop.admin.max_message_bytes = {"orders.diff": 4000}
    producers[-1].fail_next_commit = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
    loop.cycle()
    assert loop.admin.ensured == 1 and len(producers) == 2 and producers[1].config["batch.size"] == 4000 - 512


def test_an_errors_topic_made_compacted_under_the_loop_gets_keys_for_inputs_without_one(monkeypatch, tmp_path):
    """`.errors` made compacted under the running loop: the broker refuses the batch whose `.errors`
    record has no key (an input published without one, INVALID_RECORD), and refused it again each
    time it was redone. The abort reads the topics' settings: the redone batch gives that record
    its input's place as key; records with a key keep theirs."""
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, commit_interval_ms=0)
    assign(loop, consumer)
    t0 = now_ms() - 10_000
    batch = [Message("orders", 0, 0, b"{oops", t0, key=None), Message("orders", 0, 1, b"[1]", t0 + 1, key=b"mine"),
             Message("orders", 0, 2, _record(2), t0 + 2)] + [end_of(t, 0, 3 if t == "orders" else 0) for t in INPUTS]
    consumer.script.append(list(batch))
    loop.admin.configs["orders.errors"] = {"cleanup.policy": "compact"}
    producers[-1].fail_next_commit = KafkaError(KafkaError.INVALID_RECORD)
    loop.cycle()
    assert producers[0].aborted == 1 and len(producers) == 2
    consumer.script.append(list(batch))
    loop.cycle()
    assert [key for topic, key in producers[1].keys if topic == "orders.errors"] == [b"orders:0:0", b"mine"]
    assert [orjson.loads(v)["id"] for topic, _, _, v in producers[1].delivered if topic == "orders.sow"] == [2]


def test_a_message_without_a_key_takes_the_place_of_its_input():
    from processor.contract import headers as H

    errors = [("sow-error", b"not JSON"), (H.ERROR_TOPIC, b"orders"), (H.ERROR_PARTITION, b"3"), (H.ERROR_OFFSET, b"17")]
    assert loop_module._place_key(errors) == b"orders:3:17"
    copy = [(H.ORIGIN, b"sow_delete"), (H.LOCAL, b"1"), (H.SOURCE, b"orders:1:9")]  # a delete by filter fanned out
    assert loop_module._place_key(copy) == b"orders:1:9"


def test_a_batch_the_broker_refuses_as_too_large_is_redone_with_that_input_on_errors(monkeypatch, tmp_path):
    """An operator set an output topic's max.message.bytes to 4,000 under the running loop: the
    broker refuses the batch holding a 6,000-byte record (MSG_SIZE_TOO_LARGE), and refused it again
    each time it was redone, every partition stalled. The abort reads the output topics' limit: the
    redone batch puts that input on `.errors` with the reason and applies the others, and the new
    producer sends no message or batch larger than the topic takes."""
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, commit_interval_ms=0)
    assign(loop, consumer)
    t0 = now_ms() - 10_000
    big = _record(0, blob="x" * 6000)
    batch = [Message("orders", 0, 0, big, t0), Message("orders", 0, 1, _record(1), t0 + 1)] + [end_of(t, 0, 2 if t == "orders" else 0) for t in INPUTS]
    consumer.script.append(list(batch))
    loop.admin.max_message_bytes = {"orders.diff": 4000, "orders.sow": 1048588, "orders.errors": 1048588}
    producers[-1].fail_next_commit = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    loop.cycle()
    assert producers[0].aborted == 1 and len(producers) == 2
    assert producers[1].config["batch.size"] == 4000 - 512 and producers[1].config["message.max.bytes"] == producers[0].config["message.max.bytes"]
    consumer.script.append(list(batch))
    loop.cycle()
    delivered = producers[1].delivered
    assert [orjson.loads(value)["id"] for topic, _, _, value in delivered if topic == "orders.diff"] == [1]
    assert [value for topic, _, _, value in delivered if topic == "orders.errors"] == [big]
    (reason,) = [dict(headers)["sow-error"] for topic, headers in producers[1].headers if topic == "orders.errors"]
    assert b"over the limit of 2464" in reason  # 4,000 less a batch's framing and room for key and headers


def test_an_errors_record_larger_than_its_topic_takes_is_cut_short(monkeypatch, tmp_path):
    """`.errors` takes 3,000-byte messages (its max.message.bytes), less than the producer's limit:
    the `.errors` record of a 6,000-byte input the SOW refused is cut to what it takes, with the
    reason, where the broker refused it and its batch each time it was redone."""
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, commit_interval_ms=0)
    loop.admin.max_message_bytes = {"orders.diff": 4000, "orders.errors": 3000}
    loop.ensure_topics()
    assign(loop, consumer)
    big = _record(0, blob="x" * 6000)
    consumer.script.append([Message("orders", 0, 0, big, now_ms() - 10_000)] + [end_of(t, 0, 1 if t == "orders" else 0) for t in INPUTS])
    loop.cycle()
    (cut,) = [value for topic, _, _, value in producers[-1].delivered if topic == "orders.errors"]
    assert cut == big[:(3000 - 512) // 2]
    (said,) = [headers for topic, headers in producers[-1].headers if topic == "orders.errors"]
    assert [v for k, v in said if k == "sow-error"][-1].startswith(b"message of ")


def test_a_batch_that_keeps_aborting_is_redone_less_and_less_often_until_one_commits(monkeypatch, tmp_path):
    """A failure that outlasts a retry (an output's WRITE ACL taken away) aborted every batch and
    redid it at once: about 5 aborts a second, each with its warnings, for as long as it lasted.
    From the second abort in a row each redo waits twice as long as the last (0.2 s up to 5 s);
    a commit ends it."""
    loop, consumer, producers = scripted_loop(monkeypatch, tmp_path, commit_interval_ms=0)
    waits: list[float] = []
    monkeypatch.setattr(loop._stop, "wait", lambda timeout=None: waits.append(timeout) or False)
    assign(loop, consumer)
    t0 = now_ms() - 10_000
    ends = [end_of("orders", 0, 1), end_of("orders.delta", 0, 0), end_of("orders.repartition", 0, 0)]
    for _ in range(8):
        producers[-1].fail_next_commit = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)
        consumer.script.append([Message("orders", 0, 0, _record(0), t0), *ends])
        loop.cycle()
    assert waits == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    consumer.script.append([Message("orders", 0, 0, _record(0), t0), *ends])
    loop.cycle()
    assert [orjson.loads(v) for p in producers for topic, _, _, v in p.delivered if topic == "orders.sow"] == [{"id": 0}]
    producers[-1].fail_next_commit = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    consumer.script.append([Message("orders", 0, 1, _record(1), t0 + 1), end_of("orders", 0, 2), *ends[1:]])
    loop.cycle()
    assert len(waits) == 7  # the first abort after a commit is redone at once
