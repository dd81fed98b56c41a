"""Filters that name every key field: the SowKeys they can match are computed, not searched
(processor.state.base.choose_keys), and no record they match is missed."""

import pytest
from hypothesis import given, settings, strategies as st

from processor.contract.types import SowRecord
from processor.core.filters import compile_filter, key_texts_equal_to, odd_key_spelling
from processor.core.keys import KeySpec, checksum_key
from processor.query.engine import SowQuery, run_query
from processor.state import IndexSpec, open_partition_store
from processor.core.keyplan import choose_keys

SPEC = KeySpec("orders", ("/id",))
PAIR = KeySpec("fills", ("/desk", "/n"))

# Values a key field may hold, spelled every way a filter's `=` reads alike: numbers as numbers and
# as odd strings ('05', '5.0', '5e0'), booleans as booleans and in any case.
_SPELLED = st.sampled_from(["5", "05", "5.0", "5e0", "-0", "0", "0.5", ".5", "1e3", "1000", "true", "TRUE", "False", "x", "5x", " 5"])
_VALUES = st.one_of(st.integers(-10, 1000), st.sampled_from([5.0, 0.5, -0.0, 1e3, 2**60, 2.0**60]), st.booleans(), _SPELLED)


def _literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    return repr(value)


@settings(max_examples=600, deadline=None)
@given(_VALUES, _VALUES)
def test_no_record_a_key_filter_matches_is_missed(value, literal):
    """Whenever `/id = literal` matches a record, that record's SowKey is among the keys the filter
    names: always for a string literal, and for a number or boolean while the store holds no odd
    spelling (a store that holds `value` holds one when `value` is odd)."""
    predicate = compile_filter(f"/id = {_literal(literal)}")
    plain = not odd_key_spelling(value)
    keys = choose_keys(predicate, SPEC, plain)
    if keys is None:
        assert not plain and not isinstance(literal, str)
    elif predicate.matches({"id": value}):
        assert SPEC.sow_key({"id": value}) in keys


def test_literal_texts():
    assert key_texts_equal_to("IBM") == (frozenset({"IBM"}), False)
    assert key_texts_equal_to("05") == (frozenset({"05", "5"}), False)  # 5 = '05' (a number), '5' <> '05' (strings)
    assert key_texts_equal_to("TRUE") == (frozenset({"TRUE", "true"}), False)
    assert key_texts_equal_to(5.0) == (frozenset({"5"}), True)
    assert key_texts_equal_to(2**60) == (frozenset({"1152921504606846976", "1.152921504606847e+18"}), True)
    assert key_texts_equal_to(None) == (frozenset(), False)
    assert [v for v in ("5", "05", "5.0", "TRUE", "true", "x", 5, True) if odd_key_spelling(v)] == ["05", "5.0", "TRUE"]


def test_every_key_field_must_be_named():
    assert choose_keys(compile_filter("/desk = 'a'"), PAIR, True) is None
    assert choose_keys(compile_filter("/desk = 'a' OR /n = 1"), PAIR, True) is None
    assert choose_keys(compile_filter("/desk = 'a' AND /n > 1"), PAIR, True) is None
    assert choose_keys(compile_filter("/id = 'a'"), KeySpec("t"), True) is None  # publisher-supplied keys
    keys = choose_keys(compile_filter("/n IN (1, 2) AND /desk IN ('a', 'b') AND /qty > 3"), PAIR, True)
    assert sorted(keys) == sorted(checksum_key("fills", [d, n]) for d in "ab" for n in (1, 2))
    assert choose_keys(compile_filter("/n IN (1, 2) AND /desk = 'a'"), PAIR, False) is None  # numbers, odd spellings possible
    assert choose_keys(compile_filter(f"/desk = 'a' AND /n IN ({', '.join(map(str, range(5000)))})"), PAIR, True) is None  # past MAX_INDEX_LOOKUPS


@pytest.fixture(params=["rocksdb", "memory"])
def store_of(request, tmp_path):
    opened = []

    def open_(name: str, keys: KeySpec | None = SPEC):
        store = open_partition_store(request.param, str(tmp_path / name), IndexSpec(keys=keys))
        opened.append(store)
        return store

    yield open_
    for store in opened:
        store.close()


def _put(store, *values):
    for i, value in enumerate(values):
        store.stage(SPEC.sow_key({"id": value}), SowRecord({"id": value, "qty": i}, i + 1))
    store.commit()


def test_a_query_naming_the_key_reads_only_its_records(store_of):
    store = store_of("p0")
    _put(store, *range(100), "IBM")
    assert store.plain_key_spelling()
    for text, found in (("/id = 7", [7]), ("/id = '7'", [7]), ("/id IN (7, 8.0) AND /qty < 8", [7]), ("/id = 'IBM'", ["IBM"]), ("/id = 1000", [])):
        rows, plan = run_query([store], SowQuery(text), (), key_spec=SPEC)
        assert [r["record"]["id"] for r in rows] == found and plan.by_key == 1 and plan.candidates == len(set(found) | ({8} if "IN" in text else set()))
    rows, plan = run_query([store], SowQuery("/id > 97"), (), key_spec=SPEC)
    assert plan.by_key == 0 and plan.candidates == 101 and sorted(r["record"]["id"] for r in rows if r["record"]["id"] != "IBM") == [98, 99]


