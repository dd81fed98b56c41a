"""The Faust worker against a real broker: flows, errors, restarts, crashes and two workers."""

from __future__ import annotations

import random
import re

import orjson
import pytest

from processor.client.sow_client import Client
from processor.core.merge import merge
from processor.topology import load_topology

from .workers import Worker, headers_of, producer, read_all, wait_until, write_topology

pytestmark = pytest.mark.integration


@pytest.fixture
def setup(kafka_bootstrap, unique_name, tmp_path):
    topo_path = write_topology(tmp_path, unique_name)
    topology = load_topology(topo_path)
    group = f"g-{unique_name}"
    workers: list[Worker] = []

    def worker(name="w", data="d1", start=True):
        w = Worker(kafka_bootstrap, topo_path, group, tmp_path / data, name)
        workers.append(w)
        return w.start() if start else w

    client = Client(kafka_bootstrap, topology)
    yield unique_name, worker, client
    for w in workers:
        w.kill()


def sow_of(client, topic):
    return {orjson.dumps(e.record["id"]).decode(): e.record for e in client.query(topic)}


def test_publish_delta_delete_with_exact_outputs(setup, kafka_bootstrap):
    topic, worker, client = setup
    worker()
    key1 = client.publish(topic, {"id": 1, "status": "open", "qty": 10, "px": {"bid": 1.0, "ask": 2.0}})
    client.publish(topic, {"id": 2, "status": "open", "qty": 5})
    client.flush()
    wait_until(lambda: len(read_all(kafka_bootstrap, f"{topic}.diff")) == 2)  # <topic>.delta is not ordered with <topic>
    client.publish(topic, {"id": 1, "qty": 20, "px": {"ask": 2.5}}, delta=True)
    client.delete(topic, data={"id": 2})
    client.flush()
    diffs = wait_until(lambda: (m := read_all(kafka_bootstrap, f"{topic}.diff")) and len(m) >= 4 and m)
    by_key = {}
    for m in diffs:
        by_key.setdefault(m.key().decode(), []).append((headers_of(m)["sow-op"], orjson.loads(m.value())))
    assert by_key[key1] == [
        ("insert", {"id": 1, "status": "open", "qty": 10, "px": {"bid": 1.0, "ask": 2.0}}),
        ("update", {"id": 1, "qty": 20, "px": {"ask": 2.5}}),
    ]
    (key2,) = set(by_key) - {key1}
    assert by_key[key2] == [("insert", {"id": 2, "status": "open", "qty": 5}), ("delete", {"id": 2, "status": "open", "qty": 5})]
    sow = read_all(kafka_bootstrap, f"{topic}.sow")
    last = {m.key().decode(): m for m in sow}
    assert orjson.loads(last[key1].value()) == {"id": 1, "status": "open", "qty": 20, "px": {"bid": 1.0, "ask": 2.5}}
    assert last[key2].value() is None and headers_of(last[key2])["sow-op"] == "delete"
    seqs = [int(headers_of(m)["sow-seq"]) for m in sow if m.key().decode() == key1]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert sow_of(client, topic) == {"1": {"id": 1, "status": "open", "qty": 20, "px": {"bid": 1.0, "ask": 2.5}}}


def test_malformed_inputs_land_on_errors_and_change_nothing(setup, kafka_bootstrap):
    topic, worker, client = setup
    worker()
    client.publish(topic, {"id": 1, "v": 1})
    client.flush()
    wait_until(lambda: sow_of(client, topic))
    p = producer(kafka_bootstrap)
    bad = [
        (topic, b"{not json", b"a", []),
        (topic, b'{"v": 2}', b"b", []),
        (f"{topic}.delta", b'{"id": 1, "v": 3}', b"c", [("sow-command", b"frobnicate")]),
        (topic, b'{"id": 1, "v": 4}', b"d", [("sow-expiration", b"whenever")]),
        (topic, b"[1, 2, 3]", b"e", []),
        (topic, None, b"f", []),
    ]
    for t, value, key, headers in bad:
        p.produce(t, value, key, headers=headers)
    p.flush()
    errors = wait_until(lambda: (m := read_all(kafka_bootstrap, f"{topic}.errors")) and len(m) >= len(bad) and m)
    got = {m.key(): (m.value(), headers_of(m)["sow-error"]) for m in errors}
    assert len(errors) == len(bad)
    for _, value, key, _ in bad:
        assert got[key][0] == value and got[key][1]
    assert "missing key field /id" in got[b"b"][1] and "unknown sow-command" in got[b"c"][1]
    client.publish(topic, {"id": 1, "v": 5}, delta=True)  # the worker is still alive and applying
    client.flush()
    wait_until(lambda: sow_of(client, topic).get("1", {}).get("v") == 5)


