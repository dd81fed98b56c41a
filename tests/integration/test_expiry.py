"""Expiration on a real broker: lifetimes, postponement, 0 = never, downtime, rebalance."""

from __future__ import annotations

import time
import urllib.request
from collections import Counter

import orjson
import pytest
import yaml

from processor.client.sow_client import Client
from processor.contract.errors import ConfigError
from processor.core.keys import owner_partition
from processor.kafka.clients import ensure_topics, make_admin
from processor.kafka.registry import live_workers
from processor.topology import load_topology

from .workers import Worker, headers_of, read_all, read_topic, wait_until, write_topology

pytestmark = pytest.mark.integration


@pytest.fixture
def env(kafka_bootstrap, unique_name, tmp_path):
    path = write_topology(tmp_path, unique_name, expiration="2s")
    client = Client(kafka_bootstrap, load_topology(path))
    workers: list[Worker] = []

    def worker(name="w", data="d1", start=True):
        w = Worker(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / data, name)
        workers.append(w)
        return w.start() if start else w

    yield unique_name, client, worker
    for w in workers:
        w.kill()


def expired(bootstrap, topic):
    return {m.key().decode(): m for m in read_all(bootstrap, f"EXP.{topic}")}


def ids(client, topic):
    return sorted(e.record["id"] for e in client.query(topic))


def test_lifetimes_expire_with_all_outputs(env, kafka_bootstrap):
    topic, client, worker = env
    worker()
    k_default = client.publish(topic, {"id": 1, "v": "topic default"})
    client.publish(topic, {"id": 2, "v": "never"}, expiration="0")
    k_short = client.publish(topic, {"id": 3, "v": "short"}, expiration="1s")
    client.flush()
    # Applied: the three inserts are on `.sow`. (A query here raced the lifetimes: under load two
    # queries took longer than the second in which [1, 2, 3] or [1, 2] is the SOW.)
    wait_until(lambda: len(read_all(kafka_bootstrap, f"{topic}.sow")) >= 3)
    exp = wait_until(lambda: len(e := expired(kafka_bootstrap, topic)) == 2 and e, timeout=30, interval=0.2)
    assert set(exp) == {k_default, k_short}
    for key, record in ((k_default, {"id": 1, "v": "topic default"}), (k_short, {"id": 3, "v": "short"})):
        h = headers_of(exp[key])
        assert orjson.loads(exp[key].value()) == record and h["sow-op"] == "expire"
        lateness = int(h["sow-actual-expiry"]) - int(h["sow-expires-at"])
        assert 0 <= lateness < 1500, lateness
    sow = {}
    for m in read_all(kafka_bootstrap, f"{topic}.sow"):
        sow[m.key().decode()] = m
    assert sow[k_default].value() is None and headers_of(sow[k_default])["sow-op"] == "expire"
    diffs = [(headers_of(m)["sow-op"], orjson.loads(m.value())) for m in read_all(kafka_bootstrap, f"{topic}.diff") if m.key().decode() == k_short]
    assert diffs == [("insert", {"id": 3, "v": "short"}), ("expire", {"id": 3, "v": "short"})]
    time.sleep(1)
    assert ids(client, topic) == [2]  # 0 = never expires
    # The sweeps told the worker's metrics how late they came: one observation for each sweep
    # that expired records (the two instants are a second apart), each within the bound above.
    (w,) = wait_until(lambda: live_workers(kafka_bootstrap, f"g-{topic}"))
    text = urllib.request.urlopen(f"{w['url']}/metrics", timeout=10).read().decode()
    late = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("ksow_expiry_lateness_seconds_") and f'topic="{topic}"' in line}
    assert late["ksow_expiry_lateness_seconds_count"] in (1, 2), late  # one, were both in one sweep of one partition
    assert 0 <= late["ksow_expiry_lateness_seconds_sum"] < 3.0, late