def test_an_odd_spelling_keeps_number_literals_off_the_keys(store_of):
    store = store_of("p0")
    _put(store, 5, 6)
    assert store.plain_key_spelling()
    _put(store, "05")  # its own SowKey, and `/id = 5` matches it
    assert not store.plain_key_spelling()
    rows, plan = run_query([store], SowQuery("/id = 5"), (), key_spec=SPEC)
    assert plan.by_key == 0 and sorted(map(str, (r["record"]["id"] for r in rows))) == ["05", "5"]
    rows, plan = run_query([store], SowQuery("/id = '05'"), (), key_spec=SPEC)  # a string literal stays whole
    assert plan.by_key == 1 and sorted(map(str, (r["record"]["id"] for r in rows))) == ["05", "5"]
    # Removing the odd record does not make the store plain again (a removal does not read the data).
    store.stage(SPEC.sow_key({"id": "05"}), None)
    store.commit()
    assert not store.plain_key_spelling()


@pytest.mark.parametrize("values, plain, found", [((5, 6.0, "TRUE!"), True, ["5"]), ((5, "05"), False, ["05", "5"])])
def test_a_store_written_before_the_mark_is_checked_when_opened(tmp_path, values, plain, found):
    """A RocksDB store (a memory store does not outlive its process) written without the key fields,
    as a release before the mark wrote it: opened with them, it is checked whole."""
    old = open_partition_store("rocksdb", str(tmp_path / "p0"), IndexSpec())
    _put(old, *values)
    old.close()
    store = open_partition_store("rocksdb", str(tmp_path / "p0"), IndexSpec(keys=SPEC))
    try:
        assert store.plain_key_spelling() is plain
        rows, plan = run_query([store], SowQuery("/id = 5"), (), key_spec=SPEC)
        assert plan.by_key == plain and sorted(map(str, (r["record"]["id"] for r in rows))) == found
    finally:
        store.close()


def test_an_emptied_store_is_checked_again_from_its_next_commit(store_of):
    store = store_of("p0")
    _put(store, "05")
    assert not store.plain_key_spelling()
    store.backend.clear()  # as a worker that rebuilds a store from its changelog
    _put(store, 5)
    assert store.plain_key_spelling()


def test_partitions_each_read_the_named_keys(store_of):
    stores = [store_of("p0"), store_of("p1")]
    _put(stores[0], 1, 3)
    _put(stores[1], 2, "4x")
    rows, plan = run_query(stores, SowQuery("/id IN (1, 2, '4x', 9)"), (), key_spec=SPEC)
    assert plan.by_key == 2 and plan.candidates == 3 and sorted(map(str, (r["record"]["id"] for r in rows))) == ["1", "2", "4x"]


def test_a_delete_by_filter_reads_only_the_named_records(store_of):
    store = store_of("p0")
    _put(store, *range(50))
    store.records = None  # a scan would call it
    assert list(store.matching(compile_filter("/id IN (3, 4) AND /qty = 3"))) == [SPEC.sow_key({"id": 3})]
    store.stage(SPEC.sow_key({"id": 60}), SowRecord({"id": 60, "qty": 3}, 99))  # staged: seen too
    assert sorted(store.matching(compile_filter("/id IN (3, 60) AND /qty = 3"))) == sorted(SPEC.sow_key({"id": i}) for i in (3, 60))


def test_the_client_asks_only_the_workers_of_the_partitions_a_query_names(monkeypatch):
    """With SowKeys named in every partition (a string literal on the key field, or the query's
    keys), the client asks the workers that own them; a number literal may match other spellings
    anywhere, so it asks them all. A query that names no SowKey asks nobody."""
    from processor.client import sow_client
    from processor.client.sow_client import Client
    from processor.core.keys import owner_partition
    from processor.topology import parse_topology

    topology = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 4}]})
    spec = topology.topic("orders").key_spec
    asked: list[int] = []

    def answer(url, token, tls, timeout, body):
        p = int(url.split("/")[2][1:])
        asked.append(p)
        return {"partitions": [p], "results": []}

    client = Client("127.0.0.1:1", topology)
    monkeypatch.setattr(sow_client, "_http_json", answer)
    monkeypatch.setattr(client, "_workers", lambda fresh=False: [{"url": f"http://w{p}", "topics": {"orders": [p]}} for p in range(4)])
    owners = sorted({owner_partition(spec.sow_key({"id": i}), 4) for i in ("A-7", "B-9")})
    assert client.query("orders", filter="/id IN ('A-7', 'B-9') AND /qty > 0") == [] and client.last_query_source == "workers"
    assert sorted(asked) == owners and len(owners) < 4
    asked.clear()
    client.query("orders", keys=[spec.sow_key({"id": "A-7"})])
    assert asked == [owner_partition(spec.sow_key({"id": "A-7"}), 4)]
    asked.clear()
    client.query("orders", filter="/id = 7")
    assert sorted(asked) == [0, 1, 2, 3]
    asked.clear()
    assert client.query("orders", filter="/id = NULL") == [] and asked == []