@pytest.mark.parametrize("keep_data", [True, False], ids=["rocksdb-kept", "data-deleted"])
def test_restart_keeps_or_rebuilds_the_sow(setup, kafka_bootstrap, tmp_path, keep_data):
    import shutil

    topic, worker, client = setup
    w = worker()
    expected = {}
    for i in range(50):
        rec = {"id": i, "n": i, "nested": {"a": i}}
        client.publish(topic, rec)
        expected[str(i)] = rec
    client.flush()
    wait_until(lambda: len(sow_of(client, topic)) == 50)
    w.stop()
    if not keep_data:
        shutil.rmtree(tmp_path / "d1")
    w2 = worker("w2", "d1")
    lines = wait_until(lambda: len(r := [l for l in w2.log().splitlines() if "changelog records" in l]) == 4 and r)
    replayed = sum(int(line.split(": ")[1].split()[0]) for line in lines)
    # Kept RocksDB: nothing to replay. Deleted: every partition rebuilt from <topic>.sow.
    assert replayed == 0 if keep_data else replayed >= 50
    # Deltas after the restart must merge into the state from before it.
    for i in range(0, 50, 5):
        client.publish(topic, {"id": i, "nested": {"b": -i}}, delta=True)
        expected[str(i)] = merge(expected[str(i)], {"id": i, "nested": {"b": -i}})
    client.flush()
    wait_until(lambda: sow_of(client, topic) == expected)
    diffs = [m for m in read_all(kafka_bootstrap, f"{topic}.diff") if headers_of(m)["sow-op"] == "update"]
    assert sorted(orjson.loads(m.value())["id"] for m in diffs) == list(range(0, 50, 5))
    assert all(set(orjson.loads(m.value())) == {"id", "nested"} for m in diffs)


def _history(n_keys: int, n: int, seed: int):
    rnd = random.Random(seed)
    ops = []
    for i in range(n):
        k = rnd.randrange(n_keys)
        if rnd.random() < 0.3:
            ops.append(("delta", {"id": k, "v": i, "m": {f"f{i % 3}": i}}))
        elif rnd.random() < 0.05:
            ops.append(("delete", {"id": k}))
        else:
            ops.append(("publish", {"id": k, "v": i, "m": {"f0": i}}))
    return ops


def _fold(ops):
    sow = {}
    for kind, rec in ops:
        k = str(rec["id"])
        if kind == "delete":
            sow.pop(k, None)
        elif kind == "delta":
            sow[k] = merge(sow.get(k), rec)
        else:
            sow[k] = rec
    return sow


def _publish(client, topic, ops):
    for kind, rec in ops:
        if kind == "delete":
            client.delete(topic, data=rec)
        else:
            client.publish(topic, rec, delta=kind == "delta")
    client.flush()


def test_killed_worker_loses_nothing(setup, kafka_bootstrap):
    """kill -9 in the middle of a stream: the restarted worker ends with the exact SOW."""
    topic, worker, client = setup
    w = worker()
    # Deltas go to <topic> with sow-command so one key's order is strict (one partition, one topic).
    ops = _history(300, 6000, seed=1)
    first, second = ops[:3000], ops[3000:]
    _publish_strict(client, topic, first)
    wait_until(lambda: len(read_all(kafka_bootstrap, f"{topic}.diff")) > 500, timeout=60, interval=0.05)
    w.kill()  # mid-stream: part of the first half is applied
    _publish_strict(client, topic, second)
    worker("w2", "d1")
    expected = _fold(ops)
    wait_until(lambda: sow_of(client, topic) == expected, timeout=120, interval=1)


