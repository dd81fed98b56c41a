"""SOW queries on real stores: index choice, filters, keys, select, order and top."""

import pytest

from processor.contract.errors import KsowError
from processor.contract.types import SowRecord
from processor.core.filters import compile_filter
from processor.contract.errors import ConfigError
from processor.contract.limits import check_environment, query_share
from processor.query.engine import QueryLimitError, QueryLimits, QueryPacer, SowQuery, choose_index, order_and_cut, run_query
from processor.state import IndexSpec, open_partition_store

INDEXES = (("/status",), ("/region", "/desk"))


@pytest.fixture(params=["rocksdb", "memory"])
def stores(request, tmp_path):
    out = []
    for p in range(2):
        s = open_partition_store(request.param, str(tmp_path / f"p{p}"), IndexSpec(INDEXES))
        for i in range(p, 40, 2):
            s.stage(f"k{i:02d}", SowRecord({"id": i, "status": ["open", "done"][i % 3 == 0], "region": ["EU", "US"][i % 2], "desk": i % 4, "qty": i * 10}, i))
        s.commit()
        out.append(s)
    yield out
    for s in out:
        s.close()


def ids(rows):
    return sorted(r["record"]["id"] for r in rows)


def test_indexed_equality_reads_only_candidates(stores):
    rows, plan = run_query(stores, SowQuery("/status = 'done' AND /qty > 100"), INDEXES)
    assert plan.index == 0
    assert ids(rows) == [i for i in range(40) if i % 3 == 0 and i * 10 > 100]
    assert plan.candidates == len([i for i in range(40) if i % 3 == 0])


def test_composite_index_with_in(stores):
    rows, plan = run_query(stores, SowQuery("/region = 'EU' AND /desk IN (0, 2)"), INDEXES)
    assert plan.index == 1 and ids(rows) == [i for i in range(0, 40, 2)]


def test_scan_when_no_index_covers(stores):
    rows, plan = run_query(stores, SowQuery("/qty >= 350 OR /id = 1"), INDEXES)
    assert plan.index is None and plan.candidates == 40
    assert ids(rows) == [1, 35, 36, 37, 38, 39]


def test_keys_select_order_top(stores):
    rows, _ = run_query(stores, SowQuery(keys=("k03", "k04", "nope")), INDEXES)
    assert ids(rows) == [3, 4]
    rows, _ = run_query(stores, SowQuery("/region = 'US'", select=("/qty",), top=3, order_by="/qty DESC"), INDEXES)
    assert [r["record"] for r in rows] == [{"qty": 390}, {"qty": 370}, {"qty": 350}]
    rows, _ = run_query(stores, SowQuery(top=2, order_by="/qty"), INDEXES)
    assert ids(rows) == [0, 1]


def test_keys_named_twice_are_one_key(stores):
    """Keys are a set of SowKeys: a key named twice came back as two rows, which also took two of
    `top`'s places (k03 twice with top 2 left k04 out, and the client, which keeps one row a key,
    answered with one record)."""
    rows, _ = run_query(stores, SowQuery(keys=("k03", "k03", "k04")), INDEXES)
    assert sorted(r["sow_key"] for r in rows) == ["k03", "k04"]
    rows, _ = run_query(stores, SowQuery(keys=("k03", "k03", "k04"), top=2), INDEXES)
    assert ids(rows) == [3, 4]
    assert SowQuery.from_params({"keys": "k03,k04,k03"}).keys == ("k03", "k04")


def test_choose_index_needs_all_fields():
    assert choose_index(compile_filter("/region = 'EU'"), INDEXES) is None
    no, values = choose_index(compile_filter("/region IN ('EU','US') AND /desk = 1"), INDEXES)
    assert no == 1 and sorted(values) == [("EU", 1), ("US", 1)]
    assert choose_index(compile_filter("/status = 'a' OR /status = 'b'"), INDEXES) is None


