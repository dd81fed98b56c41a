"""The worker's own answers to hostile state and input on a real broker: a `.sow` changelog deleted
while the worker was down (re-seeded, not wiped), a record that would outgrow a Kafka message
(refused, on `.errors`), a record on `.sow` that is not a SOW record (skipped on restore),
partitions added to an input topic under a running worker (it stops, in one line), output topics
deleted under a running worker (created again, nothing lost or repeated; an input topic and the registry too), an output topic that
takes smaller messages than ksow's limits or no timestamp as old as an input's, a changelog that removes records by time (refused), the
broker itself crashing under a stream of inputs."""

from __future__ import annotations

import time

import orjson
import pytest

from processor.client.sow_client import Client
from processor.kafka.clients import ensure_topics, topic_configs
from processor.testing import WorkerProcess, read_topic, wait_until
from processor.topology import load_topology

from .workers import compacted, headers_of, producer, set_topic_config, write_topology

pytestmark = pytest.mark.integration


def _sow(bootstrap, spec) -> dict:
    return {k: orjson.loads(v) for k, v in compacted(bootstrap, spec.sow_topic, spec.partitions).items()}


@pytest.mark.parametrize("crash", [False, True], ids=["", "killed-before-the-reseed-commits"])
def test_a_deleted_changelog_is_reseeded_from_the_store_not_wiped(kafka_bootstrap, unique_name, tmp_path, admin, crash):
    """With `crash`, the first worker after the deletion is killed before the re-seed's transaction
    commits: the next one must find the store still ahead of the log and re-seed it."""
    path = write_topology(tmp_path, unique_name)
    spec = load_topology(path).sow[0]
    client = Client(kafka_bootstrap, load_topology(path))
    worker = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "w1").start()
    for i in range(20):
        client.publish(unique_name, {"id": i, "v": i})
    client.flush()
    wait_until(lambda: len(_sow(kafka_bootstrap, spec)) == 20, 60, "20 records on .sow")
    worker.stop()
    # The changelog is deleted and recreated (empty) while no worker runs.
    admin.delete_topics([spec.sow_topic])[spec.sow_topic].result(30)
    wait_until(lambda: spec.sow_topic not in admin.list_topics(timeout=10).topics, 30, ".sow gone")
    ensure_topics(admin, {spec.sow_topic: topic_configs(spec)[spec.sow_topic]})
    if crash:
        killed = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "w-killed", env={"KSOW_TEST_KILL_AT": "commit:1"})
        killed.start(wait=False)
        wait_until(lambda: killed.proc.poll() is not None, 90, "the kill before the re-seed's commit")
        assert "re-seeding the changelog" in killed.log() and "signal 9 at commit" in killed.log()
    again = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "w2").start()
    try:
        wait_until(lambda: len(_sow(kafka_bootstrap, spec)) == 20, 60, "the changelog re-seeded")
        assert "re-seeding the changelog" in again.log()
        assert sorted(e.record["id"] for e in client.query(unique_name)) == list(range(20))
    finally:
        again.kill()


def test_a_record_that_would_outgrow_a_message_is_refused(kafka_bootstrap, unique_name, tmp_path):
    path = write_topology(tmp_path, unique_name)
    spec = load_topology(path).sow[0]
    client = Client(kafka_bootstrap, load_topology(path))
    worker = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "w", env={"KSOW_MAX_RECORD_BYTES": "5000"}).start()
    try:
        client.publish(unique_name, {"id": 1, "a": "x" * 3000})
        client.publish(unique_name, {"id": 1, "b": "y" * 3000}, delta=True)  # merged: over 5,000 bytes
        client.publish(unique_name, {"id": 2, "ok": True})
        client.flush()
        errors = wait_until(lambda: read_topic(kafka_bootstrap, spec.errors_topic, range(spec.partitions)), 60, "the refusal")
        assert b"over the limit of 5000" in dict(errors[0].headers())["sow-error"]
        wait_until(lambda: len(_sow(kafka_bootstrap, spec)) == 2, 60, "the other record applied")
        assert _sow(kafka_bootstrap, spec)[spec.key_spec.sow_key({"id": 1}).encode()] == {"id": 1, "a": "x" * 3000}
        assert worker.proc.poll() is None
    finally:
        worker.kill()


