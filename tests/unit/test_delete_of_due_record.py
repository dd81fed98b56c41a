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
