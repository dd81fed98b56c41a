"""Subscriptions to the topics a regular expression names (as AMPS takes a topic): the client's
snapshot, live stream, topic tags and bookmarks, over an in-memory log standing in for `.sow`
topics (the real broker is in tests/integration/test_subscriptions.py)."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import orjson
import pytest
from click.testing import CliRunner

from processor.client import sow_client
from processor.client.sow_client import Client, ClientError
from processor.core.bookmarks import BookmarkError, join_topics, split_topics
from processor.topology import parse_topology

from .fake_clients import Message, end_of

TOPOLOGY = {
    "sow": [{"topic": t, "key": ["/id"], "partitions": 2} for t in ("eu.orders", "us.orders", "trades")],
    "views": [{"name": "eu.open", "topic": "eu.orders", "filter": "/status = 'open'", "select": ["/status"]}],
}


class Log:
    """`.sow` topics in memory: topic -> partition -> messages; the next event ID per partition."""

    def __init__(self) -> None:
        self.parts: dict[str, dict[int, list[Message]]] = defaultdict(lambda: defaultdict(list))
        self.counters: dict[tuple[str, int], int] = defaultdict(int)

    def write(self, topic: str, id_: int, record: dict | None, op: str = "update", expires_at: int | None = None) -> int:
        p = id_ % 2
        self.counters[(topic, p)] += 1
        seq = self.counters[(topic, p)] << 10 | p
        messages = self.parts[f"{topic}.sow"][p]
        headers = [("sow-op", op.encode()), ("sow-seq", str(seq).encode())]
        if expires_at is not None:
            headers.append(("sow-expires-at", str(expires_at).encode()))
        value = None if record is None else orjson.dumps(record)
        messages.append(Message(f"{topic}.sow", p, len(messages), value, key=f"k{id_}".encode(), headers=headers))
        return seq


class LogConsumer:
    """What the client asks of a confluent-kafka Consumer, reading a Log."""

    opened: list["LogConsumer"] = []

    def __init__(self, log: Log) -> None:
        self.log, self.at, self.told_end, self.closed = log, {}, {}, False
        LogConsumer.opened.append(self)

    def get_watermark_offsets(self, tp, timeout=None, cached=False):
        return 0, len(self.log.parts[tp.topic][tp.partition])

    def assign(self, partitions) -> None:
        self.at = {(tp.topic, tp.partition): tp.offset for tp in partitions}
        self.told_end = {}

    def consume(self, n: int, timeout: float) -> list[Message]:
        out = []
        for (topic, p), offset in self.at.items():
            messages = self.log.parts[topic][p]
            out += messages[offset:]
            self.at[(topic, p)] = len(messages)
            if self.told_end.get((topic, p)) != len(messages):
                self.told_end[(topic, p)] = len(messages)
                out.append(end_of(topic, p, len(messages)))
        if not out:
            time.sleep(0.01)
        return out

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def log(monkeypatch):
    log = Log()
    LogConsumer.opened = []
    monkeypatch.setattr(sow_client, "make_consumer", lambda *args, **kwargs: LogConsumer(log))
    monkeypatch.setattr(Client, "_require", lambda self, handle, name: None)
    return log


@pytest.fixture
def client(monkeypatch):
    client = Client("127.0.0.1:1", parse_topology(TOPOLOGY))
    monkeypatch.setattr(client, "_workers", lambda fresh=False: [])  # a query reads the log
    return client


def until(events, count):
    return [next(events) for _ in range(count)]


def test_a_pattern_subscription_gives_every_matched_snapshot_then_their_live_events_tagged(log, client):
    log.write("eu.orders", 1, {"id": 1, "status": "open", "qty": 1})
    log.write("us.orders", 2, {"id": 2, "status": "open", "qty": 2})
    log.write("trades", 3, {"id": 3, "qty": 3})
    events = client.subscribe("(eu|us)[.]orders", sow=True, timeout=0.5)
    snapshot = until(events, 2)
    assert [(e["topic"], e["op"], e["record"]["id"]) for e in snapshot] == [("eu.orders", "sow", 1), ("us.orders", "sow", 2)]
    assert all(list(e)[0] == "topic" for e in snapshot)  # first, as a pattern query's lines
    log.write("trades", 4, {"id": 4, "qty": 4})  # not matched: never told
    log.write("us.orders", 5, {"id": 5, "status": "open", "qty": 5})
    log.write("eu.orders", 1, {"id": 1, "status": "done", "qty": 1})
    rest = list(events)
    assert sorted((e["topic"], e["op"], e["record"]["id"]) for e in rest) == [("eu.orders", "update", 1), ("us.orders", "insert", 5)]
    assert len(LogConsumer.opened) == 1 and LogConsumer.opened[0].closed  # one consumer for all of them


def test_each_topic_and_view_a_pattern_matches_is_read_as_if_named_alone(log, client):
    """A view reads its SOW topic through its filter and select list; the caller's options apply
    to each (here a filter and oof); the topic and its view share the one read of the topic."""
    log.write("eu.orders", 1, {"id": 1, "status": "open", "qty": 10})
    log.write("eu.orders", 2, {"id": 2, "status": "done", "qty": 20})
    events = client.subscribe("eu[.].*", filter="/status IS NOT NULL", oof=True, sow=True, timeout=0.5)
    snapshot = until(events, 3)
    assert sorted((e["topic"], e["record"]["id"], tuple(e["record"])) for e in snapshot) == [
        ("eu.open", 1, ("id", "status")), ("eu.orders", 1, ("id", "status", "qty")), ("eu.orders", 2, ("id", "status", "qty"))]
    log.write("eu.orders", 1, {"id": 1, "status": "done", "qty": 10})
    rest = list(events)
    assert sorted((e["topic"], e["op"], e.get("reason")) for e in rest) == [("eu.open", "oof", "no_match"), ("eu.orders", "update", None)]


def test_a_pattern_subscription_resumes_after_a_bookmark_naming_each_topic(log, client):
    eu1 = log.write("eu.orders", 1, {"id": 1, "v": 1})
    us2 = log.write("us.orders", 2, {"id": 2, "v": 1})
    events = client.subscribe(".*orders", sow=True, timeout=0.3)
    first = next(events)
    assert first["topic"] == "eu.orders"
    # The first event's bookmark: eu.orders where it got, us.orders at its start (nothing of it given).
    assert split_topics(first["bookmark"]) == {"eu.orders": f"0,{eu1}", "us.orders": "0,1"}
    second = next(events)
    assert split_topics(second["bookmark"]) == {"eu.orders": f"0,{eu1}", "us.orders": f"{us2},1"}
    events.close()
    log.write("eu.orders", 1, {"id": 1, "v": 2})
    log.write("us.orders", 4, {"id": 4, "v": 1})
    resumed = list(client.subscribe(".*orders", after=second["bookmark"], timeout=0.3))
    assert sorted((e["topic"], e["op"], e["record"]) for e in resumed) == [
        ("eu.orders", "sow", {"id": 1, "v": 2}), ("us.orders", "sow", {"id": 4, "v": 1})]
    # From the first event's bookmark, us.orders comes again whole; eu.orders only what changed since.
    again = list(client.subscribe(".*orders", after=first["bookmark"], timeout=0.3))
    assert sorted((e["topic"], e["record"]["id"]) for e in again) == [("eu.orders", 1), ("us.orders", 2), ("us.orders", 4)]
    # A bookmark that leaves a matched topic out: that topic comes again from its start.
    eu_only = join_topics({"eu.orders": split_topics(second["bookmark"])["eu.orders"]})
    assert sorted((e["topic"], e["record"]["id"]) for e in client.subscribe(".*orders", after=eu_only, timeout=0.3)) == [
        ("eu.orders", 1), ("us.orders", 2), ("us.orders", 4)]


def test_a_snapshot_bookmark_takes_in_the_removals_read_before_the_records_still_to_come(log, client):
    """The snapshot read past the tombstones of records removed before it: a subscriber that stops
    after its last event resumes with nothing to redo, and one that stops earlier is given the
    snapshot's later records again, not the removals before them."""
    log.write("trades", 1, {"id": 1})  # partition 1
    log.write("trades", 2, {"id": 2})  # partition 0
    log.write("trades", 2, None, op="delete")
    log.write("trades", 3, {"id": 3})  # partition 1, after the removal on partition 0
    log.write("trades", 4, {"id": 4})
    log.write("trades", 4, None, op="delete")
    first, last = list(client.subscribe("trades", sow=True, timeout=0.3))
    assert (first["record"], last["record"]) == ({"id": 1}, {"id": 3})
    assert list(client.subscribe("trades", after=last["bookmark"], timeout=0.3)) == []
    assert [(e["op"], e["record"]) for e in client.subscribe("trades", after=first["bookmark"], timeout=0.3)] == [("sow", {"id": 3})]