def test_a_record_on_sow_that_is_no_sow_record_is_skipped_on_restore(kafka_bootstrap, unique_name, tmp_path, admin):
    from processor.kafka.clients import make_producer

    path = write_topology(tmp_path, unique_name)
    spec = load_topology(path).sow[0]
    client = Client(kafka_bootstrap, load_topology(path))
    worker = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d1", "w1").start()
    client.publish(unique_name, {"id": 1, "v": 1})
    client.flush()
    wait_until(lambda: len(_sow(kafka_bootstrap, spec)) == 1, 60, "one record")
    worker.stop()
    junk = make_producer(kafka_bootstrap)
    for partition in range(spec.partitions):
        junk.produce(spec.sow_topic, b"{not json", b"k", partition, headers=[("sow-seq", b"nope")])
    assert junk.flush(30) == 0
    # A fresh data folder: the new worker rebuilds every partition from `.sow`, junk included.
    again = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d2", "w2").start()
    try:
        wait_until(lambda: again.log().count("restored ") >= spec.partitions, 60, "every partition restored")
        assert "not a SOW record" in again.log()
        assert [e.record for e in client.query(unique_name)] == [{"id": 1, "v": 1}]
        client.publish(unique_name, {"id": 2, "v": 2})
        client.flush()
        wait_until(lambda: len(client.query(unique_name)) == 2, 60, "it goes on")
    finally:
        again.kill()


def test_a_partition_restoring_holds_up_neither_the_other_partitions_nor_their_expiry(kafka_bootstrap, unique_name, tmp_path, admin):
    """A worker that takes on a partition with a long changelog (300,000 records: seconds of restore)
    applies and expires the records of its other partition meanwhile. Partition 1's own delta waits
    for the end of its restore and merges into the restored record."""
    from processor.core.keys import owner_partition
    from processor.kafka.clients import make_producer

    path = write_topology(tmp_path, unique_name, partitions=2, expiration="enabled")
    spec = load_topology(path).sow[0]
    ensure_topics(admin, topic_configs(spec))
    key = spec.key_spec.sow_key
    ours, theirs = [next(i for i in range(100) if owner_partition(key({"id": i}), 2) == p) for p in (0, 1)]
    producer = make_producer(kafka_bootstrap, **{"linger.ms": 20})
    for n, i in enumerate([theirs, *range(1_000, 300_999)]):  # partition 1's changelog, as a worker wrote it
        producer.produce(spec.sow_topic, orjson.dumps({"id": i, "restored": True}), key({"id": i}).encode(), 1,
                         headers=[("sow-seq", b"%d" % ((n + 1) << 10 | 1))])
        if n % 50_000 == 0:
            producer.flush(60)
    assert producer.flush(60) == 0
    # Partition 0's record expires 1 s after it is applied; partition 1's delta waits for its restore.
    producer.produce(spec.topic, orjson.dumps({"id": ours}), key({"id": ours}).encode(), 0, headers=[("sow-expiration", b"1s")])
    producer.produce(spec.delta_topic, orjson.dumps({"id": theirs, "delta": True}), key({"id": theirs}).encode(), 1)
    assert producer.flush(30) == 0
    worker = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "w").start(wait=False)
    try:
        restored = f"restored {unique_name} partition 1:"
        wait_until(lambda: read_topic(kafka_bootstrap, f"EXP.{unique_name}", [0]), 120, "partition 0's record expired")
        assert restored not in worker.log(), "partition 0 waited for partition 1's restore"
        worker.wait_for(restored, 120)
        assert f"{restored} 300000 changelog records, 300000 in SOW" in worker.log()
        client = Client(kafka_bootstrap, load_topology(path))
        found = wait_until(lambda: [e.record for e in client.query(unique_name, keys=[key({"id": theirs})]) if "delta" in e.record], 60, "the delta")
        assert found == [{"id": theirs, "restored": True, "delta": True}]
        assert worker.proc.poll() is None
    finally:
        worker.kill()


