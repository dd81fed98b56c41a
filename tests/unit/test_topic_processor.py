"""The engine-neutral processor on real stores: flows with exact outputs, routing, errors, expiry."""

import time

import orjson
import pytest

from processor.core.keys import owner_partition
from processor.contract import headers as H
from processor.contract.types import InputMessage
from processor.engine.fold import SowFold
from processor.engine.topic import SowTopicEngine
from processor.state.base import open_partition_store
from processor.testing import LocalTopic
from processor.topology import parse_topology

N = 4


def make(tmp_path, **extra):
    spec = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": N, **extra}]}).topic("orders")
    return LocalTopic(spec, tmp_path)


def key_of(proc, record):
    return proc.spec.key_spec.sow_key(record)


def msg(proc, record, topic="orders", headers=None, ts=1_000, partition=None, offset=0):
    value = None if record is None else orjson.dumps(record)
    if partition is None:
        partition = owner_partition(key_of(proc, record), N)
    return InputMessage(topic, partition, offset, b"k", value, headers or [], ts)


def by_topic(requests):
    out = {}
    for r in requests:
        out.setdefault(r.topic, []).append(r)
    return out


def hdr(r, name):
    return dict(r.headers).get(name)


def run(proc, messages, now=5_000):
    out = proc.handle(messages, now=now)
    for p in list(proc.stores):
        proc.commit(p)
    return out


@pytest.fixture(params=["persistent", "memory"])
def proc(request, tmp_path):
    return make(tmp_path, persistence=request.param)


def test_publish_delta_delete_flow(proc):
    first = {"id": 1, "status": "open", "qty": 10, "m": {"a": 1}}
    out = by_topic(run(proc, [msg(proc, first)]))
    (sow,), (diff,) = out["orders.sow"], out["orders.diff"]
    assert orjson.loads(sow.value) == first and orjson.loads(diff.value) == first
    assert hdr(sow, "sow-op") == b"insert" and hdr(sow, "sow-key") == key_of(proc, first).encode()
    assert sow.partition == owner_partition(key_of(proc, first), N) and sow.changelog

    out = by_topic(run(proc, [msg(proc, {"id": 1, "qty": 20, "m": {"b": 2}}, topic="orders.delta")]))
    assert orjson.loads(out["orders.sow"][0].value) == {"id": 1, "status": "open", "qty": 20, "m": {"a": 1, "b": 2}}
    assert orjson.loads(out["orders.diff"][0].value) == {"id": 1, "qty": 20, "m": {"b": 2}}
    assert hdr(out["orders.diff"][0], "sow-op") == b"update"
    seq_update = int(hdr(out["orders.diff"][0], "sow-seq"))

    out = by_topic(run(proc, [msg(proc, {"id": 1}, headers=[("sow-command", b"sow_delete")])]))
    (sow,), (diff,) = out["orders.sow"], out["orders.diff"]
    assert sow.value is None and hdr(sow, "sow-op") == b"delete"
    assert orjson.loads(diff.value) == {"id": 1, "status": "open", "qty": 20, "m": {"a": 1, "b": 2}}
    assert int(hdr(diff, "sow-seq")) > seq_update
    assert proc.stores[sow.partition].get(key_of(proc, first)) is None
    # Deleting what is not there changes nothing and says nothing.
    assert run(proc, [msg(proc, {"id": 1}, headers=[("sow-command", b"sow_delete")])]) == []


def test_delta_on_missing_record_becomes_the_record(proc):
    out = by_topic(run(proc, [msg(proc, {"id": 2, "x": 1}, topic="orders.delta")]))
    assert hdr(out["orders.sow"][0], "sow-op") == b"insert"


def test_wrong_partition_is_rerouted_with_its_origin(proc):
    record = {"id": 3, "v": 1}
    owner = owner_partition(key_of(proc, record), N)
    out = run(proc, [msg(proc, record, topic="orders.delta", partition=(owner + 1) % N, ts=1234)])
    (r,) = out
    assert r.topic == "orders.repartition" and r.partition == owner and r.key == key_of(proc, record).encode()
    assert hdr(r, "ksow-origin") == b"delta_publish" and r.timestamp == 1234
    back = InputMessage("orders.repartition", owner, 0, r.key, r.value, r.headers, r.timestamp)
    out = by_topic(run(proc, [back]))
    assert hdr(out["orders.sow"][0], "sow-op") == b"insert"


def test_bad_inputs_go_to_errors_with_original_bytes(proc):
    bad = [
        InputMessage("orders", 0, 7, b"key1", b"{oops", [], 1),
        InputMessage("orders", 1, 8, b"key2", b'{"no_id": 1}', [("x", b"y")], 1),
        InputMessage("orders", 2, 9, None, b'{"id": 1}', [("sow-command", b"nope")], 1),
    ]
    out = run(proc, bad)
    assert [r.topic for r in out] == ["orders.errors"] * 3
    assert [r.value for r in out] == [b"{oops", b'{"no_id": 1}', b'{"id": 1}']
    assert out[0].key == b"key1" and b"not valid JSON" in hdr(out[0], "sow-error")
    assert hdr(out[1], "sow-error") == b"missing key field /id" and hdr(out[1], "x") == b"y"
    assert hdr(out[2], "sow-error-offset") == b"9"
    assert all(proc.stores.get(p) is None or proc.stores[p].count() == 0 for p in range(N))


def _nested(levels: int) -> bytes:
    """A record whose objects and arrays nest `levels` deep (the record itself is one level)."""
    return b'{"id": 1, "a": ' + b"[" * (levels - 1) + b"1" + b"]" * (levels - 1) + b"}"


