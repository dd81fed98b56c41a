"""One partition engine, every state: the same history gives the same SOW and the same output events
over the worker's memory store, its RocksDB store and the reference fold's dicts.

This is the fast form of the cross-engine conformance suite: the SOW rules live once in
processor.engine.partition, so what can differ between engines is only their state adapter and their
routing, and that is what this property checks (Hypothesis histories of publishes, nested deltas,
deletes by data, by SowKeys and by filter, lifetimes, capacity and rejected inputs)."""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from processor.contract import headers as H
from processor.contract.types import InputMessage
from processor.core.keys import owner_partition
from processor.engine.fold import SowFold
from processor.engine.outputs import Streams, render, sink
from processor.testing import LocalTopic
from processor.topology import parse_topology

N = 3
T0 = 1_000_000


def spec_for(expiration, capacity: int, policy: str):
    entry = {"topic": "t", "key": ["/id"], "partitions": N, "expiration": expiration, "capacity": capacity, "capacity_policy": policy}
    return parse_topology({"sow": [entry]}).sow[0]


ids = st.integers(1, 12)
fields = st.fixed_dictionaries({}, optional={"a": st.integers(0, 3), "s": st.sampled_from(["x", "y"]), "n": st.fixed_dictionaries({}, optional={"p": st.integers(0, 2), "q": st.integers(0, 2)})})
publish = st.tuples(st.just("publish"), ids, fields, st.sampled_from([None, "0", "5ms", "40ms"]))
delta = st.tuples(st.just("delta"), ids, fields, st.sampled_from([None, "20ms"]))
delete_data = st.tuples(st.just("delete"), ids)
delete_filter = st.tuples(st.just("filter"), st.sampled_from(["/a = 1", "/s = 'x'", "/n/p >= 1", "1=1"]))
delete_keys = st.tuples(st.just("keys"), st.lists(ids, min_size=1, max_size=3))
broken = st.tuples(st.just("broken"), st.sampled_from([b"{oops", b'{"no_id": 1}', b"[1]"]))
step = st.one_of(publish, publish, delta, delta, delete_data, delete_filter, delete_keys, broken)


def to_messages(spec, steps) -> list[InputMessage]:
    out = []
    for n, s in enumerate(steps):
        ts = T0 + n * 7
        kind = s[0]
        headers: list = []
        if kind in ("publish", "delta"):
            _, i, data, life = s
            value = orjson.dumps({"id": i, **data})
            if life is not None:
                headers.append((H.EXPIRATION, life.encode()))
            topic = spec.delta_topic if kind == "delta" else spec.topic
        elif kind == "delete":
            topic, value, headers = spec.topic, orjson.dumps({"id": s[1]}), [(H.COMMAND, b"sow_delete")]
        elif kind == "filter":
            topic, value, headers = spec.topic, None, [(H.COMMAND, b"sow_delete"), (H.FILTER, s[1].encode())]
        elif kind == "keys":
            keys = ",".join(spec.key_spec.sow_key({"id": i}) for i in s[1])
            topic, value, headers = spec.topic, None, [(H.COMMAND, b"sow_delete"), (H.KEYS, keys.encode())]
        else:
            topic, value = spec.topic, s[1]
        try:
            p = owner_partition(spec.key_spec.sow_key(orjson.loads(value)), N) if kind in ("publish", "delta", "delete") else 0
        except Exception:  # noqa: BLE001 - broken inputs arrive anywhere
            p = 0
        out.append(InputMessage(topic, p, n, None, value, headers, ts))
    return out


def events_of(outputs, streams: Streams) -> tuple[dict, int]:
    """Per SowKey, the (topic, op, value, expires-at) sequence; and the number of `.errors` records."""
    per_key: dict = defaultdict(list)
    errors = 0
    for o in outputs:
        if o.topic == streams.errors:
            errors += 1
            continue
        hs = dict(o.headers)
        per_key[o.key].append((o.topic, hs[H.OP], o.value, hs.get(H.EXPIRES_AT)))
    return dict(per_key), errors


def run_local(spec, messages, data_dir: Path | None):
    """The worker's way: one input at a time (now = its timestamp, due records expired first);
    what an input reroutes through `.repartition` comes back and applies at once."""
    local = LocalTopic(spec, data_dir)
    for p in range(N):
        local.open(p)
    outputs = []
    for msg in messages:
        for p in range(N):
            outputs += local.expire_due(p, msg.timestamp)
        pending = [msg]
        while pending:
            produced = local.handle(pending, now=msg.timestamp)
            local.commit()
            pending = [InputMessage(o.topic, o.partition, 0, o.key, o.value, o.headers, o.timestamp) for o in produced if o.topic == spec.repartition_topic]
            outputs += [o for o in produced if o.topic != spec.repartition_topic]
    final = {k: (r.data, r.expires_at) for store in local.stores.values() for k, r in store.records()}
    local.close()
    return final, events_of(outputs, Streams.of(spec))


def run_fold(spec, messages):
    fold = SowFold(spec, transitions=True)
    streams = Streams.of(spec)
    outputs: list = []
    for msg in messages:
        for t in fold.apply(msg):
            render(t, 0, fold.codec, streams, sink(outputs))
    final = {k: (r.data, r.expires_at) for k, r in fold.records.items()}
    return final, events_of(outputs, streams)[0], fold.rejected


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(step, min_size=1, max_size=40),
    st.sampled_from([None, "enabled", "30ms"]),
    st.sampled_from([(0, "evict_oldest"), (6, "evict_oldest"), (6, "reject")]),
)
def test_one_engine_over_every_state_gives_the_same_sow_and_events(steps, expiration, capacity):
    spec = spec_for(expiration, *capacity)
    messages = to_messages(spec, steps)
    memory_sow, (memory_events, memory_errors) = run_local(spec, messages, None)
    with tempfile.TemporaryDirectory() as tmp:
        rocks_sow, (rocks_events, rocks_errors) = run_local(spec, messages, Path(tmp))
    fold_sow, fold_events, fold_rejected = run_fold(spec, messages)
    assert memory_sow == rocks_sow == fold_sow
    assert memory_events == rocks_events == fold_events
    assert memory_errors == rocks_errors == fold_rejected
