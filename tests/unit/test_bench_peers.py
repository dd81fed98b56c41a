"""The pieces of bench/peers.py that decide its verdicts: the input order every peer must follow,
the SOW check, and the summary line the issue asks for."""

from __future__ import annotations

import random

import pytest
from confluent_kafka import KafkaError, KafkaException
from hypothesis import given
from hypothesis import strategies as st

from bench.common import OrderedInputs
from bench.peers import PeerFailed, check_sow, last_line, summarize

from .fake_clients import Message

TOPICS = ("orders", "orders.delta")


def _messages(timestamps: list[int], topic: str, p: int) -> list[Message]:
    return [Message(topic, p, o, b"v", ts) for o, ts in enumerate(timestamps)]


def _eof(topic: str, p: int, offset: int) -> Message:
    return Message(topic, p, offset, error=KafkaError(KafkaError._PARTITION_EOF))


inputs_of_one_partition = st.tuples(
    *(st.lists(st.integers(0, 20), max_size=30).map(sorted) for _ in TOPICS)  # LogAppendTime never goes back
)


@given(st.lists(inputs_of_one_partition, min_size=1, max_size=3), st.integers(0, 2**32), st.integers(1, 50))
def test_each_partition_comes_out_by_timestamp_then_topic_then_offset(partitions, seed: int, limit: int):
    """However the consumer interleaves the fetched inputs, and however early the peer drains,
    a partition's messages come out in the worker's order: an input not at its end is waited for."""
    rnd = random.Random(seed)  # how the consumer's fetches interleave the inputs
    streams = []  # each input partition's messages as the consumer delivers them: in offset order, then EOF
    for p, per_topic in enumerate(partitions):
        for topic, timestamps in zip(TOPICS, per_topic):
            streams.append(_messages(timestamps, topic, p) + [_eof(topic, p, len(timestamps))])
    inputs = OrderedInputs(TOPICS, range(len(partitions)))
    out: list[Message] = []
    while any(streams):
        chunk = []
        for stream in rnd.sample(streams, len(streams)):
            take = rnd.randint(0, len(stream))
            chunk += stream[:take]
            del stream[:take]
        inputs.add(chunk)
        out += inputs.drain(limit)
    while batch := inputs.drain(limit):
        out += batch

    for p in range(len(partitions)):
        got = [(m.timestamp()[1], TOPICS.index(m.topic()), m.offset()) for m in out if m.partition() == p]
        assert got == sorted(got)
        assert len(got) == sum(len(ts) for ts in partitions[p])


def test_a_delta_waits_for_an_older_full_publish_not_fetched_yet():
    inputs = OrderedInputs(TOPICS, [0])
    inputs.add(_messages([5], "orders.delta", 0) + [_eof("orders.delta", 0, 1)])
    assert inputs.drain(10) == []  # `orders` 0 is not known to be at its end: it may hold an older input
    inputs.add(_messages([3], "orders", 0) + [_eof("orders", 0, 1)])
    assert [m.topic() for m in inputs.drain(10)] == ["orders", "orders.delta"]


def test_an_input_that_was_at_its_end_is_waited_for_again_once_it_has_new_data():
    inputs = OrderedInputs(TOPICS, [0])
    inputs.add([_eof("orders", 0, 0), _eof("orders.delta", 0, 0)])
    inputs.add(_messages([3], "orders", 0))  # more arrived: the end seen before is no longer the end
    assert [m.topic() for m in inputs.drain(10)] == ["orders"]
    inputs.add(_messages([5], "orders.delta", 0))
    assert inputs.drain(10) == []  # `orders` may hold something older than 5 again


def test_equal_timestamps_go_to_the_topic_before_its_delta_topic():
    inputs = OrderedInputs(TOPICS, [0])
    inputs.add(_messages([7], "orders.delta", 0) + _messages([7], "orders", 0))
    inputs.add([_eof("orders", 0, 1), _eof("orders.delta", 0, 1)])
    assert [m.topic() for m in inputs.drain(10)] == ["orders", "orders.delta"]


def test_a_consumer_error_is_raised():
    inputs = OrderedInputs(TOPICS, [0])
    broken = Message(topic="orders", partition=0, error=KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
    with pytest.raises(KafkaException):
        inputs.add([broken])


def test_check_sow_accepts_the_same_records():
    check_sow({b"a": {"id": 1, "n": {"x": 1}}}, {b"a": {"n": {"x": 1}, "id": 1}})


@pytest.mark.parametrize(
    ("got", "reason"),
    [
        ({b"a": {"id": 1}, b"b": {"id": 2, "px": 9}}, "1 keys differ, 0 missing, 0 extra of 2"),
        ({b"a": {"id": 1}}, "0 keys differ, 1 missing, 0 extra of 2"),
        ({b"a": {"id": 1}, b"b": {"id": 2, "px": 1}, b"c": {"id": 3}}, "0 keys differ, 0 missing, 1 extra of 2"),
    ],
)
def test_check_sow_fails_a_different_sow(got, reason):
    with pytest.raises(PeerFailed, match=reason):
        check_sow({b"a": {"id": 1}, b"b": {"id": 2, "px": 1}}, got)


def _run(rate: float) -> dict:
    return {"rate_steady": rate, "rate_total": rate / 2, "startup_s": 1.0, "cpu_us": 20.0, "rss_mb": 100.0}


def test_last_line_has_the_issue_format_with_medians_of_per_run_ratios():
    runs = [
        {"plain": _run(60000), "quix": _run(20000), "bytewax": _run(25000), "ksow": _run(42000)},
        {"plain": _run(50000), "quix": _run(10000), "bytewax": _run(26000), "ksow": _run(40000)},
        {"plain": _run(70000), "quix": _run(20000), "bytewax": _run(24000), "ksow": _run(44000)},
    ]
    summary = summarize(["plain", "quix", "bytewax", "ksow"], runs, {})
    assert last_line(runs, summary) == (
        "peers: ksow 42000 rec/s, quix 20000 rec/s, bytewax 25000 rec/s, limit 60000 rec/s, ksow/quix 2.20, ksow/limit 0.70"
    )


def test_last_line_names_failed_and_missing_peers_without_figures():
    runs = [{"plain": _run(60000), "ksow": {"failed": "wrong SOW: 3 keys differ"}}]
    summary = summarize(["plain", "ksow"], runs, {"quix": "quixstreams is not installed"})
    assert last_line(runs, summary) == (
        "peers: ksow FAILED, quix n/a, bytewax n/a, limit 60000 rec/s, ksow/quix n/a, ksow/limit n/a"
    )