def test_a_worker_without_data_dir_finds_its_stores_again(tmp_path):
    from processor.runners.faust.worker import default_data_dir
    from processor.topology import parse_topology

    one = parse_topology({"sow": [{"topic": "orders", "key": ["/id"]}]})
    other = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 4}]})
    assert default_data_dir("g", one) == default_data_dir("g", parse_topology({"sow": [{"topic": "orders", "key": ["/id"]}]}))
    assert default_data_dir("g", one) != default_data_dir("g", other) != default_data_dir("h", other)


def test_a_delete_by_filter_over_many_records_commits_as_it_goes(kafka_bootstrap, unique_name, tmp_path, admin):
    """30,000 records removed by one `1=1` delete: the worker commits every 10,000 removals
    (KSOW_DELETE_CHUNK, engine.partition.checkpoint), and every tombstone is there exactly once."""
    from processor.kafka.clients import make_producer

    path = write_topology(tmp_path, unique_name)
    spec = load_topology(path).sow[0]
    ensure_topics(admin, topic_configs(spec))
    producer = make_producer(kafka_bootstrap)
    for i in range(30_000):
        producer.produce(spec.topic, orjson.dumps({"id": i}), spec.key_spec.sow_key({"id": i}).encode())
    assert producer.flush(60) == 0
    worker = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "w").start()
    try:
        wait_until(lambda: len(_sow(kafka_bootstrap, spec)) == 30_000, 120, "30,000 records")
        producer.produce(spec.topic, None, b"all", headers=[("sow-command", b"sow_delete"), ("sow-filter", b"1=1")])
        assert producer.flush(30) == 0
        wait_until(lambda: not _sow(kafka_bootstrap, spec), 120, "an empty SOW")
        tombstones = [m.key() for m in read_topic(kafka_bootstrap, spec.sow_topic, range(spec.partitions)) if m.value() is None]
        assert len(tombstones) == len(set(tombstones)) == 30_000
        assert worker.proc.poll() is None
    finally:
        worker.kill()


def test_publish_from_stdin_stops_at_a_bad_line_and_says_what_went_before_it(kafka_bootstrap, unique_name, tmp_path):
    from click.testing import CliRunner

    from processor.cli.commands import main

    path = write_topology(tmp_path, unique_name)
    spec = load_topology(path).sow[0]
    worker = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "w").start()
    try:
        lines = '{"id": 1}\n{"id": 2}\n{"id": 3\n{"id": 4}\n'
        result = CliRunner().invoke(main, ["publish", unique_name, "-", "--bootstrap", kafka_bootstrap, "--topology", str(path)], input=lines)
        assert result.exit_code == 1
        assert "line 3: not valid JSON" in result.output and "the 2 record(s) before it were published" in result.output
        wait_until(lambda: len(_sow(kafka_bootstrap, spec)) == 2, 60, "the two lines before the bad one")
        assert sorted(r["id"] for r in _sow(kafka_bootstrap, spec).values()) == [1, 2]
    finally:
        worker.kill()


def test_a_setting_the_cluster_refuses_stops_the_worker_with_one_line(kafka_bootstrap, unique_name, tmp_path):
    """A session timeout outside the broker's bounds: the worker says why in one line and exits 1
    (its supervisor sees a failure), without a crash report's tracebacks burying that line."""
    path = write_topology(tmp_path, unique_name)
    worker = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", env={"KSOW_SESSION_TIMEOUT_MS": "1000"})
    worker.start(wait=False)
    try:
        assert worker.proc.wait(90) == 1
    finally:
        worker.kill()
    log = worker.log()
    assert log.count("refuses this worker's settings") == 1 and "KSOW_SESSION_TIMEOUT_MS must be within" in log
    assert "Traceback" not in log and "Crashed" not in log