def test_an_index_with_too_many_value_combinations_is_passed_over(stores):
    """Audit: `IN` lists of 4,000 values on both fields of an index made 16M lookups (a query ran
    129 s past its 10 s limit and took 1.1 GB; a delete by filter stalled its worker for good).
    Past MAX_INDEX_LOOKUPS combinations the filter scans, and finds the same records."""
    regions = ",".join(["'EU'", "'US'"] + [f"'r{i}'" for i in range(98)])
    desks = ",".join(str(i) for i in range(100))  # 100 x 100 = 10,000 combinations
    wide = compile_filter(f"/region IN ({regions}) AND /desk IN ({desks}) AND /qty < 100")
    assert choose_index(wide, INDEXES) is None
    rows, plan = run_query(stores, SowQuery(wide.text), INDEXES)
    assert plan.index is None and ids(rows) == list(range(10))
    assert sorted(stores[0].matching(wide)) == [f"k{i:02d}" for i in range(0, 10, 2)]  # a delete by filter's look-up
    narrow = compile_filter(f"/region IN ({regions}) AND /desk IN (0, 1)")  # 200 combinations: looked up
    assert choose_index(narrow, INDEXES)[0] == 1


def test_order_puts_missing_last_and_mixes_types():
    rows = [{"v": 2}, {}, {"v": "a"}, {"v": 1.5}]
    out = order_and_cut(rows, SowQuery(order_by="/v"), lambda r: r, repr)
    assert out == [{"v": 1.5}, {"v": 2}, {"v": "a"}, {}]


def test_a_string_that_spells_a_number_sorts_as_that_number_exactly():
    """As filters compare it: an Avro decimal's text sorted as text put 5.50 after 12.34, so `--top`
    on a money field returned the wrong rows."""
    values = ["100.00", "5.50", 3, "12.34", "-0.0001", "-3.0000", "abc", "12345678901234567890.000002", "12345678901234567890.000001"]
    out = order_and_cut([{"v": v} for v in values], SowQuery(order_by="/v DESC", top=4), lambda r: r, repr)
    assert [r["v"] for r in out] == ["abc", "12345678901234567890.000002", "12345678901234567890.000001", "100.00"]
    ascending = order_and_cut([{"v": v} for v in values], SowQuery(order_by="/v"), lambda r: r, repr)
    assert [r["v"] for r in ascending] == ["-3.0000", "-0.0001", 3, "5.50", "12.34", "100.00", "12345678901234567890.000001",
                                           "12345678901234567890.000002", "abc"]


def test_index_finds_values_of_any_spelling(tmp_path):
    store = open_partition_store("rocksdb", str(tmp_path / "x"), IndexSpec((("/n",),)))
    for key, n in (("a", 10), ("b", 10.0), ("c", "10"), ("d", [3, 10]), ("e", 11), ("f", None)):
        store.stage(key, SowRecord({"n": n}, 1))
    store.commit()
    rows, plan = run_query([store], SowQuery("/n = 10"), (("/n",),))
    assert plan.index == 0 and sorted(r["sow_key"] for r in rows) == ["a", "b", "c", "d"]
    rows, _ = run_query([store], SowQuery("/n = '10'"), (("/n",),))
    assert sorted(r["sow_key"] for r in rows) == ["a", "b", "c", "d"]
    store.close()


@pytest.mark.parametrize("query", [SowQuery("/qty >= 0"), SowQuery("/status = 'open'"), SowQuery()], ids=["scan", "index", "all"])
def test_a_query_over_its_row_limit_ends_with_413(stores, query):
    total = len(run_query(stores, query, INDEXES)[0])
    assert len(run_query(stores, query, INDEXES, limits=QueryLimits(max_rows=total))[0]) == total
    with pytest.raises(QueryLimitError, match=f"more than {total - 1} records") as err:
        run_query(stores, query, INDEXES, limits=QueryLimits(max_rows=total - 1))
    assert err.value.status == 413


def test_a_scan_stops_at_the_row_limit_as_it_goes(tmp_path):
    """The limit is checked while scanning, not after everything matched was collected."""
    store = open_partition_store("memory", None, IndexSpec())
    for i in range(50_000):
        store.stage(f"k{i}", SowRecord({"id": i}, i))
    store.commit()
    seen = []
    with pytest.raises(QueryLimitError):
        store.select(lambda data: True, None, 1024, lambda n: seen.append(n) or QueryLimits(max_rows=2000).start()(n))
    assert seen[-1] <= 2000 + 1024