def test_a_resumed_expiry_without_sowkeys_says_which_record_went(log):
    """A record that expired since the bookmark is read back as its version past its instant, then
    the worker's expire tombstone: a subscriber without SowKeys (no_sowkey) is told which record went
    by the key fields of that version, as for a delete (the tombstone carries no record)."""
    client = Client("127.0.0.1:1", parse_topology({"sow": [{"topic": "quotes", "key": ["/id"], "partitions": 2, "expiration": "enabled"}]}))
    log.write("quotes", 1, {"id": 1, "v": 0})
    with contextlib.closing(client.subscribe("quotes", sow=True, timeout=0.3)) as events:
        bookmark = next(events)["bookmark"]
    due = int(time.time() * 1000) - 1000
    for i in (1, 2):
        log.write("quotes", i, {"id": i, "v": 1}, expires_at=due)
        log.write("quotes", i, None, op="expire", expires_at=due)
    log.write("quotes", 3, {"id": 3, "v": 1})
    log.write("quotes", 3, None, op="delete")
    resumed = list(client.subscribe("quotes", after=bookmark, no_sowkey=True, timeout=0.3))
    assert sorted((e["op"], e["record"]["id"]) for e in resumed) == [("delete", 3), ("expire", 1), ("expire", 2)]


def test_a_conflated_pattern_subscription_bookmark_stops_short_of_what_every_topic_holds(log, client):
    """An event released by one topic's conflation interval resumes before the events the other
    topics' intervals still hold: a subscriber that stops there is given those again."""
    events = client.subscribe(".*orders", sow=False, conflation="300ms", timeout=1.0)
    eu = log.write("eu.orders", 1, {"id": 1, "v": 1})
    us = log.write("us.orders", 3, {"id": 3, "v": 1})
    got = list(events)
    assert sorted((e["topic"], e["seq"]) for e in got) == [("eu.orders", eu), ("us.orders", us)]
    first = got[0]
    other = "us.orders" if first["topic"] == "eu.orders" else "eu.orders"
    held = us if other == "us.orders" else eu
    parts = split_topics(first["bookmark"])
    assert str(held) not in parts[other].split(",")  # short of the event still held there when this one went
    assert {e["topic"] for e in client.subscribe(".*orders", after=first["bookmark"], timeout=0.3)} == {other}


