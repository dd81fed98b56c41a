"""A `<topic>.sow` record whose sow-seq no worker writes (negative, or near 2**63) is skipped at
restore: stored, a negative one failed the commit of the restore (the age index keys it unsigned),
and one near 2**63 left the next event ID past 64 bits, so every later write failed to commit."""

import orjson
import pytest

from processor.core.changelog import MalformedSowMessage
from processor.contract.types import InputMessage
from processor.testing import LocalTopic
from processor.topology import parse_topology


def make(tmp_path, **extra):
    spec = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1, **extra}]}).topic("orders")
    return LocalTopic(spec, tmp_path)


@pytest.mark.parametrize("seq", [-5, -(2**63), 2**63 - 1, 2**63 - 1024, 2**62])
@pytest.mark.parametrize("value", [b'{"id": "zz"}', None])
def test_a_restored_event_id_out_of_range_is_skipped(tmp_path, seq, value):
    proc = make(tmp_path, capacity=10)
    proc.restore(0, b"old", b'{"id": "old"}', [("sow-seq", b"1025")], 1_000)
    with pytest.raises(MalformedSowMessage, match="sow-seq"):
        proc.restore(0, b"zz", value, [("sow-seq", str(seq).encode())], 1_000)
    proc.commit(0)  # the restore commits
    out = proc.handle([InputMessage("orders", 0, 1, None, orjson.dumps({"id": "b"}), None, 2_000)], 5_000)
    proc.commit(0)  # and so does the next write
    seqs = [int(dict(o.headers)["sow-seq"]) for o in out if o.topic == "orders.sow"]
    assert len(seqs) == 1 and 0 < seqs[0] < 2**63
    assert proc.stores[0].get("zz") is None and proc.stores[0].count() == 2


def test_event_ids_a_worker_writes_are_restored(tmp_path):
    proc = make(tmp_path, capacity=10)
    proc.restore(0, b"k", b'{"id": "k"}', [("sow-seq", str(2**62 - 1024).encode())], 1_000)
    proc.commit(0)
    assert proc.stores[0].get("k").seq == 2**62 - 1024