def test_partitions_added_to_an_input_under_a_running_worker_stop_it_with_one_line(kafka_bootstrap, unique_name, tmp_path, admin):
    """An operator raises `<topic>` from 4 partitions to 8 while a worker runs. No SOW partition owns
    what lands on the new ones, and the range assignor would give `<topic>[p]` and `.delta[p]` to
    different workers: the worker stops at the assignment that brings them, before applying
    anything (it stalled every 30 s before, on a `.sow` partition that does not exist), and one
    started again refuses at once, both in one line and with exit status 1."""
    from confluent_kafka.admin import NewPartitions

    path = write_topology(tmp_path, unique_name)
    spec = load_topology(path).sow[0]
    env = {"KAFKA_TOPIC_METADATA_REFRESH_INTERVAL_MS": "2000"}  # librdkafka sees new partitions at its next refresh: 5 min by default
    worker = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "w", env=env).start()
    try:
        client = Client(kafka_bootstrap, load_topology(path))
        client.publish(spec.topic, {"id": 1})
        client.flush()
        wait_until(lambda: read_topic(kafka_bootstrap, spec.diff_topic, range(4)), 60, "the first record applied")
        for future in admin.create_partitions([NewPartitions(spec.topic, 8)]).values():
            future.result()
        assert worker.proc.wait(90) == 1
    finally:
        worker.kill()
    said = f"topic {spec.topic} has 8 partitions but the topology says partitions: 4 for {spec.topic}"
    assert worker.log().count(said) == 1 and "Traceback" not in worker.log()
    again = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "again", env=env).start(wait=False)
    try:
        assert again.proc.wait(90) == 1
    finally:
        again.kill()
    assert again.log().count(said) == 1 and "Traceback" not in again.log()


def test_output_topics_deleted_under_a_running_worker_are_created_again_and_nothing_is_lost(kafka_bootstrap, unique_name, tmp_path, admin):
    """An operator (or a clean-up script) deletes `.diff` and the `.sow` changelog while a worker
    runs. Every batch aborted on them, forever (seen: an abort every 0.3 s, nothing applied). The
    worker creates them again as at start and redoes the batch: the new `.diff` holds each later
    input's event once, and the store, kept, is re-seeded into the new `.sow`."""
    path = write_topology(tmp_path, unique_name)
    spec = load_topology(path).sow[0]
    client = Client(kafka_bootstrap, load_topology(path))
    worker = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "w").start()
    try:
        for i in range(20):
            client.publish(spec.topic, {"id": i, "v": 0})
        client.flush()
        wait_until(lambda: len(read_topic(kafka_bootstrap, spec.diff_topic, range(4))) == 20, 60, "20 inserts on .diff")
        gone = [spec.diff_topic, spec.sow_topic]
        for future in admin.delete_topics(gone).values():
            future.result(30)
        wait_until(lambda: not set(gone) & set(admin.list_topics(timeout=10).topics), 30, "the topics deleted")
        for i in range(15, 30):  # 5 updates, 10 inserts
            client.publish(spec.topic, {"id": i, "v": 1})
        client.flush()

        def events():
            if spec.diff_topic not in admin.list_topics(timeout=10).topics:
                return []
            return [(headers_of(m)["sow-op"], orjson.loads(m.value())["id"]) for m in read_topic(kafka_bootstrap, spec.diff_topic, range(4))]

        wait_until(lambda: len(events()) >= 15, 120, "the inputs after the deletion applied")
        time.sleep(2)  # anything repeated would be committed by now
        assert sorted(events()) == sorted([("update", i) for i in range(15, 20)] + [("insert", i) for i in range(20, 30)])
        wait_until(lambda: len(_sow(kafka_bootstrap, spec)) == 30, 60, "the store re-seeded into the new .sow")
        assert {r["id"]: r["v"] for r in _sow(kafka_bootstrap, spec).values()} == {i: int(i >= 15) for i in range(30)}
        assert sorted(e.record["id"] for e in client.query(spec.topic)) == list(range(30))
        assert "created again" in worker.log() and worker.proc.poll() is None
    finally:
        worker.stop()


