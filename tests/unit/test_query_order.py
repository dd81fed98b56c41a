"""A query's order is the same whichever path answers it (processor.core.sortorder).

The same records go through every path's code: a worker's query engine (run_query over its
partitions), the client's merge of several workers' answers, the client's read of `<topic>.sow`
(changelog fallback) and the merge of a topic pattern's topics. Ties (equal values, values that
compare equal across types, missing and null fields) and `top` without `order_by` used to follow
each path's reading order: which records `top` kept depended on the path and the worker count."""

from __future__ import annotations

import random

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from processor.client import sow_client
from processor.client.sow_client import Client
from processor.contract.types import SowRecord
from processor.core.sortorder import order_value
from processor.query.engine import SowQuery, run_query
from processor.state import IndexSpec, open_partition_store
from processor.topology import Topology

TOPOLOGY = Topology.model_validate({"sow": [{"topic": f"o.{name}", "key": ["/id"], "partitions": 3} for name in ("a", "b")]})
MISSING_FIELD = object()


class _Consumer:
    def close(self):
        pass


def _stores(records: dict[str, dict], split: int, rng: random.Random) -> list:
    """The records over `split` memory stores (partitions), each filled in a shuffled order."""
    stores = [open_partition_store("memory", None, IndexSpec(())) for _ in range(split)]
    items = list(records.items())
    rng.shuffle(items)
    for i, (key, record) in enumerate(items):
        stores[i % split].stage(key, SowRecord(record, i + 1))
    for store in stores:
        store.commit()
    return stores


def every_path(records: dict[str, dict], query: SowQuery, monkeypatch, seed: int = 0) -> dict[str, list]:
    """The SowKeys each path answers `query` with, over the same records; the pattern's as
    (SowKey, topic), o.a and o.b holding the same records."""
    rng = random.Random(seed)
    engine = [row["sow_key"] for row in run_query(_stores(records, 1, rng), query, ())[0]]
    partitions = _stores(records, 3, rng)  # one worker a partition, answering in any order

    def answer(url, token, tls, timeout, body):
        asked, p = SowQuery.from_params(orjson.loads(body)), int(url.split("/")[2][1:])
        return {"partitions": [p], "results": run_query([partitions[p]], asked, ())[0]}

    client = Client("127.0.0.1:1", TOPOLOGY)
    monkeypatch.setattr(sow_client, "_http_json", answer)
    workers = [{"url": f"http://w{p}", "topics": {"o.a": [p], "o.b": [p]}} for p in (2, 0, 1)]
    monkeypatch.setattr(client, "_workers", lambda fresh=False: workers)
    options = dict(filter=query.filter, top=query.top, order_by=query.order_by)
    merged = [entry.sow_key for entry in client.query("o.a", **options)]
    assert client.last_query_source == "workers"
    pattern = [(entry.sow_key, entry.topic) for entry in client.query("o[.].*", **options)]

    items = list(records.items())
    rng.shuffle(items)
    state = {key: (record, i + 1, None) for i, (key, record) in enumerate(items)}
    monkeypatch.setattr(client, "_workers", lambda fresh=False: [])
    monkeypatch.setattr(client, "_snapshot", lambda spec: (state, {}, _Consumer(), [], None))
    changelog = [entry.sow_key for entry in client.query("o.a", **options)]
    assert client.last_query_source == "changelog"
    return {"engine": engine, "merge": merged, "changelog": changelog, "pattern": pattern}


def _doubled(keys: list[str], top: int | None) -> list[tuple[str, str]]:
    """What the pattern over o.a and o.b answers when each answers `keys` (in the full order)."""
    both = [(key, topic) for key in keys for topic in ("o.a", "o.b")]
    return both if top is None else both[:top]