def _publish_strict(client, topic, ops):
    """Everything on <topic>: deltas carry sow-command so per-key order is Kafka's partition order."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": client.bootstrap, "linger.ms": 5, "partitioner": "murmur2_random"})
    spec = client.spec(topic)
    for kind, rec in ops:
        key = spec.key_spec.sow_key(rec).encode()
        command = {"publish": b"publish", "delta": b"delta_publish", "delete": b"sow_delete"}[kind]
        p.produce(topic, orjson.dumps(rec), key, headers=[("sow-command", command)])
    p.flush()


def test_two_workers_split_partitions_and_survive_losing_one(setup, kafka_bootstrap, admin):
    topic, worker, client = setup
    w1 = worker("w1", "d1")
    w2 = worker("w2", "d2")
    group = f"g-{topic}"

    def split():
        desc = admin.describe_consumer_groups([group])[group].result(30)
        owned = [sorted(tp.partition for tp in m.assignment.topic_partitions if tp.topic == topic) for m in desc.members]
        return len(owned) == 2 and all(owned) and sorted(sum(owned, [])) == [0, 1, 2, 3] and owned

    wait_until(split, timeout=90, interval=1)
    ops = _history(200, 3000, seed=2)
    _publish_strict(client, topic, ops[:1500])
    expected_half = _fold(ops[:1500])
    wait_until(lambda: sow_of(client, topic) == expected_half, timeout=90, interval=1)
    before_kill = len(w2.log())
    w1.kill()
    _publish_strict(client, topic, ops[1500:])
    wait_until(lambda: sow_of(client, topic) == _fold(ops), timeout=120, interval=1)
    # w2 took w1's partitions over: it restored partitions after the kill. ("restored" anywhere in
    # its log could not fail: w2 restores its own half when it starts.)
    assert re.findall(rf"restored {re.escape(topic)} partition \d+", w2.log()[before_kill:]), w2.log()[-3000:]


def test_worker_pool_splits_restarts_and_stops(setup, kafka_bootstrap, tmp_path, admin):
    """`ksow up --workers 2`: two members of the group share the partitions; one killed is restarted
    by the pool and the SOW stays exact; SIGTERM stops them all."""
    import os
    import re
    import signal

    topic, _, client = setup
    group = f"g-{topic}"
    pool = Worker(kafka_bootstrap, tmp_path / f"{topic}.yaml", group, tmp_path / "pool", "pool", ["--workers", "2"])
    pool.start(wait=False)
    try:
        pool.wait_for("Worker]: Ready", 90, count=2)

        def members():
            desc = admin.describe_consumer_groups([group])[group].result(30)
            owned = [sorted(tp.partition for tp in m.assignment.topic_partitions if tp.topic == topic) for m in desc.members]
            return len(owned) == 2 and all(owned) and sorted(sum(owned, [])) == [0, 1, 2, 3] and owned

        wait_until(members, timeout=90, interval=1)
        assert sorted(p.name for p in (tmp_path / "pool").glob("worker-*")) == ["worker-0", "worker-1"]
        # One tree of stores for the pool (README): the workers' own folders hold none. A worker opens
        # a store when its loop takes the assignment, which the group shows a moment before.
        stores = tmp_path / "pool" / "sow" / topic
        wait_until(lambda: stores.is_dir() and sorted(p.name for p in stores.iterdir()) == ["p0", "p1", "p2", "p3"], timeout=30, interval=0.2)
        assert not list((tmp_path / "pool").glob("worker-*/sow"))
        ops = _history(200, 3000, seed=3)
        _publish_strict(client, topic, ops[:1500])
        wait_until(lambda: sow_of(client, topic) == _fold(ops[:1500]), timeout=90, interval=1)

        pids = [int(p) for p in re.findall(r"worker \d started \(pid (\d+)\)", pool.log())]
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
        _publish_strict(client, topic, ops[1500:])
        pool.wait_for("worker 0 exited with status -9: restarting it", 30)
        pool.wait_for("worker 0 started", 60, count=2)
        wait_until(lambda: sow_of(client, topic) == _fold(ops), timeout=120, interval=1)
        wait_until(members, timeout=90, interval=1)

        pool.signal(signal.SIGTERM)
        assert pool.proc.wait(90) == 0
        for pid in re.findall(r"worker \d started \(pid (\d+)\)", pool.log()):
            with pytest.raises(ProcessLookupError):
                os.kill(int(pid), 0)
    finally:
        pool.kill()


def test_an_open_transaction_commits_after_the_interval_or_at_a_stop(setup, kafka_bootstrap, tmp_path):
    """A transaction stays open across cycles for the commit interval (read_committed readers see
    nothing of it meanwhile); it commits when the interval has passed, and a stop commits it at
    once; the worker started again repeats none of its outputs."""
    import signal
    import time

    topic, _, client = setup
    topo, group = tmp_path / f"{topic}.yaml", f"g-{topic}"
    env = {"KSOW_COMMIT_INTERVAL_MS": "4000"}
    w = Worker(kafka_bootstrap, topo, group, tmp_path / "d1", "w", env=env).start()
    try:
        for i in range(5):
            client.publish(topic, {"id": i, "qty": i})
        client.flush()
        began = time.monotonic()
        wait_until(lambda: len(read_all(kafka_bootstrap, f"{topic}.diff")) == 5, timeout=30, interval=0.1)
        assert time.monotonic() - began > 2  # applied at once, visible only once the interval passed

        for i in range(5, 10):
            client.publish(topic, {"id": i, "qty": i})
        client.flush()
        time.sleep(1.5)  # applied, not committed yet
        assert len(read_all(kafka_bootstrap, f"{topic}.diff")) == 5
        w.signal(signal.SIGTERM)
        assert w.proc.wait(60) == 0
        assert len(read_all(kafka_bootstrap, f"{topic}.diff")) == 10  # the stop committed them

        again = Worker(kafka_bootstrap, topo, group, tmp_path / "d1", "w2", env=env).start()
        try:
            client.publish(topic, {"id": 10, "qty": 10})
            client.flush()
            wait_until(lambda: len(read_all(kafka_bootstrap, f"{topic}.diff")) >= 11, timeout=30, interval=0.2)
            time.sleep(5)  # a repeat would have committed by now
            diffs = read_all(kafka_bootstrap, f"{topic}.diff")
            assert sorted(orjson.loads(m.value())["id"] for m in diffs) == list(range(11))
        finally:
            again.kill()
    finally:
        w.kill()


def _replayed(log: str, topic: str) -> list[int]:
    """Changelog records each restore of the topic's partitions in the log read."""
    return [int(n) for n in re.findall(rf"restored {re.escape(topic)} partition \d+: (\d+) changelog records", log)]