@pytest.mark.parametrize("after, says", [
    ("1024,1025", "a pattern subscription resumes after the bookmark of one of its events"),
    (5, "a pattern subscription resumes after the bookmark of one of its events"),
    ("eu.orders=0,1;nope=0,1", "the bookmark names nope, which the pattern does not match"),
    ("eu.orders=5", r"eu.orders: event ID 5 is of partition 5, and the topic has 2 partitions"),
])
def test_a_pattern_subscription_refuses_a_bookmark_that_is_not_one_of_its_own(log, client, after, says):
    with pytest.raises(ClientError, match=says):
        client.subscribe(".*orders", after=after)


@pytest.mark.parametrize("pattern", ["nothing.*", "(", "orders"])
def test_a_pattern_matching_nothing_or_no_regular_expression_is_refused_as_a_query_is(log, client, pattern):
    with pytest.raises(ClientError, match="is not a SOW topic of this topology") as subscribed:
        client.subscribe(pattern)
    with pytest.raises(ClientError) as queried:
        client.query(pattern)
    assert str(subscribed.value) == str(queried.value)
    assert LogConsumer.opened == []


def test_an_option_one_matched_view_cannot_take_refuses_the_whole_subscription_as_a_query(log, client):
    with pytest.raises(ClientError, match="/qty not in the select list of view eu.open") as subscribed:
        client.subscribe("eu[.].*", select=["/qty"])
    assert LogConsumer.opened == []  # refused before anything is read
    with pytest.raises(ClientError) as queried:
        client.query("eu[.].*", select=["/qty"])
    assert str(subscribed.value) == str(queried.value)


def test_one_topic_named_as_before_carries_no_topic_and_a_bookmark_of_event_ids(log, client):
    seq = log.write("trades", 3, {"id": 3})
    event = next(client.subscribe("trades", sow=True, timeout=0.3))
    assert "topic" not in event and event["bookmark"] == f"0,{seq}"


def test_a_topic_pattern_bookmark_reads_back_what_it_wrote():
    text = join_topics({"eu.orders": "0,1025", "us-b_2": "1024,1"})
    assert text == "eu.orders=0,1025;us-b_2=1024,1"
    assert split_topics(text) == {"eu.orders": "0,1025", "us-b_2": "1024,1"}
    for bad, says in (("1,2", "TOPIC=EVENT IDS"), ("a=1;=2", "got '=2'"), ("a=1;b", "got 'b'"), ("a=1;a=2", "names a twice")):
        with pytest.raises(BookmarkError, match=says):
            split_topics(bad)


def test_ksow_subscribe_takes_a_pattern_and_prints_each_event_with_its_topic(log, monkeypatch, tmp_path):
    import yaml

    from processor.cli.commands import main

    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(TOPOLOGY))
    log.write("eu.orders", 1, {"id": 1})
    log.write("trades", 3, {"id": 3})
    result = CliRunner().invoke(main, ["subscribe", "eu.*|tr.*", "--sow", "--timeout", "0.3", "--bootstrap", "127.0.0.1:1", "--topology", str(path)])
    assert result.exit_code == 0, result.output
    lines = [orjson.loads(line) for line in result.output.splitlines()]
    assert [(e["topic"], e["record"]["id"]) for e in lines] == [("eu.orders", 1), ("trades", 3)]
    result = CliRunner().invoke(main, ["subscribe", "eu.*", "--after", "1024", "--bootstrap", "127.0.0.1:1", "--topology", str(path)])
    assert result.exit_code == 1 and "a pattern subscription resumes after the bookmark of one of its events" in result.output
