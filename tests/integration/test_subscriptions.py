"""Subscriptions and views on a real broker: seed 001's examples, OOF, conflation, no gap/no dup."""

from __future__ import annotations

import threading
import time

import orjson
import pytest
import yaml

from processor.client.sow_client import Client
from processor.core.bookmarks import split_topics
from processor.topology import load_topology

from .workers import Worker, headers_of, read_all, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def env(kafka_bootstrap, unique_name, tmp_path):
    topo = {
        "sow": [{"topic": unique_name, "key": ["/id"], "partitions": 2, "expiration": "enabled"}],
        "views": [
            {"name": f"{unique_name}_open", "topic": unique_name, "filter": "/status = 'open'", "options": ["oof"]},
            {"name": f"{unique_name}_qty", "topic": unique_name, "filter": "1=1", "select": ["/qty"], "options": ["no_empties"]},
            {"name": f"{unique_name}_conf", "topic": unique_name, "conflation": "1500ms"},
        ],
    }
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topo))
    w = Worker(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d1").start()
    yield unique_name, Client(kafka_bootstrap, load_topology(path))
    w.kill()


def collect(events, until, timeout=30):
    """Pull events from a subscription in a thread until `until(list)` holds."""
    got: list = []
    done = threading.Event()

    def run():
        for e in events:
            got.append(e)
            if until(got):
                break
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(timeout), f"subscription got only {got}"
    return got


def diff_events(bootstrap, topic, partitions=2):
    return [(headers_of(m)["sow-op"], headers_of(m).get("sow-oof-reason"), orjson.loads(m.value())) for m in read_all(bootstrap, topic, partitions)]


def test_order_status_update_as_delta(env):
    topic, client = env
    client.publish(topic, {"id": 3, "customer": "Patrick", "status": "open", "qty": 1000, "ticker": "MSFT"})
    client.flush()
    wait_until(lambda: client.query(topic))
    sub = client.subscribe(topic, delta=True, sow=True)
    first = next(sub)
    assert first["op"] == "sow" and first["record"]["customer"] == "Patrick"
    client.publish(topic, {"id": 3, "customer": "Patrick", "status": "pending", "qty": 1000, "ticker": "MSFT"})
    client.flush()
    event = next(sub)
    assert event["op"] == "update" and event["record"] == {"id": 3, "status": "pending"}
    sub.close()


def test_conflated_sequence_for_id_99(env, kafka_bootstrap):
    topic, client = env
    client.publish(topic, {"id": 99, "status": "open", "notes": "none", "xref": 82})
    client.flush()
    wait_until(lambda: client.query(topic))
    sub = client.subscribe(topic, delta=True, sow=False, conflation="1500ms")
    # The view holds the insert for its interval: the updates go once it has told it, so they fall in
    # an interval of their own. (A second's sleep after the query raced that interval, which counts
    # from the insert's arrival: updates that came within it merged into the held insert.)
    wait_until(lambda: diff_events(kafka_bootstrap, f"{topic}_conf.diff"), timeout=20)
    for status, notes in (("questioned", "none"), ("questioned", "jcarlo hold"), ("cleared", "none"), ("open", "none")):
        client.publish(topic, {"id": 99, "status": status, "notes": notes, "xref": 82})
    client.flush()
    event = next(sub)
    assert event["record"] == {"id": 99, "status": "open", "notes": "none"}
    sub.close()
    # The server-side conflated view says the same on <view>.diff.
    conf = wait_until(lambda: (e := diff_events(kafka_bootstrap, f"{topic}_conf.diff")) and len(e) >= 2 and e, timeout=20)
    assert conf[0] == ("insert", None, {"id": 99, "status": "open", "notes": "none", "xref": 82})
    assert conf[1:] == [("update", None, {"id": 99, "status": "open", "notes": "none"})]


def test_select_list_and_no_empties_view(env, kafka_bootstrap):
    topic, client = env
    client.publish(topic, {"id": 1, "qty": 5, "note": "a"})
    client.publish(topic, {"id": 1, "qty": 5, "note": "b"})  # changes nothing selected: no event
    client.publish(topic, {"id": 1, "qty": 6, "note": "b"})
    client.flush()
    wait_until(lambda: (e := diff_events(kafka_bootstrap, f"{topic}_qty.diff")) and len(e) >= 2 and e)
    time.sleep(1)
    assert diff_events(kafka_bootstrap, f"{topic}_qty.diff") == [("insert", None, {"id": 1, "qty": 5}), ("update", None, {"id": 1, "qty": 6})]
    sub = client.subscribe(topic, delta=True, sow=True, select=["/qty"], no_empties=True)
    assert next(sub)["record"] == {"id": 1, "qty": 6}
    client.publish(topic, {"id": 1, "qty": 6, "note": "c"})
    client.publish(topic, {"id": 1, "qty": 7, "note": "c"})
    client.flush()
    assert next(sub)["record"] == {"id": 1, "qty": 7}
    sub.close()


def test_out_of_focus_for_each_reason(env, kafka_bootstrap):
    topic, client = env
    sub = client.subscribe(topic, filter="/status = 'open'", oof=True, delta=True, sow=True)
    for i in (1, 2, 3):
        client.publish(topic, {"id": i, "status": "open"})
    client.flush()
    # The subscriber holds the three before 3 gets its lifetime. (Published with it, 3 had to be read
    # within its 2 s: one read later comes as expired to a subscriber that never had it, so no oof.)
    got = collect(sub, lambda g: {e["record"]["id"] for e in g if e["op"] == "insert"} == {1, 2, 3})
    client.publish(topic, {"id": 3, "status": "open", "v": 1}, expiration="2s")  # in focus still, for 2 s
    client.publish(topic, {"id": 1, "status": "closed"})  # updated out of focus
    client.delete(topic, data={"id": 2})  # deleted
    client.flush()
    got += collect(sub, lambda g: sum(e["op"] == "oof" for e in g) >= 3)
    sub.close()
    reasons = {e["record"]["id"]: e["reason"] for e in got if e["op"] == "oof"}
    assert reasons == {1: "no_match", 2: "delete", 3: "expire"}
    # The subscriber may tell 3 expired on reading it past its instant, before the worker's sweep
    # commits: the view's topics are waited for.
    view = wait_until(lambda: (v := diff_events(kafka_bootstrap, f"{topic}_open.diff")) and sum(op == "oof" for op, _, _ in v) >= 3 and v)
    assert sorted((r, rec["id"]) for op, r, rec in view if op == "oof") == [("delete", 2), ("expire", 3), ("no_match", 1)]
    view_sow = {m.key(): m.value() for m in read_all(kafka_bootstrap, f"{topic}_open.sow", 2)}
    assert len(view_sow) == 3 and all(v is None for v in view_sow.values()), view_sow  # each left the view
    assert client.query(topic, filter="/status = 'open'") == []


def test_no_gap_no_duplicate_while_publishing(env):
    topic, client = env
    keys, rounds = 10, 60
    stop = threading.Event()
    publisher_client = Client(client.bootstrap, client.topology)

    def publish():
        for v in range(rounds):
            for k in range(keys):
                publisher_client.publish(topic, {"id": k, "v": v})
            publisher_client.flush()
            time.sleep(0.05)
        stop.set()

    thread = threading.Thread(target=publish)
    thread.start()
    time.sleep(1.0)  # join while the stream is running
    seen: dict[int, list[int]] = {}
    sub = client.subscribe(topic, sow=True, timeout=5)
    for event in sub:
        rec = event["record"]
        seen.setdefault(rec["id"], []).append(rec["v"])
        if stop.is_set() and all(vs and vs[-1] == rounds - 1 for vs in seen.values()) and len(seen) == keys:
            break
    sub.close()
    thread.join()
    assert len(seen) == keys
    for k, values in seen.items():
        assert values == list(range(values[0], rounds)), (k, values)


def test_a_view_is_queried_and_subscribed_to_by_its_name(env):
    """A view's name reads its SOW topic through the view's filter and select list, by the
    workers, by the client's own read of `.sow`, and in a subscription."""
    topic, client = env
    client = Client(client.bootstrap, client.topology, f"g-{topic}")  # the workers' group: they answer
    for i, status in enumerate(["open", "done", "open"]):
        client.publish(topic, {"id": i, "status": status, "qty": i * 10, "note": "n"})
    client.flush()
    wait_until(lambda: len(client.query(topic)) == 3 and client.last_query_source == "workers")
    assert sorted(r.record["id"] for r in client.query(f"{topic}_open")) == [0, 2]
    assert client.last_query_source == "workers"
    assert [r.record for r in client.query(f"{topic}_open", filter="/qty > 5")] == [{"id": 2, "status": "open", "qty": 20, "note": "n"}]
    assert sorted((r.record["id"], r.record.get("qty"), "note" in r.record) for r in client.query(f"{topic}_qty")) == [(0, 0, False), (1, 10, False), (2, 20, False)]
    assert client.query(f"{topic}_qty", filter="/note = 'n'") == []  # the view hides /note: NULL to the caller's filter
    assert sorted(r.record["id"] for r in client.query(f"{topic}_qty", filter="/qty >= 10 AND /note IS NULL")) == [1, 2]
    changelog = Client(client.bootstrap, client.topology, "nobody")  # no workers: reads `.sow` itself
    assert sorted(r.record["id"] for r in changelog.query(f"{topic}_open")) == [0, 2]
    assert changelog.last_query_source == "changelog"
    sub = client.subscribe(f"{topic}_open", sow=True)
    assert sorted(next(sub)["record"]["id"] for _ in range(2)) == [0, 2]
    client.publish(topic, {"id": 1, "status": "open", "qty": 11})
    client.publish(topic, {"id": 5, "status": "done", "qty": 50})
    client.publish(topic, {"id": 6, "status": "open", "qty": 60})
    client.flush()
    assert sorted(next(sub)["record"]["id"] for _ in range(2)) == [1, 6]  # two partitions: no order between them
    sub.close()


def test_a_subscription_limited_to_sowkeys_gets_only_their_snapshot_and_changes(env):
    """sow_and_subscribe with a set of SowKeys (seed 003): the snapshot and the live changes of
    the other records never reach the subscriber."""
    topic, client = env
    for i in range(4):
        client.publish(topic, {"id": i, "status": "open"})
    client.flush()
    wait_until(lambda: len(client.query(topic)) == 4)
    keys = {entry.sow_key for entry in client.query(topic) if entry.record["id"] in (1, 3)}
    sub = client.subscribe(topic, sow=True, keys=sorted(keys))
    snapshot = [next(sub), next(sub)]
    assert {e["op"] for e in snapshot} == {"sow"} and {e["record"]["id"] for e in snapshot} == {1, 3}
    for i in range(4):
        client.publish(topic, {"id": i, "status": "filled"})
    client.flush()
    changed = [next(sub), next(sub)]
    assert {(e["op"], e["record"]["id"]) for e in changed} == {("update", 1), ("update", 3)}
    client.publish(topic, {"id": 1, "status": "last"})
    client.flush()
    event = next(sub)  # after the updates of 0 and 2, which it was not told
    assert (event["op"], event["record"]) == ("update", {"id": 1, "status": "last"}), event
    sub.close()


def test_a_topic_pattern_subscribes_to_every_sow_topic_it_matches(kafka_bootstrap, unique_name, tmp_path):
    """One pattern, two SOW topics it matches and one it does not: the snapshots of both, then the
    live events of both, each naming its topic, none of the third; its bookmark resumes both."""
    a, b, other = f"{unique_name}_a", f"{unique_name}_b", f"{unique_name}_c"
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump({"sow": [{"topic": t, "key": ["/id"], "partitions": 2} for t in (a, b, other)]}))
    worker = Worker(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d1").start()
    try:
        client = Client(kafka_bootstrap, load_topology(path))
        for topic, ids in ((a, (1, 2)), (b, (3,)), (other, (4,))):
            for i in ids:
                client.publish(topic, {"id": i, "v": 0})
        client.flush()
        wait_until(lambda: len(client.query(f"{unique_name}_.")) == 4)
        sub = client.subscribe(f"{unique_name}_[ab]", sow=True, filter="/v >= 0")
        snapshot = [next(sub) for _ in range(3)]
        assert sorted((e["topic"], e["op"], e["record"]["id"]) for e in snapshot) == [(a, "sow", 1), (a, "sow", 2), (b, "sow", 3)]
        assert [e["topic"] for e in snapshot] == [a, a, b]  # one topic's snapshot, then the next's
        client.publish(other, {"id": 4, "v": 1})  # the pattern does not match it: never told
        client.publish(b, {"id": 3, "v": 1})
        client.publish(a, {"id": 5, "v": 1})
        client.publish(a, {"id": 2, "v": -1})  # out of the filter: no event (no oof asked for)
        client.flush()
        live = [next(sub) for _ in range(2)]
        assert sorted((e["topic"], e["op"], e["record"]["id"]) for e in live) == [(a, "insert", 5), (b, "update", 3)]
        bookmark = live[-1]["bookmark"]
        assert set(split_topics(bookmark)) == {a, b}
        sub.close()
        client.publish(a, {"id": 1, "v": 2})
        client.publish(b, {"id": 6, "v": 2})
        client.publish(other, {"id": 7, "v": 2})
        client.flush()
        wait_until(lambda: sorted(r.record["id"] for r in client.query(f"{unique_name}_.", filter="/v = 2")) == [1, 6, 7])  # on `.sow`: resumed, not live
        resumed = collect(client.subscribe(f"{unique_name}_[ab]", after=bookmark, filter="/v >= 0", timeout=5), lambda got: len(got) >= 2)
        assert sorted((e["topic"], e["op"], e["record"]["id"]) for e in resumed) == [(a, "sow", 1), (b, "sow", 6)]
    finally:
        worker.kill()