def test_an_input_topic_deleted_under_a_running_worker_is_created_again_and_read(kafka_bootstrap, unique_name, tmp_path, admin):
    """`.delta` deleted under a running worker: librdkafka noticed at its next metadata refresh,
    5 minutes by default, and each input of the SOW topic waited 10 s meanwhile for the partitions
    the group no longer assigned. ksow's clients refresh every 30 s: the worker creates the topic
    again and joins its group anew, and a delta sent to the new `.delta` is applied."""
    path = write_topology(tmp_path, unique_name)
    spec = load_topology(path).sow[0]
    client = Client(kafka_bootstrap, load_topology(path), f"g-{unique_name}")
    worker = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "w").start()
    values = lambda: {e.record["id"]: e.record["v"] for e in client.query(spec.topic)}  # noqa: E731
    try:
        for i in range(4):
            client.publish(spec.topic, {"id": i, "v": 0})
        client.flush()
        wait_until(lambda: values() == {i: 0 for i in range(4)}, 60, "4 records")
        admin.delete_topics([spec.delta_topic])[spec.delta_topic].result(30)
        deleted = time.monotonic()
        wait_until(lambda: spec.delta_topic not in admin.list_topics(timeout=10).topics, 30, "the topic deleted")
        wait_until(lambda: spec.delta_topic in admin.list_topics(timeout=10).topics, 90, "the topic created again")
        assert time.monotonic() - deleted < 60  # 30 s to notice, at most, and the creation
        p = producer(kafka_bootstrap)
        p.produce(spec.delta_topic, orjson.dumps({"id": 1, "v": 2}), spec.key_spec.sow_key({"id": 1}).encode())
        p.flush(30)
        client.publish(spec.topic, {"id": 9, "v": 0})
        client.flush()
        wait_until(lambda: values() == {0: 0, 1: 2, 2: 0, 3: 0, 9: 0}, 60, "the delta to the new topic and a later input applied")
        assert "created again: " + spec.delta_topic in worker.log() and worker.proc.poll() is None
    finally:
        worker.stop()


def test_a_registry_topic_deleted_under_a_running_worker_is_created_again(kafka_bootstrap, unique_name, tmp_path, admin):
    """Clients find workers through the registry topic. Deleted under a running worker, it stayed
    gone: the worker's announcements failed, and clients fell back to reading `.sow`, for as long
    as the worker ran. The worker creates it again and announces itself there."""
    registry = f"__ksow_workers-{unique_name}"
    path = write_topology(tmp_path, unique_name)
    # librdkafka finds a topic gone at its next metadata refresh: every 30 s in ksow, 2 s here
    env = {"KSOW_REGISTRY_TOPIC": registry, "KAFKA_TOPIC_METADATA_REFRESH_INTERVAL_MS": "2000"}
    worker = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "w", env=env).start()
    try:
        wait_until(lambda: read_topic(kafka_bootstrap, registry, [0]), 60, "the worker announced")
        admin.delete_topics([registry])[registry].result(30)
        wait_until(lambda: registry not in admin.list_topics(timeout=10).topics, 30, "the registry deleted")

        def announced():
            topics = admin.list_topics(timeout=10).topics
            return registry in topics and any(orjson.loads(m.value())["group"] == f"g-{unique_name}" for m in read_topic(kafka_bootstrap, registry, [0]))

        wait_until(announced, 90, "the registry created again, with the worker in it")
        assert f"the registry topic {registry} is gone: creating it again" in worker.log()
    finally:
        worker.stop()
        admin.delete_topics([registry])


def test_an_output_topic_that_takes_smaller_messages_refuses_larger_records_onto_errors(kafka_bootstrap, unique_name, tmp_path, admin):
    """An operator sets `.diff`'s max.message.bytes to 4,000 under a running worker. A record of
    6,000 incompressible bytes made the broker refuse its batch, and again each time it was redone:
    nothing applied on any partition, for as long as the worker ran (seen: an abort every 10 s).
    Now that input goes to `.errors` with the reason, and the small records around it are applied,
    in batches the topic takes."""
    import random
    import string

    path = write_topology(tmp_path, unique_name)
    spec = load_topology(path).sow[0]
    client = Client(kafka_bootstrap, load_topology(path))
    worker = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "w").start()
    try:
        client.publish(spec.topic, {"id": -1})
        client.flush()
        wait_until(lambda: read_topic(kafka_bootstrap, spec.diff_topic, range(4)), 60, "the first record applied")
        set_topic_config(admin, spec.diff_topic, "max.message.bytes", "4000")
        rnd = random.Random(7)
        noise = lambda n: "".join(rnd.choice(string.ascii_letters) for _ in range(n))  # noqa: E731 - lz4 does not shrink it
        client.publish(spec.topic, {"id": 0, "blob": noise(6000)})
        for i in range(1, 301):
            client.publish(spec.topic, {"id": i, "blob": noise(100)})
        client.flush()
        wait_until(lambda: len(read_topic(kafka_bootstrap, spec.diff_topic, range(4))) == 301, 120, "the 300 small records applied")
        (refused,) = read_topic(kafka_bootstrap, spec.errors_topic, range(4))
        assert orjson.loads(refused.value())["id"] == 0
        assert "over the limit of 2464" in headers_of(refused)["sow-error"]
        assert sorted(e.record["id"] for e in client.query(spec.topic)) == [-1, *range(1, 301)]
        assert worker.proc.poll() is None
    finally:
        worker.stop()


