"""A delete that reaches a record whose instant has passed: the record had expired already.

The rule every engine follows (`SowTopicProcessor`, the Spark streaming runner, the reference fold
and the snapshot job): a record whose expiry instant is <= now is gone before an input applies, so
the input sees no record and the record leaves with `expire` (and its EXP.<topic> event), not
`delete`. The conformance suite (tests/integration/test_conformance.py) found the Faust processor
deleting such a record when the publish and the delete came in one batch, before an expiry sweep.
"""

import orjson

from processor.contract.types import Op
from processor.core.keys import owner_partition
from processor.contract.types import InputMessage
from processor.testing import LocalTopic
from processor.engine.fold import SowFold
from processor.topology import parse_topology

N = 2


def _spec():
    return parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": N, "expiration": "enabled", "persistence": "memory"}]}).topic("orders")


def _messages(spec):
    key = spec.key_spec.sow_key({"id": 1})
    p = owner_partition(key, N)
    publish = InputMessage("orders", p, 0, key.encode(), orjson.dumps({"id": 1, "s": "x"}), [("sow-expiration", b"1ms")], 1_000)
    delete = InputMessage("orders", p, 1, key.encode(), orjson.dumps({"id": 1}), [("sow-command", b"sow_delete")], 1_010)
    return [publish, delete]


def test_the_fold_expires_a_due_record_before_a_delete():
    spec = _spec()
    fold = SowFold(spec, transitions=True)
    ops = [t.op for m in _messages(spec) for t in fold.apply(m)]
    assert ops == [Op.INSERT, Op.EXPIRE]


def test_faust_processor_expires_a_due_record_before_a_delete():
    spec = _spec()
    proc = LocalTopic(spec, None)
    out = proc.handle(_messages(spec), now=5_000)  # one batch, long after the record's instant
    ops = [dict(r.headers)["sow-op"] for r in out if r.topic == "orders.sow"]
    assert ops == [b"insert", b"expire"]
    assert [orjson.loads(r.value) for r in out if r.topic == "EXP.orders"] == [{"id": 1, "s": "x"}]


def _late(spec, *inputs):
    """The inputs (value, headers, timestamp) of record 1's partition, applied at once 30 s after the
    last was sent (a worker behind), and folded in timestamp order: (.sow ops and records, fold ops)."""
    key = spec.key_spec.sow_key({"id": 1})
    p = owner_partition(key, N)
    messages = [InputMessage("orders", p, i, key.encode(), orjson.dumps(v), h, ts) for i, (v, h, ts) in enumerate(inputs)]
    out = LocalTopic(spec, None).handle(messages, now=messages[-1].timestamp + 30_000)
    fold = SowFold(spec, transitions=True)
    return ([(dict(r.headers)["sow-op"].decode(), r.value and orjson.loads(r.value)) for r in out if r.topic == "orders.sow"],
            [t.op.value for m in messages for t in fold.apply(m)])


def test_an_input_sent_before_the_instant_and_applied_after_it_finds_the_record():
    """A lifetime counts from when an input reached Kafka, and so does what it finds: a delta or a
    delete sent before the record's instant finds it, however late a worker applies it (it was
    expired first, and the delta became the whole record; the delete an expiry)."""
    spec = _spec()
    ttl = [("sow-expiration", b"10s")]
    delta = [("sow-command", b"delta_publish"), *ttl]
    sow, fold = _late(spec, ({"id": 1, "s": "x", "q": 1}, ttl, 1_000), ({"id": 1, "q": 2}, delta, 10_500))
    assert sow == [("insert", {"id": 1, "s": "x", "q": 1}), ("update", {"id": 1, "s": "x", "q": 2})] and fold == ["insert", "update"]
    sow, fold = _late(spec, ({"id": 1, "s": "x"}, ttl, 1_000), ({"id": 1}, [("sow-command", b"sow_delete")], 10_500))
    assert [op for op, _ in sow] == ["insert", "delete"] and fold == ["insert", "delete"]
    sow, fold = _late(spec, ({"id": 1, "s": "x"}, ttl, 1_000), ({"id": 1, "q": 2}, delta, 11_500))  # sent after it: expired first
    assert sow == [("insert", {"id": 1, "s": "x"}), ("expire", None), ("insert", {"id": 1, "q": 2})] and fold == ["insert", "expire", "insert"]


def test_capacity_does_not_count_a_record_whose_instant_passed_before_the_new_one_came():
    """The sweep has not come yet (a worker behind): the full partition's due record expires first,
    and the new one is taken (it was refused, or the due record reported evicted on `.dead`)."""
    for policy, evicted in (("reject", []), ("evict_oldest", [b"evict"])):
        spec = parse_topology({"sow": [{"topic": "c", "key": ["/id"], "partitions": 1, "expiration": "enabled", "persistence": "memory",
                                        "capacity": 1, "capacity_policy": policy}]}).topic("c")
        proc = LocalTopic(spec, None)
        proc.handle([InputMessage("c", 0, 0, None, orjson.dumps({"id": 1}), [("sow-expiration", b"1s")], 1_000)], now=1_000)
        proc.commit()
        out = proc.handle([InputMessage("c", 0, 1, None, orjson.dumps({"id": 2}), [], 2_500)], now=3_000)
        assert [(r.topic, dict(r.headers).get("sow-op")) for r in out if r.topic != "c.diff"] == [
            ("c.sow", b"expire"), ("EXP.c", b"expire"), ("c.sow", b"insert")], policy
        proc.commit()
        out = proc.handle([InputMessage("c", 0, 2, None, orjson.dumps({"id": 3}), [], 3_500)], now=4_000)  # full, nothing due
        assert [dict(r.headers).get("sow-op") for r in out if r.topic == "c.dead"] == evicted
        assert [r.topic for r in out if r.topic == "c.errors"] == (["c.errors"] if policy == "reject" else [])