def test_one_worker_then_a_pool_then_one_again_keep_their_stores(setup, kafka_bootstrap, tmp_path, admin):
    """`ksow up`, then `ksow up --workers 2`, then `ksow up` again on one data folder: every
    partition finds its store whichever worker takes it, and replays nothing (workers of an earlier
    release kept one tree of stores each: a pool rebuilt every partition from its changelog)."""
    import signal

    topic, worker, client = setup
    group = f"g-{topic}"
    ops = _history(100, 1200, seed=4)
    w = worker("w", "shared")
    _publish_strict(client, topic, ops[:600])
    wait_until(lambda: sow_of(client, topic) == _fold(ops[:600]), timeout=90, interval=1)
    w.stop()

    pool = Worker(kafka_bootstrap, tmp_path / f"{topic}.yaml", group, tmp_path / "shared", "pool", ["--workers", "2"])
    pool.start(wait=False)
    try:
        def split():
            desc = admin.describe_consumer_groups([group])[group].result(30)
            owned = [sorted(tp.partition for tp in m.assignment.topic_partitions if tp.topic == topic) for m in desc.members]
            return len(owned) == 2 and all(owned) and sorted(sum(owned, [])) == [0, 1, 2, 3]

        wait_until(split, timeout=90, interval=1)
        # Each worker restored what it took: the first all four partitions, the second its half.
        replayed = wait_until(lambda: len(r := _replayed(pool.log(), topic)) >= 6 and r, timeout=60)
        assert set(replayed) == {0}, pool.log()[-3000:]
        _publish_strict(client, topic, ops[600:])
        wait_until(lambda: sow_of(client, topic) == _fold(ops), timeout=90, interval=1)
        pool.signal(signal.SIGTERM)
        assert pool.proc.wait(90) == 0
    finally:
        pool.kill()

    again = worker("again", "shared")
    replayed = wait_until(lambda: len(r := _replayed(again.log(), topic)) == 4 and r, timeout=60)
    assert replayed == [0, 0, 0, 0], again.log()[-3000:]
    assert sow_of(client, topic) == _fold(ops)