def test_a_record_nested_past_the_bound_goes_to_errors_with_the_reason(proc):
    """orjson reads 1024 levels but writes 254, and a record travels inside other JSON (a query's
    answer, a held view event): one nested 254 levels was stored, then failed every query that
    returned it. Records nest at most 200 levels; deeper ones are refused when they come in."""
    shallow = {"id": 1, "a": 2}
    first = run(proc, [msg(proc, shallow)])
    assert [r.topic for r in first] == ["orders.sow", "orders.diff"]
    p = first[0].partition
    out = run(proc, [InputMessage("orders", p, 1, b"k", _nested(201), [], 1_000)])
    assert [r.topic for r in out] == ["orders.errors"]
    assert hdr(out[0], "sow-error") == b"value nests objects and arrays deeper than 200 levels"
    (stored,) = [rec for store in proc.stores.values() for _, rec in store.records()]
    assert stored.data == shallow  # the SOW keeps the record as it was
    out = run(proc, [InputMessage("orders", p, 2, b"k", _nested(200), [], 1_000)])
    assert [r.topic for r in out] == ["orders.sow", "orders.diff"]
    (stored,) = [rec for store in proc.stores.values() for _, rec in store.records()]
    orjson.dumps({"results": [{"record": stored.data}]})  # a worker's query answer can carry it


def two_workers(tmp_path):
    """Two runners of one topic: `a` owns partitions 0 and 1, `b` owns 2 and 3."""
    a, b = make(tmp_path / "a"), make(tmp_path / "b")
    for p in range(N):
        (a if p < 2 else b).open(p)
    return a, b


def load(a, b, records):
    for r in records:
        m = msg(a, r)
        worker = a if m.partition < 2 else b
        worker.handle([m], now=5_000)
        worker.commit()


def test_delete_by_keys_applies_at_local_owners_and_reroutes_to_the_others(tmp_path):
    a, b = two_workers(tmp_path)
    recs = [{"id": i} for i in range(12)]
    load(a, b, recs)
    keys = [key_of(a, r) for r in recs[:6]]
    remote = {k for k in keys if owner_partition(k, N) >= 2}
    assert remote and remote != set(keys)
    out = run(a, [InputMessage("orders", 0, 0, None, None, [("sow-command", b"sow_delete"), ("sow-keys", ",".join(keys).encode())], 2_000)])
    rerouted = [r for r in out if r.topic == "orders.repartition"]
    assert sorted(r.key.decode() for r in rerouted) == sorted(remote) and all(r.partition == owner_partition(r.key.decode(), N) for r in rerouted)
    assert {r.key.decode() for r in out if r.topic == "orders.sow"} == set(keys) - remote
    out = by_topic(run(b, [InputMessage(r.topic, r.partition, 0, r.key, r.value, r.headers, r.timestamp) for r in rerouted]))
    assert {r.key.decode() for r in out["orders.sow"]} == remote
    assert sum(w.stores[p].count() for w in (a, b) for p in w.stores) == 6


def test_expiry_removes_due_records_with_all_outputs(tmp_path):
    proc = make(tmp_path, expiration="10s")
    record = {"id": 9, "s": "x"}
    out = by_topic(run(proc, [msg(proc, record, ts=1_000)]))
    assert hdr(out["orders.sow"][0], "sow-expires-at") == b"11000"
    p = out["orders.sow"][0].partition
    assert proc.expire_due(p, now=10_999) == []
    out = by_topic(proc.expire_due(p, now=11_050))
    proc.commit(p)
    assert out["orders.sow"][0].value is None and hdr(out["orders.sow"][0], "sow-op") == b"expire"
    assert orjson.loads(out["orders.diff"][0].value) == record
    assert orjson.loads(out["EXP.orders"][0].value) == record
    assert hdr(out["EXP.orders"][0], "sow-actual-expiry") == b"11050"
    assert proc.stores[p].count() == 0


def test_expired_and_evicted_records_name_their_sow_topic_where_topics_may_share_them(tmp_path):
    """Several SOW topics may send expired and dead records to one topic: each message there says
    which SOW topic it left (`sow-topic`); `.sow` and `.diff` are the topic's own and do not."""
    topo = parse_topology({"sow": [
        {"topic": t, "key": ["/id"], "partitions": 1, "expiration": "10s", "capacity": 1, "expiry_topic": "gone", "dead_event_topic": "gone"}
        for t in ("a", "b")]})
    for spec in topo.sow:
        proc = LocalTopic(spec, tmp_path / spec.topic)
        t = spec.topic
        evicted = by_topic(run(proc, [InputMessage(t, 0, i, None, orjson.dumps({"id": i}), None, 1_000 + i) for i in range(2)]))
        expired = by_topic(proc.expire_due(0, now=20_000))
        proc.commit(0)
        (dead,), (exp,) = evicted["gone"], expired["gone"]
        assert (hdr(dead, "sow-op"), hdr(exp, "sow-op")) == (b"evict", b"expire")
        assert hdr(dead, H.TOPIC) == hdr(exp, H.TOPIC) == t.encode()
        own = evicted[f"{t}.sow"] + evicted[f"{t}.diff"] + expired[f"{t}.sow"] + expired[f"{t}.diff"]
        assert len(own) == 8 and all(hdr(o, H.TOPIC) is None for o in own)  # two inserts, an eviction, an expiry
        assert dict(exp.headers).keys() - {H.TOPIC} == dict(expired[f"{t}.diff"][0].headers).keys()
        proc.close()


def test_a_sweep_tells_how_many_it_expired_and_the_oldest_instant(tmp_path):
    """What a worker's ksow_expiry_lateness_seconds observes: `now` less the oldest instant a sweep
    expired, whatever order the records were published in; a sweep with a limit starts from the
    oldest left."""
    proc = make(tmp_path, expiration="10s", partitions=1)
    run(proc, [msg(proc, {"id": i}, ts=ts, partition=0, offset=i) for i, ts in enumerate([3_000, 1_000, 2_000])], now=3_000)
    proc.commit()
    engine = proc.engine
    assert engine.expire_due(0, 10_999, []) == (0, 0)
    assert engine.expire_due(0, 12_500, [], limit=1) == (1, 11_000)
    assert engine.expire_due(0, 14_000, []) == (2, 12_000)
    assert engine.expire_due(0, 20_000, []) == (0, 0)