def test_update_postpones_expiry(env, kafka_bootstrap):
    topic, client, worker = env
    worker()
    key = client.publish(topic, {"id": 1, "n": 0}, expiration="3s")
    client.flush()  # it reached Kafka (its lifetime started) before this returned
    # The delta goes a second later, with no query between: the worker applies the two in the order
    # sent whenever it gets to them. (A query that had to see [1] first, then a second's sleep, raced
    # the 3 s lifetime under load: the delta then came after the instant, as a new record.)
    time.sleep(1)
    client.publish(topic, {"id": 1, "n": 1}, delta=True, expiration="3s")
    client.flush()
    exp = wait_until(lambda: expired(kafka_bootstrap, topic).get(key), timeout=15, interval=0.2)
    instants = [int(headers_of(m)["sow-expires-at"]) for m in read_all(kafka_bootstrap, f"{topic}.sow") if m.value() is not None]
    assert len(instants) == 2 and instants[1] >= instants[0] + 900  # the update started a new lifetime
    assert int(headers_of(exp)["sow-actual-expiry"]) >= instants[1]
    assert orjson.loads(exp.value()) == {"id": 1, "n": 1}
    assert len(read_all(kafka_bootstrap, f"EXP.{topic}")) == 1


def test_worker_down_past_the_instant_expires_on_start(env, kafka_bootstrap):
    topic, client, worker = env
    w = worker()
    # A lifetime of its own, long enough for the worker to apply the record and stop before its
    # instant (with the topic's 2 s, a query and the stop of a loaded worker took longer), then the
    # wait is for that instant, read from `.sow`.
    key = client.publish(topic, {"id": 7}, expiration="8s")
    client.flush()
    (inserted,) = wait_until(lambda: read_all(kafka_bootstrap, f"{topic}.sow"))
    due = int(headers_of(inserted)["sow-expires-at"])
    w.stop()
    assert not expired(kafka_bootstrap, topic)  # down before the instant
    time.sleep(max(0.0, (due + 1_000) / 1000 - time.time()))
    restarted = int(time.time() * 1000)
    worker("w2", "d1")
    exp = wait_until(lambda: expired(kafka_bootstrap, topic).get(key), timeout=30, interval=0.2)
    h = headers_of(exp)
    assert int(h["sow-actual-expiry"]) >= restarted > int(h["sow-expires-at"])
    assert ids(client, topic) == []


def test_records_moved_by_rebalance_expire_exactly_once(env, kafka_bootstrap):
    topic, client, worker = env
    worker("w1", "d1")
    keys = {client.publish(topic, {"id": i}, expiration="4s") for i in range(40)}
    client.flush()
    # Applied: the 40 inserts are on `.sow`. (A query that had to see all 40 alive raced their 4 s.)
    wait_until(lambda: len({m.key() for m in read_all(kafka_bootstrap, f"{topic}.sow") if m.value() is not None}) == 40)
    worker("w2", "d2")  # takes over half of the partitions while the records are alive
    wait_until(lambda: len(expired(kafka_bootstrap, topic)) == 40, timeout=60, interval=0.5)
    time.sleep(2)
    counts = Counter(m.key().decode() for m in read_all(kafka_bootstrap, f"EXP.{topic}"))
    assert set(counts) == keys and set(counts.values()) == {1}
    assert ids(client, topic) == []


def _worker_for(kafka_bootstrap, tmp_path, topic, **options):
    path = write_topology(tmp_path, topic, **options)
    return Worker(kafka_bootstrap, path, f"g-{topic}", tmp_path / "d1"), Client(kafka_bootstrap, load_topology(path))


def _sow_versions(bootstrap, topic):
    """(record, sow-expires-at or None, the input's timestamp) of each version on `<topic>.sow`."""
    published = {m.key().decode(): m.timestamp()[1] for m in read_all(bootstrap, topic)}
    return {
        orjson.loads(m.value())["id"]: (headers_of(m).get("sow-expires-at"), published[m.key().decode()])
        for m in read_all(bootstrap, f"{topic}.sow")
        if m.value() is not None
    }