def test_an_input_older_than_the_changelog_takes_does_not_stall_its_partition(kafka_bootstrap, unique_name, tmp_path, admin):
    """`.sow` set under a running worker to take timestamps of at most a day ago, `timestamps:
    publisher`: a record's `.sow` message carries its last-change instant, the publisher's stamp.
    One input stamped two days ago made the broker refuse its batch, and again each time it was
    redone: the partition applied nothing after it. Now such an instant is written as the oldest
    `.sow` takes: the first batch refused tells the worker, the next commits."""
    path = write_topology(tmp_path, unique_name, timestamps="publisher", partitions=1)
    spec = load_topology(path).sow[0]
    day = 86_400_000
    worker = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "w").start()
    try:
        set_topic_config(admin, spec.sow_topic, "message.timestamp.before.max.ms", str(day))
        p = producer(kafka_bootstrap)
        now = int(time.time() * 1000)
        p.produce(spec.topic, orjson.dumps({"id": 1, "status": "late"}), timestamp=now - 2 * day)
        p.produce(spec.topic, orjson.dumps({"id": 2, "status": "new"}), timestamp=now)
        p.flush(30)
        wait_until(lambda: {r["id"]: r["status"] for r in _sow(kafka_bootstrap, spec).values()} == {1: "late", 2: "new"}, 60, "both records on .sow")
        assert worker.log().count("batch not committed") == 1  # one refusal, then a new producer (no "skipped sequence numbers")
        assert f"{spec.sow_topic} takes no timestamp older than {day} ms" in worker.log()
        stamps = sorted(m.timestamp()[1] for m in read_topic(kafka_bootstrap, spec.sow_topic, [0]))
        assert now - day < stamps[0] < now - day + 120_000 and stamps[1] == now
    finally:
        worker.stop()


def test_an_input_without_a_key_that_lands_on_a_compacted_errors_topic_does_not_stall_the_worker(kafka_bootstrap, unique_name, tmp_path, admin):
    """`.errors` made compacted (by hand, or by a cluster whose default policy is compact): a broker
    refuses a message without a key there. An input published without one that could not be
    applied went to `.errors` with its own (none): its batch was refused each time it was redone,
    and the worker applied nothing more. It now takes its place as key."""
    path = write_topology(tmp_path, unique_name, partitions=1)
    spec = load_topology(path).sow[0]
    ensure_topics(admin, {spec.errors_topic: (1, {"cleanup.policy": "compact"})})
    worker = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "w").start()
    try:
        p = producer(kafka_bootstrap)
        p.produce(spec.topic, b"{oops")  # no key
        p.produce(spec.topic, orjson.dumps({"id": 2}))
        p.flush(30)
        wait_until(lambda: _sow(kafka_bootstrap, spec), 60, "the record after the bad input on .sow")
        (refused,) = read_topic(kafka_bootstrap, spec.errors_topic, [0])
        assert refused.value() == b"{oops" and refused.key() == f"{spec.topic}:0:0".encode()  # its place
        assert "batch not committed" not in worker.log()
    finally:
        worker.stop()