def test_a_sweep_that_stops_at_its_limit_leaves_the_rest_due_in_the_fold_too():
    """The reference fold's state hands each due entry out once (a heap it pops): a sweep with a
    limit takes the records it expires and no other, so three sweeps of one expire all three."""
    spec = parse_topology({"sow": [{"topic": "t", "key": ["/id"], "partitions": 1, "expiration": "10s"}]}).sow[0]
    fold = SowFold(spec)
    for i in range(3):
        fold.apply(InputMessage("t", 0, i, None, orjson.dumps({"id": i}), None, 1_000 + i))
    out: list = []
    assert [fold.partitions[0].expire_due(20_000, out, limit=1)[0] for _ in range(4)] == [1, 1, 1, 0]
    assert fold.records == {} and len([o for o in out if o.topic == "EXP.t"]) == 3


def test_update_restarts_lifetime_and_zero_never_expires(tmp_path):
    proc = make(tmp_path, expiration="10s")
    r = {"id": 1}
    run(proc, [msg(proc, r, ts=1_000)])
    run(proc, [msg(proc, {"id": 1, "v": 2}, topic="orders.delta", ts=8_000)], now=8_000)
    p = owner_partition(key_of(proc, r), N)
    assert proc.expire_due(p, now=12_000) == []
    assert proc.stores[p].get(key_of(proc, r)).expires_at == 18_000
    run(proc, [msg(proc, {"id": 1}, headers=[("sow-expiration", b"0")], ts=9_000)], now=9_000)
    assert proc.expire_due(p, now=10**12) == [] and proc.stores[p].count() == 1


def test_publish_on_an_expired_record_expires_it_first(tmp_path):
    proc = make(tmp_path, expiration="1s")
    run(proc, [msg(proc, {"id": 1, "a": 1}, ts=1_000)], now=1_000)
    out = run(proc, [msg(proc, {"id": 1, "b": 2}, topic="orders.delta", ts=5_000)], now=5_000)
    ops = [hdr(r, "sow-op") for r in out if r.topic == "orders.diff"]
    assert ops == [b"expire", b"insert"]
    assert orjson.loads([r for r in out if r.topic == "orders.sow"][-1].value) == {"id": 1, "b": 2}


def test_event_ids_increase_and_survive_restore(tmp_path):
    proc = make(tmp_path)
    outs = run(proc, [msg(proc, {"id": 1, "v": v}) for v in range(3)])
    seqs = [int(hdr(r, "sow-seq")) for r in outs if r.topic == "orders.sow"]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    p = outs[0].partition
    assert all(s & 1023 == p for s in seqs)
    # A fresh worker restores the partition from the changelog records and continues above them.
    other = make(tmp_path / "other")
    for r in outs:
        if r.changelog:
            other.restore(p, r.key, r.value, r.headers, 1_000)
    other.commit(p)
    assert other.stores[p].get(key_of(other, {"id": 1})).data == {"id": 1, "v": 2}
    again = run(other, [msg(other, {"id": 1, "v": 9})], now=0)
    assert int(hdr(again[0], "sow-seq")) > max(seqs)


def test_a_sweep_numbers_its_expiries_as_next_seq_would(tmp_path):
    """A sweep keeps the event-ID counter in a local and stores it once: its expiries must still get
    increasing IDs floored by the clock, and the next change of the partition an ID above them."""
    proc = make(tmp_path, expiration="1s")
    records = [{"id": i} for i in range(40)]
    p = owner_partition(key_of(proc, records[0]), N)
    mine = [r for r in records if owner_partition(key_of(proc, r), N) == p]
    assert len(mine) >= 3
    run(proc, [msg(proc, r, ts=1_000) for r in mine], now=1_000)
    # Written at 1 s, swept at 2 s: the clock floor (now * 1000) is above the counter, so the IDs
    # count up from the floor, one apart.
    expired = proc.expire_due(p, 2_000)
    seqs = [int(hdr(r, "sow-seq")) for r in expired if r.topic == "orders.sow"]
    assert len(seqs) == len(mine)
    assert all(s & 1023 == p for s in seqs)
    counters = [s >> 10 for s in seqs]
    assert counters == list(range(counters[0], counters[0] + len(mine)))
    assert counters[0] == 2_000 * 1000
    proc.commit(p)
    after = run(proc, [msg(proc, mine[0], ts=2_000)], now=2_000)
    assert int(hdr(after[0], "sow-seq")) >> 10 == counters[-1] + 1
    # The next sweep, far later: the floor again.
    run(proc, [msg(proc, r, ts=3_000) for r in mine[1:]], now=3_000)
    late = [int(hdr(r, "sow-seq")) >> 10 for r in proc.expire_due(p, 9_000_000) if r.topic == "orders.sow"]
    assert late == list(range(9_000_000 * 1000, 9_000_000 * 1000 + len(mine)))


def test_a_filter_delete_applies_at_local_partitions_and_fans_out_to_the_others(tmp_path):
    a, b = two_workers(tmp_path)
    load(a, b, [{"id": i, "s": "open" if i % 2 else "done"} for i in range(8)])
    out = run(a, [InputMessage("orders", 0, 0, None, None, [("sow-command", b"sow_delete"), ("sow-filter", b"/s = 'open'")], 2_000)])
    rerouted = [r for r in out if r.topic == "orders.repartition"]
    assert sorted(r.partition for r in rerouted) == [2, 3] and all(hdr(r, H.LOCAL) == b"1" for r in rerouted)
    # The copies for other owners come after every local removal: a long delete that commits part of
    # its work and is applied again after a crash must not have sent them already.
    topics = [r.topic for r in out]
    assert topics.index("orders.repartition") > max(i for i, t in enumerate(topics) if t != "orders.repartition")
    deleted = [r for r in out if r.topic == "orders.sow"]
    out = by_topic(run(b, [InputMessage(r.topic, r.partition, 0, r.key, r.value, r.headers, r.timestamp) for r in rerouted]))
    assert len(deleted) + len(out["orders.sow"]) == 4
    assert sum(w.stores[p].count() for w in (a, b) for p in w.stores) == 4