# Values that tie (3, 3.0, "3", "3.00"; null and missing), one of each other type, and SowKeys
# whose order is neither the order of the values nor the order the records are read in.
VALUES = {"k5": 3, "k2": "3", "k9": 3.0, "k1": "3.00", "k7": None, "k3": MISSING_FIELD, "k8": "b", "k0": "",
          "k6": True, "k4": False, "k11": [1], "k10": {"x": 1}, "k12": 2, "k13": MISSING_FIELD}
RECORDS = {key: {"id": i} if v is MISSING_FIELD else {"id": i, "v": v} for i, (key, v) in enumerate(VALUES.items())}
ASCENDING = ["k12", "k1", "k2", "k5", "k9", "k0", "k8", "k4", "k6", "k11", "k10", "k13", "k3", "k7"]
DESCENDING = ["k10", "k11", "k6", "k4", "k8", "k0", "k1", "k2", "k5", "k9", "k12", "k13", "k3", "k7"]


@pytest.mark.parametrize(("order_by", "top", "expected"), [
    ("/v", None, ASCENDING),
    ("/v", 4, ASCENDING[:4]),
    ("/v", 13, ASCENDING[:13]),
    ("/v DESC", None, DESCENDING),
    ("/v DESC", 8, DESCENDING[:8]),
    (None, None, sorted(VALUES)),
    (None, 5, sorted(VALUES)[:5]),
])
def test_every_path_gives_one_total_order(order_by, top, expected, monkeypatch):
    """Ties come in SowKey order in either direction (a pattern's, then by topic); numbers (and
    strings spelling one) before strings, booleans, lists and objects; null and missing last;
    without order_by, SowKey order. Every path's answer is the same."""
    for seed in range(3):
        answers = every_path(RECORDS, SowQuery(top=top, order_by=order_by), monkeypatch, seed)
        assert answers.pop("pattern") == _doubled(expected, None if top is None else top)
        assert answers == {"engine": expected, "merge": expected, "changelog": expected}, seed


def test_order_value_ranks_types_and_null():
    assert order_value(None) is None
    assert order_value(3) == order_value("3") == order_value(3.0) == order_value("3.00")
    ranks = [order_value(v)[0] for v in (-1, "-1e3", "x", False, [0], {})]
    assert ranks == sorted(ranks) and len(set(ranks)) == 5
    assert order_value({"a": 1, "b": 2}) == order_value({"b": 2, "a": 1})  # an object's text has its keys sorted


_VALUE = st.one_of(
    st.none(), st.just(MISSING_FIELD), st.booleans(), st.integers(-3, 3), st.sampled_from([1.5, -0.0, 2.0, 3.0]),
    st.sampled_from(["3", "1.50", "-0", "a", "B", "", "1e0"]), st.lists(st.integers(0, 2), max_size=2),
    st.dictionaries(st.sampled_from(["x", "y"]), st.integers(0, 1), max_size=2),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(values=st.lists(_VALUE, min_size=0, max_size=12), keys=st.randoms(use_true_random=False),
       top=st.one_of(st.none(), st.integers(0, 14)), order_by=st.sampled_from([None, "/v", "/v DESC", "/w/v"]),
       seed=st.integers(0, 1000))
def test_every_path_agrees_on_any_records(values, keys, top, order_by, seed):
    """Any records, any split over partitions and workers, any reading order: one answer."""
    names = [f"k{keys.randrange(100)}-{i}" for i in range(len(values))]
    records = {name: ({"id": i} if v is MISSING_FIELD else {"id": i, "v": v, "w": {"v": v}}) for i, (name, v) in enumerate(zip(names, values))}
    query = SowQuery(top=top, order_by=order_by)
    with pytest.MonkeyPatch.context() as monkeypatch:
        answers = every_path(records, query, monkeypatch, seed)
    engine = answers["engine"]
    assert answers["merge"] == answers["changelog"] == engine
    full = [row["sow_key"] for row in run_query(_stores(records, 2, random.Random(seed)), SowQuery(order_by=order_by), ())[0]]
    assert engine == (full if top is None else full[:top])
    assert answers["pattern"] == _doubled(full, top)