def test_expiration_zero_is_no_default_lifetime(kafka_bootstrap, unique_name, tmp_path):
    """`expiration: 0` keeps records indefinitely (a UM TTL of 0); per-message lifetimes still expire."""
    topic = unique_name
    w, client = _worker_for(kafka_bootstrap, tmp_path, topic, expiration=0)
    w.start()
    try:
        client.publish(topic, {"id": 1})
        short = client.publish(topic, {"id": 2}, expiration="1s")
        client.flush()
        wait_until(lambda: short in expired(kafka_bootstrap, topic), timeout=30)
        assert ids(client, topic) == [1]
        assert _sow_versions(kafka_bootstrap, topic)[1][0] is None  # no instant at all
    finally:
        w.kill()


def test_topic_default_lifetime_overrides_the_clamps(kafka_bootstrap, unique_name, tmp_path):
    """Artemis: expiry-delay overrides min/max-expiry-delay, and leaves a message's own expiration
    as it is; ksow's topic default lifetime is that expiry-delay. The worker warns at start."""
    topic = unique_name
    w, client = _worker_for(kafka_bootstrap, tmp_path, topic, expiration="1s", min_expiration="3s", max_expiration="4s")
    w.start()
    try:
        default = client.publish(topic, {"id": 1})
        client.publish(topic, {"id": 2}, expiration="20s")
        client.flush()
        wait_until(lambda: default in expired(kafka_bootstrap, topic), timeout=30)
        versions = _sow_versions(kafka_bootstrap, topic)
        lifetimes = {i: int(at) - published for i, (at, published) in versions.items()}
        assert 1_000 <= lifetimes[1] < 2_500, lifetimes  # not raised to min_expiration (3s)
        assert 19_000 <= lifetimes[2] <= 20_000, lifetimes  # not cut to max_expiration (4s)
        assert ids(client, topic) == [2]
        assert "overrides min_expiration, max_expiration" in w.log()
    finally:
        w.kill()


def test_records_past_their_instant_are_never_delivered(kafka_bootstrap, unique_name, tmp_path):
    """No worker has swept them (it is down): the client's own read of `<topic>.sow`, the
    subscription snapshot and its live stream still never show a record past its instant."""
    topic = unique_name
    w, client = _worker_for(kafka_bootstrap, tmp_path, topic, expiration="enabled")
    w.start()
    # The lifetimes leave the worker 10 s to apply the three records before it is killed (with 6 s
    # and queries between, a loaded machine could reach the instant first); the wait after the kill
    # is for the instants themselves, read from `.sow`.
    client.publish(topic, {"id": 1})
    client.publish(topic, {"id": 2}, expiration="10s")
    client.flush()
    wait_until(lambda: len(read_all(kafka_bootstrap, f"{topic}.sow")) == 2)
    live = client.subscribe(topic, sow=False, timeout=3)  # the stream starts here, read later
    client.publish(topic, {"id": 3}, expiration="10s")
    client.flush()
    sow = wait_until(lambda: len(s := read_all(kafka_bootstrap, f"{topic}.sow")) == 3 and s)
    w.kill()  # before the instants: nobody sweeps them
    due = max(int(headers_of(m)["sow-expires-at"]) for m in sow if "sow-expires-at" in headers_of(m))
    time.sleep(max(0.0, (due + 500) / 1000 - time.time()))
    assert not expired(kafka_bootstrap, topic)
    assert ids(client, topic) == [1] and client.last_query_source == "changelog"
    assert [e["record"]["id"] for e in client.subscribe(topic, sow=True, timeout=1)] == [1]
    assert [e["record"]["id"] for e in live] == []