def test_a_filter_delete_that_names_sowkeys_goes_only_to_their_owners(tmp_path):
    """`/id IN ('3', '6')` can match only the records of two SowKeys, in every partition: the
    partitions that own neither get no copy. A number literal can also match a string spelled
    otherwise ('03'), whose SowKey is another: that delete still goes everywhere."""
    a, b = two_workers(tmp_path)
    records = [{"id": i, "s": "open"} for i in range(12)]
    load(a, b, records)
    owners = {owner_partition(key_of(a, {"id": i}), N) for i in (3, 6)}
    out = run(a, [InputMessage("orders", 0, 0, None, None, [("sow-command", b"sow_delete"), ("sow-filter", b"/id IN ('3', '6') AND /s = 'open'")], 2_000)])
    rerouted = [r for r in out if r.topic == "orders.repartition"]
    assert sorted(r.partition for r in rerouted) == sorted(owners - {0, 1})
    out += run(b, [InputMessage(r.topic, r.partition, 0, r.key, r.value, r.headers, r.timestamp) for r in rerouted])
    assert sorted(orjson.loads(r.value)["id"] for r in out if r.topic == "orders.diff") == [3, 6]
    assert sum(w.stores[p].count() for w in (a, b) for p in w.stores) == 10
    out = run(a, [InputMessage("orders", 0, 1, None, None, [("sow-command", b"sow_delete"), ("sow-filter", b"/id = 4")], 3_000)])
    assert sorted(r.partition for r in out if r.topic == "orders.repartition") == [2, 3]


def test_a_fanned_out_delete_arriving_late_keeps_what_was_published_after_it(tmp_path):
    """Another worker's copy of a delete by filter reaches b after b applied a publish sent later
    than the delete: that record stays; the ones last changed before the delete go. The same holds
    for a store restored from `.sow`, whose records carry the instant of their change."""
    a, b = two_workers(tmp_path)
    load(a, b, [{"id": i, "s": "open"} for i in range(8)])  # Kafka timestamp 1,000
    late = [r for r in range(8) if msg(b, {"id": r}).partition >= 2][0]
    newer = msg(b, {"id": late, "s": "open", "v": 2}, ts=3_000)
    restored = make(tmp_path / "restored")
    for r in (r for r in run(b, [newer]) if r.changelog):
        assert r.timestamp == 3_000
        restored.restore(r.partition, r.key, r.value, r.headers, r.timestamp)
    for p in (2, 3):
        restored.open(p)
    out = run(a, [InputMessage("orders", 0, 0, None, None, [("sow-command", b"sow_delete"), ("sow-filter", b"/s = 'open'")], 2_000)])
    copies = [InputMessage(r.topic, r.partition, 0, r.key, r.value, r.headers, r.timestamp) for r in out if r.topic == "orders.repartition"]
    assert {c.timestamp for c in copies} == {2_000}
    for worker in (b, restored):
        deleted = [r.key for r in run(worker, copies) if r.topic == "orders.sow"]
        kept = {k for p in (2, 3) for k, _ in worker.stores[p].records()}
        assert kept == {key_of(b, {"id": late})}, "the later publish survives the delete sent before it"
        if worker is b:
            assert len(deleted) == sum(msg(b, {"id": i}).partition >= 2 for i in range(8)) - 1


def test_bad_filters_and_internal_headers_are_errors_not_crashes(proc):
    out = run(proc, [
        InputMessage("orders", 0, 0, b"k", None, [("sow-command", b"sow_delete"), ("sow-filter", b"/a = = 1")], 1),
        InputMessage("orders.repartition", 0, 1, b"k", b'{"id": 1}', [("ksow-origin", b"bogus")], 1),
    ])
    assert [r.topic for r in out] == ["orders.errors", "orders.errors"]
    assert b"bad sow-filter" in hdr(out[0], "sow-error") and b"ksow-origin" in hdr(out[1], "sow-error")


