"""No input stops the engine: arbitrary bytes as values, keys and header values (the contract's
headers and the workers' own `ksow-*` ones, on every input topic) are applied or refused onto
`.errors`; the engine never raises, and what it then holds reads back."""

from __future__ import annotations

import json
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from processor.contract import headers as H
from processor.contract.types import InputMessage
from processor.testing import LocalTopic
from processor.topology import parse_topology

N = 2
T0 = 1_700_000_000_000

SPEC = parse_topology({"sow": [{"topic": "t", "key": ["/id", "/k/v"], "partitions": N, "expiration": "enabled", "capacity": 5,
                                "hash_indexes": [["/s"]]}]}).sow[0]

def _json(v) -> bytes:
    return json.dumps(v).encode()  # numbers past 64 bits, Infinity: as a publisher in another language may send


odd_text = st.sampled_from(["", " ", "0", "-1", "1e309", "nan", "inf", "9" * 40, "1.5", "10ms", "-5s", "P1D", "never", "\u0000",
                            "\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"), "/id = 1", "/id = ", "((", "t:0:1",
                            "[1]", "[\"a\",{\"v\":1}]", ",", "a,b,,", "sow_delete", "delta_publish", "publish", "DELETE"])
header_value = st.one_of(st.none(), odd_text.map(str.encode), st.binary(max_size=40))  # Kafka headers may have no value
header_name = st.sampled_from(sorted(H.KNOWN_INPUT | H.INTERNAL) + ["sow-other", ""])
headers = st.lists(st.tuples(header_name, header_value), max_size=5)
scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False), st.text(max_size=8))
json_value = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(["v", "s", "id", "k"]), inner, max_size=3)),
                          max_leaves=8)
record = st.fixed_dictionaries({}, optional={"id": json_value, "k": json_value, "s": json_value, "x": json_value})
value = st.one_of(st.none(), st.binary(max_size=60), record.map(_json), json_value.map(_json))
message = st.tuples(st.sampled_from([SPEC.topic, SPEC.delta_topic, SPEC.repartition_topic]), st.integers(0, N - 1),
                    st.one_of(st.none(), st.binary(max_size=12)), value, headers, st.integers(-5, 5))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(message, min_size=1, max_size=25))
def test_any_input_is_applied_or_refused_and_never_stops_the_engine(messages):
    local = LocalTopic(SPEC)
    for p in range(N):
        local.open(p)
    for n, (topic, p, key, raw, hs, skew) in enumerate(messages):
        now = T0 + n * 1000
        msg = InputMessage(topic, p, n, key, raw, hs, now + skew * 10_000)
        for q in range(N):
            local.expire_due(q, now)
        pending = [msg]
        for _ in range(3):  # what it reroutes comes back through `.repartition`
            out = local.handle(pending, now=now)
            local.commit()
            pending = [InputMessage(o.topic, o.partition, 0, o.key, o.value, o.headers, o.timestamp) for o in out if o.topic == SPEC.repartition_topic]
            for o in out:
                if o.topic == SPEC.errors_topic:
                    assert dict(o.headers)[H.ERROR]  # the reason
            if not pending:
                break
    for store in local.stores.values():
        for key, rec in store.records():
            assert isinstance(key, str) and isinstance(rec.data, dict)
            assert store.get(key) == rec
    local.close()