def test_a_scan_over_its_time_limit_ends_with_503():
    store = open_partition_store("memory", None, IndexSpec())
    for i in range(10_000):
        store.stage(f"k{i}", SowRecord({"id": i}, i))
    store.commit()
    now = [0.0]
    read = []

    def slow(data):  # each record costs 10 ms of (fake) time
        now[0] += 0.01
        read.append(data)
        return False

    check = QueryLimits(max_seconds=2).start(clock=lambda: now[0])
    with pytest.raises(QueryLimitError, match="longer than 2s") as err:
        store.select(slow, None, 1024, check)
    assert err.value.status == 503 and len(read) == 1024  # stopped at the first check past 2 s


class _FakeTime:
    """A clock that moves only when something sleeps (or a test moves it), and a CPU clock."""

    def __init__(self):
        self.now = 0.0
        self.cpu = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_a_busy_loop_makes_queries_wait_their_share_on_one_schedule():
    t = _FakeTime()
    busy = [True]
    pacer = QueryPacer(0.25, lambda: busy[0], t.clock, t.sleep)
    assert pacer.pause(0.01) == pytest.approx(0.03)  # 10 ms of CPU, then 30 ms for the loop: a quarter
    # Two threads that end a turn at the same moment queue on one schedule: the second waits for
    # the first's rest too, so together they still take a quarter of the time.
    t.now = 1.0
    assert pacer.pause(0.01) == pytest.approx(0.03)
    t.now = 1.0
    assert pacer.pause(0.01) == pytest.approx(0.06)
    busy[0] = False  # an idle loop: no waiting at all
    assert pacer.pause(0.01) == 0.0
    assert QueryPacer(1, lambda: True, t.clock, t.sleep).pause(0.01) == 0.0  # the whole share: never waits


def _costly_records(t: _FakeTime, n: int):
    """A store of n records and a filter that costs 1 ms of CPU and of (fake) time a record."""
    store = open_partition_store("memory", None, IndexSpec())
    for i in range(n):
        store.stage(f"k{i}", SowRecord({"id": i}, i))
    store.commit()

    def costly(data):
        t.cpu += 0.001
        t.now += 0.001
        return False

    return store, costly


def test_a_paced_query_waits_for_the_cpu_it_used_and_the_waits_do_not_count_against_its_limit():
    t = _FakeTime()
    store, costly = _costly_records(t, 2_000)
    pacer = QueryPacer(0.25, lambda: True, t.clock, t.sleep)
    check = QueryLimits(max_seconds=5).start(clock=t.clock, pacer=pacer, cpu=lambda: t.cpu)
    assert store.select(costly, None, 1024, check) == ([], 2_000)
    # 2 s of work, 6 s of waits (a quarter of the time for the query), at the check after 1,024
    # records and at the last: 8 s in all, which without the credit would be over the 5 s limit.
    assert t.slept == [pytest.approx(3 * 1.024), pytest.approx(3 * 0.976)]
    assert t.now == pytest.approx(8.0)


def test_the_waits_count_once_they_pass_the_limit_itself():
    """A query's waits are credited up to its time limit: it ends within twice its limit (and a turn)."""
    t = _FakeTime()
    store, costly = _costly_records(t, 10_000)
    pacer = QueryPacer(0.25, lambda: True, t.clock, t.sleep)
    check = QueryLimits(max_seconds=6).start(clock=t.clock, pacer=pacer, cpu=lambda: t.cpu)
    with pytest.raises(QueryLimitError, match="longer than 6s"):
        store.select(costly, None, 1024, check)
    # Each chunk: 1.024 s of work, then 3.072 s of waits. After two chunks 8.2 s have passed, 6 of
    # them credited: 2.2 s count. After the third, 12.3 s less 6: over the limit.
    assert t.now == pytest.approx(3 * 4.096)
    assert len(t.slept) == 3


def test_a_paced_query_on_real_stores_answers_the_same(tmp_path):
    """The pacer only waits: a query through it returns what it returns without one."""
    store = open_partition_store("rocksdb", str(tmp_path / "p0"), IndexSpec())
    for i in range(20_000):
        store.stage(f"k{i}", SowRecord({"id": i, "v": i % 7}, i))
    store.commit()
    t = _FakeTime()
    pacer = QueryPacer(0.25, lambda: True, t.clock, t.sleep)
    query = SowQuery(filter="/v = 3")
    assert run_query([store], query, (), pacer=pacer)[0] == run_query([store], query, ())[0]
    store.close()