def test_unexpected_failures_park_the_message(proc, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    from processor.engine.partition import SowPartition

    monkeypatch.setattr(SowPartition, "write", boom)
    out = run(proc, [msg(proc, {"id": 1})])
    assert [r.topic for r in out] == ["orders.errors"] and b"internal error: RuntimeError: disk on fire" in hdr(out[0], "sow-error")


class _Delivered:
    def __init__(self, topic, partition, offset):
        self._tp, self._offset = (topic, partition), offset

    def topic(self):
        return self._tp[0]

    def partition(self):
        return self._tp[1]

    def offset(self):
        return self._offset


def test_changelog_positions_from_sampled_delivery_reports():
    """A store's changelog position is one past its partition's last `.sow` record of the batch, from
    any reported record and the number produced after it; other records between them (a commit
    marker, a zombie's aborted writes) leave it a lower bound; a failed delivery is kept, so the
    batch fails."""
    from confluent_kafka import KafkaError

    from processor.runners.faust.loop import _Positions

    positions = _Positions()
    positions.report(1, None, _Delivered("orders.sow", 0, 5))  # records 1..4 of p0 at offsets 5..8
    positions.report(1, None, _Delivered("orders.sow", 2, 9))  # record 1 of p2 at 9, record 2 at 12 (a gap)
    assert positions.ends({("orders.sow", 0): 4, ("orders.sow", 2): 2}) == {("orders.sow", 0): 9, ("orders.sow", 2): 11}
    positions.report(2, None, _Delivered("orders.sow", 2, 12))  # a later report narrows it to the real end
    assert positions.ends({("orders.sow", 0): 4, ("orders.sow", 2): 2})[("orders.sow", 2)] == 13
    assert not positions.failed
    positions.report(5, KafkaError(KafkaError._MSG_TIMED_OUT), _Delivered("orders.sow", 0, 11))
    assert positions.failed and positions.ends({("orders.sow", 0): 5, ("orders.sow", 2): 2})[("orders.sow", 0)] == 10


def test_delete_by_filter_sees_records_of_the_same_batch():
    """A publish and a fanned-out delete by filter (back from `.repartition`) in one batch: the
    delete removes the new record too."""
    spec = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1, "persistence": "memory"}]}).topic("orders")
    proc = LocalTopic(spec, None)
    key = spec.key_spec.sow_key({"id": 7})
    publish = InputMessage("orders", 0, 0, key.encode(), orjson.dumps({"id": 7, "desk": "fx"}), [], 1_000)
    delete = InputMessage("orders.repartition", 0, 1, None, None, [("sow-command", b"sow_delete"), ("sow-filter", b"/desk = 'fx'"), (H.LOCAL, b"1")], 1_001)
    out = proc.handle([publish, delete], now=2_000)
    assert [dict(r.headers)["sow-op"] for r in out if r.topic == "orders.sow"] == [b"insert", b"delete"]
    proc.commit(0)
    assert proc.stores[0].count() == 0


def test_a_view_tells_when_its_records_expired_as_the_topic_does(tmp_path):
    """Expire events carry `sow-actual-expiry` on every topic that tells them, the views' too."""
    topology = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1, "expiration": "10s"}],
                               "views": [{"name": "open_orders", "topic": "orders", "filter": "/s = 'open'", "options": ["oof"]}]})
    proc = LocalTopic(topology.topic("orders"), tmp_path, views=topology.views_of("orders"))
    run(proc, [msg(proc, {"id": 1, "s": "open"}, ts=1_000, partition=0)])
    out = by_topic(proc.expire_due(0, now=11_050))
    for topic in ("orders.sow", "open_orders.sow", "open_orders.diff"):
        assert hdr(out[topic][0], "sow-op") in (b"expire", b"oof") and hdr(out[topic][0], "sow-actual-expiry") == b"11050", topic


def test_a_record_new_to_a_view_is_an_insert_and_one_in_and_out_within_its_interval_is_not_told(tmp_path):
    """Audit: a record that an update brought into a view came as `update` on `<view>.sow` and
    `.diff` (a key the view never had); and one that came in and left within a conflation
    interval gave an oof for a record the view's readers were never told of."""
    topology = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1}],
                               "views": [{"name": "eu", "topic": "orders", "filter": "/r = 'EU'", "options": ["oof"]},
                                         {"name": "eu_conf", "topic": "orders", "filter": "/r = 'EU'", "options": ["oof"], "conflation": "2s"}]})
    proc = LocalTopic(topology.topic("orders"), tmp_path, views=topology.views_of("orders"))
    run(proc, [msg(proc, {"id": 1, "r": "US"}, ts=1_000, partition=0)], now=1_000)
    came = by_topic(run(proc, [msg(proc, {"id": 1, "r": "EU"}, ts=1_100, partition=0, offset=1)], now=1_100))
    assert hdr(came["orders.sow"][0], "sow-op") == b"update"
    assert hdr(came["eu.sow"][0], "sow-op") == b"insert" and hdr(came["eu.diff"][0], "sow-op") == b"insert"
    left = by_topic(run(proc, [msg(proc, {"id": 1, "r": "US"}, ts=1_200, partition=0, offset=2)], now=1_200))
    assert hdr(left["eu.diff"][0], "sow-op") == b"oof"
    assert "eu_conf.diff" not in came and "eu_conf.diff" not in left
    assert left["orders.holds"][-1].value is None  # the held insert is dropped, not sent
    released: list = []
    proc.engine.release_views(0, 10_000, released)
    assert not [o for o in released if o.topic == "eu_conf.diff"]
    # In the view, then out, back and out again within one interval (verification audit): the view's
    # readers are told it left (that leave goes out when it comes back), and nothing else.
    run(proc, [msg(proc, {"id": 1, "r": "EU"}, ts=20_000, partition=0, offset=3)], now=20_000)
    released = []
    proc.engine.release_views(0, 30_000, released)
    assert [hdr(o, "sow-op") for o in released if o.topic == "eu_conf.diff"] == [b"insert"]
    steps = [by_topic(run(proc, [msg(proc, {"id": 1, "r": r}, ts=40_000 + n, partition=0, offset=4 + n)], now=40_000 + n))
             for n, r in enumerate(["US", "EU", "US"])]
    assert [[hdr(o, "sow-op") for o in step.get("eu_conf.diff", [])] for step in steps] == [[], [b"oof"], []]
    released = []
    proc.engine.release_views(0, 50_000, released)
    assert not [o for o in released if o.topic == "eu_conf.diff"]


def test_a_view_with_no_sowkey_leaves_the_sow_key_header_off_its_messages(tmp_path):
    """Seed 001's no_sowkey: the view's messages keep the SowKey as their Kafka key (compaction
    needs it) but not as a header; without the option they carry both."""
    topology = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1}],
                               "views": [{"name": "bare", "topic": "orders", "options": ["no_sowkey"]}, {"name": "keyed", "topic": "orders"}]})
    proc = LocalTopic(topology.topic("orders"), tmp_path, views=topology.views_of("orders"))
    out = by_topic(run(proc, [msg(proc, {"id": 1, "s": "open"}, ts=1_000, partition=0)]))
    for topic in ("bare.sow", "bare.diff"):
        assert out[topic][0].key and hdr(out[topic][0], "sow-key") is None, topic
    for topic in ("keyed.sow", "keyed.diff"):
        assert hdr(out[topic][0], "sow-key") == out[topic][0].key, topic