def test_a_worker_refuses_a_changelog_that_removes_records_by_time(kafka_bootstrap, unique_name, tmp_path, admin):
    """`.sow` created by someone else with Kafka's default policy (delete, after 7 days): a store
    rebuilt from it would lose every record not changed for a week. The worker refuses to start,
    in one line that says how to mend it; mended, it starts."""
    path = write_topology(tmp_path, unique_name)
    spec = load_topology(path).sow[0]
    ensure_topics(admin, {spec.sow_topic: (spec.partitions, {})})
    worker = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "w").start(wait=False)
    try:
        assert worker.proc.wait(90) == 1
    finally:
        worker.kill()
    assert worker.log().count(f"topic {spec.sow_topic} has cleanup.policy=delete, retention.ms=604800000") == 1
    assert "--add-config cleanup.policy=compact" in worker.log() and "Traceback" not in worker.log()
    set_topic_config(admin, spec.sow_topic, "cleanup.policy", "compact")
    mended = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "mended").start()
    try:
        client = Client(kafka_bootstrap, load_topology(path))
        client.publish(spec.topic, {"id": 1})
        client.flush()
        wait_until(lambda: _sow(kafka_bootstrap, spec), 60, "the record on .sow")
    finally:
        mended.stop()


def test_a_worker_rides_out_a_broker_crash_and_applies_and_expires_each_input_once(tmp_path, monkeypatch):
    """The broker is SIGKILLed while inputs stream in and a batch is open, and comes back 15 s later
    (past the session and transaction timeouts): the worker does not exit, and every output topic,
    read_committed, tells each input and each expiry exactly once. A broker of the test's own, on a
    data folder it can restart on (the session's broker must not go down)."""
    import threading
    from collections import Counter

    from confluent_kafka import Producer

    from processor.kafka.embedded import EmbeddedKafka
    from processor.runners.faust.worker import free_port

    monkeypatch.setenv("KSOW_REGISTRY_TOPIC", "__ksow_workers_outage")  # this broker has no other worker
    port = free_port()  # the port the broker comes back on: the worker keeps its address
    kafka = EmbeddedKafka(port=port, data_dir=tmp_path / "kafka").start()
    bootstrap = kafka.bootstrap
    path = write_topology(tmp_path, "outage", expiration="enabled")
    spec = load_topology(path).sow[0]
    worker = WorkerProcess(bootstrap, path, "g-outage", tmp_path / "d", "w").start()
    n, keys, expiring = 3_000, 50, 20
    try:
        publisher = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True, "logger": None})
        for i in range(expiring):  # due 8 s after they are applied: while the broker is down
            publisher.produce(spec.topic, orjson.dumps({"id": f"x{i}"}), f"x{i}".encode(), headers=[("sow-expiration", b"8s")])

        def stream():  # ~15 s of inputs, each changing its record; the publisher retries through the outage
            for i in range(n):
                publisher.produce(spec.topic, orjson.dumps({"id": i % keys, "v": i}), str(i % keys).encode())
                publisher.poll(0)
                time.sleep(0.005)
            publisher.flush(300)

        sender = threading.Thread(target=stream)
        sender.start()
        time.sleep(4)
        kafka.process.kill()
        kafka.process.wait()
        time.sleep(15)
        kafka = EmbeddedKafka(port=port, data_dir=tmp_path / "kafka").start()
        sender.join()
        assert publisher.flush(60) == 0
        wait_until(lambda: len(read_topic(bootstrap, spec.diff_topic, range(4))) >= n + 2 * expiring, 180, "every input and expiry told")
        time.sleep(3)  # a repeated event would show by now
        told = Counter((dict(m.headers())["sow-op"].decode(), m.value()) for m in read_topic(bootstrap, spec.diff_topic, range(4)))
        assert {event: c for event, c in told.items() if c > 1} == {}
        assert sorted(v for (_, value) in told if (v := orjson.loads(value).get("v")) is not None) == list(range(n))
        assert Counter(op for op, _ in told) == {"insert": keys + expiring, "update": n - keys, "expire": expiring}
        expired = Counter(m.key() for m in read_topic(bootstrap, f"EXP.{spec.topic}", range(4)))
        assert len(expired) == expiring and set(expired.values()) == {1}
        assert _sow(bootstrap, spec) == {spec.key_spec.sow_key({"id": k}).encode(): {"id": k, "v": n - keys + k} for k in range(keys)}
        assert worker.proc.poll() is None, worker.log()[-3000:]
    finally:
        worker.kill()
        kafka.stop()
