"""The batch paths' history order is the worker's: a partition whose timestamps go backwards (two
publishers whose clocks differ) keeps its offset order, and a record due by an input's sort time is
gone before that input applies, whichever part of the history is folded."""

from __future__ import annotations

import dataclasses

import orjson

from processor.contract import headers as H
from processor.contract.types import InputMessage
from processor.core.keys import owner_partition
from processor.engine.fold import SowFold, fold_history, history, in_order
from processor.testing import LocalTopic
from processor.topology import parse_topology

SPEC = parse_topology({"sow": [{"topic": "t", "key": ["/id"], "partitions": 2, "expiration": "enabled"}]}).sow[0]


def msg(topic: str, offset: int, ts: int, record: dict, headers=None) -> InputMessage:
    return InputMessage(topic, 0, offset, None, orjson.dumps(record), headers, ts)


# `t`[0]: "a" stamped 1000, then "b" sent after it by a publisher whose clock is behind (900);
# `t.delta`[0]: a delta stamped 950. A worker applies the delta, then "a", then "b".
A = msg("t", 0, 1000, {"id": 1, "v": "a"})
B = msg("t", 1, 900, {"id": 1, "v": "b"})
D = msg("t.delta", 0, 950, {"id": 1, "w": 1})


def test_a_timestamp_that_goes_back_keeps_its_offset_place():
    assert in_order(SPEC, [B, A, D]) == [D, A, B]
    assert [sort for sort, _ in history(SPEC, [B, A, D])] == [950, 1000, 1000]  # "b" sorts at its partition's time
    assert fold_history(SPEC, [B, D, A], 2000)[SPEC.key_spec.sow_key({"id": 1})].data == {"id": 1, "v": "b"}


def test_as_of_takes_the_inputs_up_to_a_place_in_the_workers_order():
    key = SPEC.key_spec.sow_key({"id": 1})
    assert fold_history(SPEC, [A, B, D], 999)[key].data == {"id": 1, "w": 1}  # "b" (stamped 900) sorts at 1000
    assert fold_history(SPEC, [A, B, D], 1000)[key].data == {"id": 1, "v": "b"}


def test_a_record_due_by_an_inputs_sort_time_is_gone_before_it_applies_in_a_part_of_the_history_too():
    """Record 2 lives until 3000; a delta on it stamped 2500 comes after an input stamped 4000 in its
    partition, so it sorts at 4000: the record has expired, and the delta starts a new one. A fold of
    record 2's inputs alone (Spark's per-group fallback) must see that too, given the sort times."""
    two = msg("t", 2, 2000, {"id": 2, "x": 1}, [(H.EXPIRATION, b"1s")])
    three = msg("t", 3, 4000, {"id": 3})
    late_delta = msg("t", 4, 2500, {"id": 2, "y": 1}, [(H.COMMAND, b"delta_publish")])
    key = SPEC.key_spec.sow_key({"id": 2})
    whole = fold_history(SPEC, [two, three, late_delta], 5000)
    assert (whole[key].data, whole[key].expires_at) == ({"id": 2, "y": 1}, None)
    sorts = dict((m.offset, sort) for sort, m in history(SPEC, [two, three, late_delta]))
    part = SowFold(SPEC)
    for m in (two, late_delta):  # record 2's inputs only, each with its sort time
        part.apply(m, sorts[m.offset])
    assert (part.records[key].data, part.records[key].expires_at) == ({"id": 2, "y": 1}, None)
    unsorted = SowFold(SPEC)
    for m in (two, late_delta):  # without them the delta would merge into the live record
        unsorted.apply(m)
    assert unsorted.records[key].data == {"id": 2, "x": 1, "y": 1}


def test_the_worker_judges_what_expired_before_an_input_at_its_sort_time():
    """The worker's engine, given the sort time its loop files an input with, leaves what the fold
    leaves when no sweep ran in between: the delta stamped 2500 sorts at 4000, after record 2's
    instant (3000), so the record expires first (on EXP.t) and the delta starts a new record. An
    input no runner ordered (sort 0) is judged at its timestamp: the record is still live then."""
    key = SPEC.key_spec.sow_key({"id": 2})
    two = msg("t", 2, 2000, {"id": 2, "x": 1}, [(H.EXPIRATION, b"1s")])
    delta = msg("t", 4, 2500, {"id": 2, "y": 1}, [(H.COMMAND, b"delta_publish")])
    results = {}
    for sort in (4000, 0):
        worker = LocalTopic(SPEC)
        for p in range(SPEC.partitions):
            worker.open(p)
        worker.handle([two], now=2000)
        out = worker.handle([dataclasses.replace(delta, sort=sort)], now=5000)
        record = worker.stores[owner_partition(key, SPEC.partitions)].get(key)
        results[sort] = ([orjson.loads(o.value) for o in out if o.topic == SPEC.expired_topic], record.data, record.expires_at)
    assert results[4000] == ([{"id": 2, "x": 1}], {"id": 2, "y": 1}, None)
    assert results[0] == ([], {"id": 2, "x": 1, "y": 1}, None)


def test_a_delete_stamped_behind_its_place_removes_what_the_other_partitions_applied_before_it():
    """Review: a delete by filter whose stamp (1500) is behind its partition's time (2500) sorts at
    2500, after record X (stamped 2000 on the other partition). One worker owns both partitions and
    applies X first, so the delete removes it, as the fold does; judged by the delete's own stamp,
    X looked changed after the delete and stayed. Its copies for other workers carry the sort time."""
    spec = parse_topology({"sow": [{"topic": "t", "key": ["/id"], "partitions": 2, "timestamps": "publisher"}]}).sow[0]
    owned = {}
    for i in range(1, 20):
        owned.setdefault(owner_partition(spec.key_spec.sow_key({"id": i}), 2), i)
    inputs = [
        InputMessage("t", 1, 0, None, orjson.dumps({"id": owned[1]}), [], 2000),
        InputMessage("t", 0, 0, None, orjson.dumps({"id": owned[0]}), [], 2500),
        InputMessage("t", 0, 1, None, None, [(H.COMMAND, b"sow_delete"), (H.FILTER, b"1=1")], 1500),
    ]
    order = history(spec, inputs)
    assert [(s, m.partition, m.offset) for s, m in order] == [(2000, 1, 0), (2500, 0, 0), (2500, 0, 1)]
    fold = SowFold(spec)
    for sort, m in order:
        fold.apply(m, sort)
    worker = LocalTopic(spec)
    for sort, m in order:
        worker.handle([dataclasses.replace(m, sort=sort)], now=3000)
        worker.commit()
    assert fold.records == {} and [k for p in (0, 1) for k, _ in worker.stores[p].records()] == []
    alone = LocalTopic(spec)  # a worker that owns partition 0 only sends partition 1 a copy
    copies = alone.handle([dataclasses.replace(order[-1][1], sort=2500)], now=3000)
    assert [(c.topic, c.partition, c.timestamp) for c in copies] == [(spec.repartition_topic, 1, 2500)]