def test_a_rerouted_input_that_fails_is_filed_with_its_first_key_and_place(proc, monkeypatch):
    """Rerouted through `.repartition` to another worker, an input that its owner cannot apply
    (here: over the size a message may have) was filed under its SowKey and the internal topic's
    place, so an operator could not find the publisher's message."""
    record = {"id": 3, "v": 1}
    owner = owner_partition(key_of(proc, record), N)
    (r,) = run(proc, [InputMessage("orders.delta", (owner + 1) % N, 41, b"pub-key", orjson.dumps(record), [("x", b"y")], 1234)])
    assert hdr(r, "ksow-source") == b"orders.delta:%d:41" % ((owner + 1) % N) and hdr(r, "ksow-source-key") == b"pub-key"
    monkeypatch.setenv("KSOW_MAX_RECORD_BYTES", "10")
    small = LocalTopic(proc.spec, None)
    (err,) = run(small, [InputMessage("orders.repartition", owner, 5, r.key, r.value, r.headers, r.timestamp)])
    assert err.topic == "orders.errors" and err.partition == owner and err.key == b"pub-key" and err.value == r.value
    assert [(k, v) for k, v in err.headers if not k.startswith("sow-error")] == [("x", b"y")]
    assert (hdr(err, "sow-error-topic"), hdr(err, "sow-error-partition"), hdr(err, "sow-error-offset")) == (b"orders.delta", b"%d" % ((owner + 1) % N), b"41")
    forged = run(small, [InputMessage("orders.repartition", owner, 6, b"k", b"{", [("ksow-source", b"nonsense")], 1)])
    assert hdr(forged[0], "sow-error-topic") == b"orders.repartition" and forged[0].key == b"k"


def test_a_simple_sow_purged_at_a_restart_expires_what_fell_due_meanwhile(tmp_path):
    """Audit: the records of a `simple` SOW lost with its owner were all told as deletes, those whose
    instant passed while the worker was down too, and `EXP.` never had them (seed 000: records past
    their lifetime are removed as expired at recovery)."""
    proc = make(tmp_path, persistence="simple", expiration="enabled")
    due, live = {"id": 1, "v": 1}, {"id": 2, "v": 2}
    run(proc, [msg(proc, due, headers=[(H.EXPIRATION, b"1s")]), msg(proc, live, headers=[(H.EXPIRATION, b"1h")])], now=1_000)
    out = []
    for p, store in proc.stores.items():
        proc.engine.partitions[p].purge(store.records(), 10_000, out)
    got = by_topic(out)
    assert [orjson.loads(r.value) for r in got["EXP.orders"]] == [due]
    ops = {orjson.loads(r.value)["id"]: hdr(r, "sow-op") for r in got["orders.diff"]}
    assert ops == {1: b"expire", 2: b"delete"}
    assert all(r.value is None for r in got["orders.sow"])


def test_internal_headers_on_an_input_topic_are_a_publishers_and_ignored(tmp_path):
    """Audit: `ksow-local` on a delete by filter sent to `<topic>` made it apply to the partition it
    was read from only (a silent partial delete), and `ksow-source`/`ksow-source-key` on a bad
    input filed it on `.errors` under a key and place it never had. Only `.repartition` carries them."""
    proc = make(tmp_path, persistence="memory")
    run(proc, [msg(proc, {"id": i, "desk": "fx"}) for i in range(12)])
    assert sum(s.count() for s in proc.stores.values()) == 12
    forged = [(H.LOCAL, b"1"), (H.SOURCE, b"someone.else:7:12345"), (H.SOURCE_KEY, b"victim")]
    out = run(proc, [InputMessage("orders", 0, 3, None, None, [("sow-command", b"sow_delete"), ("sow-filter", b"/desk = 'fx'"), *forged], 2_000)])
    assert sum(s.count() for s in proc.stores.values()) == 0 and not [r for r in out if r.topic == "orders.errors"]
    (err,) = run(proc, [InputMessage("orders.delta", 2, 9, b"real", b"not json", forged, 3_000)])
    assert err.topic == "orders.errors" and err.key == b"real"
    assert (hdr(err, "sow-error-topic"), hdr(err, "sow-error-partition"), hdr(err, "sow-error-offset")) == (b"orders.delta", b"2", b"9")
    assert not [k for k, _ in err.headers if k in H.INTERNAL]


def test_a_delete_whose_filter_runs_past_its_budget_stops_and_says_what_it_did(tmp_path, monkeypatch):
    """A LIKE with large counted repetitions costs RE2 ~10 us a byte: one delete by filter could hold
    a worker's loop for hours. Past KSOW_DELETE_FILTER_SECONDS of filter time in a partition, the
    delete stops there: what it removed is told on `.sow` as usual, and the input lands on `.errors`
    saying how many and that the rest stayed (here the budget is tiny, the filter an ordinary one)."""
    proc = make(tmp_path, persistence="memory", partitions=1)
    run(proc, [InputMessage("orders", 0, i, None, orjson.dumps({"id": i, "desk": "fx"}), [], 1_000) for i in range(3000)])
    monkeypatch.setenv("KSOW_DELETE_FILTER_SECONDS", "0.0005")
    out = run(proc, [InputMessage("orders", 0, 3000, None, None, [("sow-command", b"sow_delete"), ("sow-filter", b"/desk = 'fx'")], 2_000)])
    (err,) = [r for r in out if r.topic == "orders.errors"]
    deleted = [r for r in out if r.topic == "orders.sow"]
    reason = hdr(err, "sow-error").decode()
    assert "KSOW_DELETE_FILTER_SECONDS" in reason and f"; {len(deleted)} records it matched were deleted" in reason
    assert 0 < len(deleted) < 3000 and proc.stores[0].count() == 3000 - len(deleted)
    monkeypatch.delenv("KSOW_DELETE_FILTER_SECONDS")
    out = run(proc, [InputMessage("orders", 0, 3001, None, None, [("sow-command", b"sow_delete"), ("sow-filter", b"/desk = 'fx'")], 3_000)])
    assert not [r for r in out if r.topic == "orders.errors"] and proc.stores[0].count() == 0