def test_the_query_share_comes_from_the_environment(monkeypatch):
    assert query_share() == 0.25
    monkeypatch.setenv("KSOW_QUERY_SHARE", "0.5")
    assert query_share() == 0.5
    for bad in ("0", "1.5", "-0.1", "x"):
        monkeypatch.setenv("KSOW_QUERY_SHARE", bad)
        with pytest.raises(ConfigError, match="KSOW_QUERY_SHARE"):
            check_environment()


def test_limits_default_from_the_environment(monkeypatch):
    monkeypatch.setenv("KSOW_QUERY_MAX_ROWS", "7")
    monkeypatch.setenv("KSOW_QUERY_MAX_SECONDS", "0.5")
    assert QueryLimits() == QueryLimits(7, 0.5)


def test_negative_top_is_refused():
    with pytest.raises(ValueError, match="top must not be negative"):
        SowQuery.from_params({"top": "-1"})
    with pytest.raises(KsowError, match="top must not be negative"):
        SowQuery(top=-1)


@pytest.mark.parametrize(("params", "says"), [
    ({"fliter": "/id = 1"}, "unknown query parameter(s) fliter (known: filter, keys, select, top, order_by)"),
    ({"top": "abc"}, "top must be a whole number, got 'abc'"),
    ({"top": "1.5"}, "top must be a whole number, got '1.5'"),
    ({"keys": ","}, "keys names no SowKey: give at least one, or leave keys out"),  # audit: it answered with every record
    ({"keys": " "}, "keys names no SowKey: give at least one, or leave keys out"),
    ({"keys": "12,a b"}, "sow-key 'a b' must use only Base64 characters"),
])
def test_request_parameters_a_query_does_not_know_are_refused(params, says):
    """A misspelt `filter` used to be ignored: the answer was the whole SOW."""
    with pytest.raises(KsowError) as err:
        SowQuery.from_params(params)
    assert str(err.value) == says


@pytest.mark.parametrize("order_by", ["/qty SIDEWAYS", "/qty DESC NOW", "qty", "/a//b"])
def test_an_order_by_that_is_not_a_path_and_a_direction_is_refused(order_by):
    with pytest.raises(KsowError, match="order_by"):
        SowQuery(order_by=order_by)


@pytest.mark.parametrize(("order_by", "ids"), [("/v asc", [1, 2, 3]), ("/v", [1, 2, 3]), ("/v desc", [3, 2, 1]), ("  /v   DESC ", [3, 2, 1])])
def test_order_by_directions_in_any_case(order_by, ids):
    rows = [{"id": i, "v": i * 10} for i in (2, 3, 1)]
    assert [r["id"] for r in order_and_cut(rows, SowQuery(order_by=order_by), lambda r: r, repr)] == ids


@pytest.mark.parametrize("query", [SowQuery(), SowQuery("/n > 0"), SowQuery("/g = 1"), SowQuery(keys=("a", "b", "c", "d")), SowQuery(top=2, order_by="/n")])
def test_records_past_their_instant_are_never_returned(tmp_path, query):
    """Whatever the sweep's progress, and whichever path (scan, index, keys, top) answers."""
    from processor.core.expiry import ExpirationMode, ExpiryPolicy

    store = open_partition_store("memory", None, IndexSpec((("/g",),)))
    for key, n, expires in (("a", 1, None), ("b", 2, 999), ("c", 3, 1_000), ("d", 4, 1_001)):
        store.stage(key, SowRecord({"n": n, "g": 1}, n, expires))
    store.commit()
    now = 1_000
    live, _ = run_query([store], query, (("/g",),), policy=ExpiryPolicy(ExpirationMode.ENABLED), now_ms=now)
    assert sorted(r["sow_key"] for r in live) == ["a", "d"][: query.top or 2]
    # A topic whose expiration is disabled only stores instants: nothing is hidden.
    kept, _ = run_query([store], query, (("/g",),), policy=ExpiryPolicy(), now_ms=now)
    assert len(kept) == (query.top or 4)