def test_a_lifetime_counts_from_arrival_not_from_a_skewed_publisher_clock(env, kafka_bootstrap):
    """A publisher whose clock is an hour behind: its record still lives its whole lifetime, counted
    from when it reached Kafka (input topics the worker creates stamp arrival: LogAppendTime)."""
    from confluent_kafka import Producer

    topic, client, worker = env
    worker()
    skewed = Producer({"bootstrap.servers": kafka_bootstrap})
    an_hour_ago = int(time.time() * 1000) - 3_600_000
    key = client.spec(topic).key_spec.sow_key({"id": 1})
    sent = int(time.time() * 1000)
    skewed.produce(topic, orjson.dumps({"id": 1, "v": "late clock"}), key.encode(), timestamp=an_hour_ago,
                   headers=[("sow-expiration", b"30s")])
    assert skewed.flush(30) == 0
    entry = wait_until(lambda: (q := client.query(topic)) and q[0])
    assert entry.record == {"id": 1, "v": "late clock"}
    # It expires 30 s after it arrived, not 30 s after the publisher's clock said (an hour ago).
    assert sent + 30_000 - 2_000 <= entry.expires_at <= int(time.time() * 1000) + 30_000
    sow = read_all(kafka_bootstrap, f"{topic}.sow")
    assert [headers_of(m)["sow-op"] for m in sow] == ["insert"]


def test_sow_topics_share_an_expiry_topic(kafka_bootstrap, unique_name, tmp_path):
    """Seed 004: many queues may share one expiry address. Two SOW topics of 2 and 6 partitions send
    their expired records to one topic, created with 6 partitions; each record there says which SOW
    topic it left (`sow-topic`), in the partition of its SOW partition."""
    shared, a, b = f"{unique_name}_expired", f"{unique_name}_a", f"{unique_name}_b"
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"sow": [
        {"topic": a, "key": ["/id"], "partitions": 2, "expiration": "1s", "expiry_topic": shared},
        {"topic": b, "key": ["/id"], "partitions": 6, "expiration": "1s", "expiry_topic": shared},
    ]}))
    topology = load_topology(path)
    client = Client(kafka_bootstrap, topology)
    w = Worker(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "w").start()
    try:
        keys = {t: {client.publish(t, {"id": i, "from": t}): i for i in range(8)} for t in (a, b)}
        client.flush()
        found = wait_until(lambda: len(m := read_topic(kafka_bootstrap, shared)) >= 16 and m, timeout=60, interval=0.3)
    finally:
        w.kill()
    admin = make_admin(kafka_bootstrap)
    assert len(admin.list_topics(shared, timeout=10).topics[shared].partitions) == 6
    seen: dict[str, set] = {a: set(), b: set()}
    for m in found:
        h = headers_of(m)
        topic = h["sow-topic"]
        spec = topology.topic(topic)
        assert h["sow-op"] == "expire" and orjson.loads(m.value())["from"] == topic
        assert m.partition() == owner_partition(h["sow-key"], spec.partitions) and m.key().decode() == h["sow-key"]
        seen[topic].add(h["sow-key"])
    assert len(found) == 16 and seen == {t: set(keys[t]) for t in (a, b)}
    # `.sow` and `.diff` are each SOW topic's own: no sow-topic header there.
    assert not any("sow-topic" in headers_of(m) for t in (a, b) for m in read_topic(kafka_bootstrap, f"{t}.diff"))


def test_a_topic_with_fewer_partitions_than_its_writers_need_is_refused(kafka_bootstrap, unique_name, admin):
    """A shared expiry topic made for a 2-partition SOW topic cannot take partition 3 of another:
    the worker says so at start instead of waiting and failing on a timeout."""
    name = f"{unique_name}_short"
    ensure_topics(admin, {name: (2, {})})
    with pytest.raises(ConfigError, match=f"{name} has 2 partitions, 4 are needed: add partitions"):
        ensure_topics(admin, {name: (4, {})})
    ensure_topics(admin, {name: (1, {})})  # more than needed is fine