def test_a_delete_a_new_owner_applies_late_keeps_what_its_other_partitions_changed_after_it(tmp_path):
    """Chaos audit: a delete by filter (or keys) read late by the new owner of its partition (its
    worker was stopped, killed or fenced before committing it) removed the records its other
    partitions had since been published, though they were sent after it. Partitions other than the
    one it was read from now keep what changed after it was sent, as for a fanned-out copy."""
    proc = make(tmp_path, persistence="memory")
    records = [{"id": i, "s": "open"} for i in range(12)]
    run(proc, [msg(proc, r) for r in records])  # Kafka timestamp 1,000
    other = [r for r in records if msg(proc, r).partition != 0]
    later = msg(proc, {**other[0], "v": 2}, ts=3_000)  # applied before the delete sent at 2,000
    run(proc, [later])
    out = run(proc, [InputMessage("orders", 0, 5, None, None, [("sow-command", b"sow_delete"), ("sow-filter", b"/s = 'open'")], 2_000)])
    kept = {k for p in proc.stores for k, _ in proc.stores[p].records()}
    assert kept == {key_of(proc, other[0])}
    assert len([r for r in out if r.topic == "orders.sow"]) == 11


def test_a_delete_that_tests_many_records_lets_its_runner_commit_on_time(tmp_path, monkeypatch):
    """Review: a delete by filter that matched little while it tested records for longer than the
    transaction timeout (10 s, under its 30 s budget) had its transaction aborted by the coordinator,
    and was read again, for ever. While it tests records, a runner's buffer that can commit is asked
    to every DELETE_CHECKPOINT_SECONDS (here: every record), not only every KSOW_DELETE_CHUNK removals."""
    from processor.engine import partition

    proc = make(tmp_path, persistence="memory", partitions=1)
    run(proc, [InputMessage("orders", 0, i, None, orjson.dumps({"id": i, "desk": "fx" if i == 7 else "rates"}), [], 1_000) for i in range(50)])

    class Buffer(list):
        checkpoints = 0

        def checkpoint(self):
            self.checkpoints += 1

    out = Buffer()
    monkeypatch.setattr(partition, "DELETE_CHECKPOINT_SECONDS", 0.0)
    proc.engine.handle([InputMessage("orders", 0, 50, None, None, [("sow-command", b"sow_delete"), ("sow-filter", b"/desk = 'fx'")], 2_000)], 5_000, out)
    assert out.checkpoints >= 49 and [r.topic for r in out] == ["orders.sow", "orders.diff"]
    monkeypatch.setattr(partition, "DELETE_CHECKPOINT_SECONDS", 1.0)
    out = Buffer()
    proc.engine.handle([InputMessage("orders", 0, 51, None, None, [("sow-command", b"sow_delete"), ("sow-filter", b"/desk = 'none'")], 2_000)], 5_000, out)
    assert out.checkpoints == 0  # a scan of a few milliseconds commits nothing early


def test_a_delete_that_outlasted_its_transaction_is_refused_when_read_again(tmp_path):
    """Review: a delete whose single match took 37 s (longer than the 10 s transaction timeout)
    could not commit; read again, it stalled the partition the same way, for ever. A runner with
    transactions sets `slow_delete_seconds`: such a delete, read again, lands on `.errors`."""
    proc = make(tmp_path, persistence="memory", partitions=1)
    run(proc, [InputMessage("orders", 0, i, None, orjson.dumps({"id": i}), [], 1_000) for i in range(3)])
    proc.engine.slow_delete_seconds = 0.0  # every delete outlasts it
    delete = InputMessage("orders", 0, 3, None, None, [("sow-command", b"sow_delete"), ("sow-filter", b"/id = 1")], 2_000)
    assert [r.topic for r in proc.handle([delete], now=5_000)] == ["orders.sow", "orders.diff"]
    for store in proc.stores.values():
        store.rollback()  # the transaction was aborted: nothing it staged stays
    (err,) = proc.handle([delete], now=6_000)
    assert err.topic == "orders.errors" and b"took longer than the transaction timeout" in hdr(err, "sow-error")
    other = InputMessage("orders", 0, 4, None, None, [("sow-command", b"sow_delete"), ("sow-filter", b"/id = 2")], 2_000)
    assert [r.topic for r in proc.handle([other], now=6_000)] == ["orders.sow", "orders.diff"]


def test_a_delete_by_filter_has_one_budget_for_all_the_partitions_of_a_worker(tmp_path, monkeypatch):
    """Review: the filter budget (KSOW_DELETE_FILTER_SECONDS) was per partition, so one delete held a
    worker that owns P partitions up to P times the budget without a consume(): past the consumer's
    max.poll.interval.ms (600 s: 20 partitions at 30 s) librdkafka took the worker out of its group
    mid-delete, the checkpoint failed, and the delete, read again, was refused half done. The
    partitions of one input now share one budget (here: each partition's records take 0.1 s to test,
    all four 0.4 s, the budget is 0.25 s)."""
    from processor.engine import partition

    proc = make(tmp_path, persistence="memory")
    records, per = [], [0] * N
    i = 0
    while min(per) < 5:
        record = {"id": i, "desk": "fx"}
        p = msg(proc, record).partition
        if per[p] < 5:
            per[p] += 1
            records.append(record)
        i += 1
    run(proc, [msg(proc, r) for r in records])

    class Slow:
        def __init__(self, inner):
            self.inner = inner

        def equality_terms(self):
            return self.inner.equality_terms()

        def literal_terms(self):
            return self.inner.literal_terms()

        def matches(self, record):
            time.sleep(0.02)
            return self.inner.matches(record)

    compile_filter = partition.compile_filter
    monkeypatch.setattr(partition, "compile_filter", lambda text: Slow(compile_filter(text)))
    monkeypatch.setenv("KSOW_DELETE_FILTER_SECONDS", "0.25")
    out = run(proc, [InputMessage("orders", 0, 99, None, None, [("sow-command", b"sow_delete"), ("sow-filter", b"/desk = 'fx'")], 2_000)])
    (err,) = [r for r in out if r.topic == "orders.errors"]
    deleted = [r for r in out if r.topic == "orders.sow"]
    assert f"; {len(deleted)} records it matched were deleted" in hdr(err, "sow-error").decode()
    assert 0 < len(deleted) < 4 * 5


def test_a_holds_record_not_written_by_a_worker_is_skipped_not_a_crash(tmp_path):
    """`<topic>.holds` is a plain Kafka topic: a record there that is not a held view event (not
    JSON, another shape, a key that is not text) stopped every worker that took the partition (its
    restore raised). It is skipped; the records a worker wrote are still taken back."""
    topology = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1}],
                               "views": [{"name": "eu_conf", "topic": "orders", "filter": "/r = 'EU'", "conflation": "2s"}]})
    proc = LocalTopic(topology.topic("orders"), tmp_path, views=topology.views_of("orders"))
    out = by_topic(run(proc, [msg(proc, {"id": 1, "r": "EU"}, ts=1_000, partition=0)], now=1_000))
    (good,) = out["orders.holds"]
    (view,) = proc.engine.views
    view.forget(0)
    for key, value in [(b"0|k", b"not json"), (b"0|k", b"[]"), (b"0|k", b'{"due": "soon", "event": {}, "headers": []}'),
                       (b"0|k", b'{"due": 1, "event": {"op": "insert", "record": 5}, "headers": []}'),
                       (b"0|k", b'{"due": 1, "event": {"op": "insert", "record": {}}, "headers": [["sow-op", 3]]}'),
                       (None, b"{}"), (b"\xff\xfe", b"{}"), (b"0|", b"{}")]:
        view.restore_hold(0, key, value)
    view.restore_hold(0, good.key, good.value)
    assert list(view.pending[0]) == [good.key.decode()[2:]]
    released: list = []
    proc.engine.release_views(0, 10_000, released)
    assert [(o.topic, hdr(o, "sow-op")) for o in released if o.topic == "eu_conf.diff"] == [("eu_conf.diff", b"insert")]


def test_a_view_that_fails_on_a_record_leaves_the_store_as_sow_tells_it(tmp_path, monkeypatch):
    """Review: a write put its record on `.sow` (a worker's buffer produces at once), then told the
    views, then stored it: a view that raised left the input on `.errors` as an internal error and
    `.sow` ahead of the store, which queries read. The store now holds the record first."""
    topology = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1}],
                               "views": [{"name": "eu", "topic": "orders", "filter": "/r = 'EU'"}]})
    proc = LocalTopic(topology.topic("orders"), tmp_path, views=topology.views_of("orders"))
    (view,) = proc.engine.views

    def broken(p, t, out):
        raise RuntimeError("view failed")

    monkeypatch.setattr(view, "on_change", broken)
    out = by_topic(run(proc, [msg(proc, {"id": 1, "r": "EU"}, partition=0)]))
    assert [orjson.loads(o.value) for o in out["orders.sow"]] == [{"id": 1, "r": "EU"}]
    assert b"internal error: RuntimeError: view failed" in hdr(out["orders.errors"][0], "sow-error")
    assert [rec.data for store in proc.stores.values() for _, rec in store.records()] == [{"id": 1, "r": "EU"}]


def test_a_capacity_set_on_a_topic_that_holds_records_evicts_them(tmp_path):
    """A persistent partition that held 5 records before `capacity: 2` was set is brought down to
    its share by the next new record, oldest first (it evicted none and kept 6)."""
    def one_partition(**extra):
        return LocalTopic(parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1, **extra}]}).topic("orders"), tmp_path)

    proc = one_partition()
    proc.handle([InputMessage("orders", 0, i, None, orjson.dumps({"id": i}), None, 1_000 + i) for i in range(5)], 1_010)
    proc.commit()
    proc.close()
    proc = one_partition(capacity=2)
    out = proc.handle([InputMessage("orders", 0, 9, None, orjson.dumps({"id": 9}), None, 2_000)], 2_000)
    proc.commit()
    assert [orjson.loads(o.value)["id"] for o in by_topic(out)["orders.dead"]] == [0, 1, 2, 3]
    assert proc.stores[0].count() == 2
    proc.close()


def test_an_event_id_read_back_from_diff_moves_the_counter_on_and_a_malformed_one_is_passed_over(tmp_path):
    """A transient partition's next owner takes the last `.diff` events' IDs (resume_events)."""
    engine = SowTopicEngine(parse_topology({"sow": [{"topic": "t", "key": ["/id"], "partitions": 1, "persistence": "transient"}]}).topic("t"))
    store = open_partition_store("memory", None, engine.indexes)
    for headers in ([("sow-seq", b"x")], [("sow-seq", b"%d" % (1 << 62))], [("sow-seq", b"-5")], [("sow-op", b"insert")], None):
        engine.resume_events(store, headers)
    assert store.counter() == 0
    engine.resume_events(store, [("sow-key", b"k"), ("sow-seq", b"%d" % (7_000 << 10))])
    engine.resume_events(store, [("sow-seq", b"%d" % (5_000 << 10))])  # an earlier one does not move it back
    assert store.counter() == 7_000
