"""Differential properties: every place that evaluates a filter agrees with Filter.matches.

The raw-bytes prefilter may only reject records the filter rejects, and a hash-index plan's
candidates (a real RocksDB store) must include every record the filter matches, whatever type
spells the value."""

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from processor.core.filters import compile_filter, format_filter
from processor.core.paths import get_path, project, split_path
from processor.core.rawfilter import raw_prefilter
from processor.core.sow import SowRecord
from processor.state.base import RECORD_HEADER_SIZE, encode_record
from processor.state import IndexSpec, open_partition_store

_STRINGS = st.sampled_from(
    ["", "x", "X", "ab", "10", "10.0", "1e1", "-0", "0", "0.0", "-0.0", "2.5", "true", "TRUE", "False", "null",
     "ß", "SS", "K", "k", "é", "İ", "9007199254740993", "1e400", " 10", "a\"b", "a\\b", "c:d"]
) | st.text(max_size=4)
_NUMBERS = st.sampled_from([0, 1, -1, 10, 2**53, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1, 0.0, -0.0, 10.0, 2.5, 1e20, 1e-7, 1e16]) | st.integers(-20, 20) | st.floats(allow_nan=False, allow_infinity=False)
_SCALARS = _STRINGS | _NUMBERS | st.booleans() | st.none()
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["a", "c", "x"]), inner, max_size=2), max_leaves=6)
_RECORDS = st.fixed_dictionaries(
    {}, optional={"a": _VALUES, "x": _VALUES, "b": st.fixed_dictionaries({}, optional={"c": _VALUES, "a": _VALUES}) | _VALUES}
)

_PATHS = st.sampled_from(["/a", "/x", "/b", "/b/c", "/b/a", "/c"])


def _literal(v) -> str:
    if v is None:
        return "NULL"
    if v is True or v is False:
        return "true" if v else "false"
    if isinstance(v, str):
        return "'" + v.replace("'", "''") + "'"
    return repr(v)


_LITS = (_STRINGS | _NUMBERS | st.booleans()).map(_literal) | st.just("NULL")
_OPERANDS = _PATHS | _PATHS.map(lambda p: f"UPPER({p})") | _PATHS.map(lambda p: f"LOWER({p})")
_NOT = st.sampled_from(["", "NOT "])
_PATTERNS = st.sampled_from(["", "a", "^1", "0$", "^-", "e", "ß", "(?i)k", "^[0-9]+$", "\\.", "true"])

_LEAVES = st.one_of(
    st.builds(lambda a, op, b: f"{a} {op} {b}", _OPERANDS, st.sampled_from(["=", "<>", "!=", "<", "<=", ">", ">="]), _LITS),
    st.builds(lambda a, op, b: f"{b} {op} {a}", _OPERANDS, st.sampled_from(["=", "<", ">="]), _LITS),
    st.builds(lambda a, b: f"{a} = {b}", _PATHS, _PATHS),
    st.builds(lambda a, n, p: f"{a} {n}LIKE '{p}'", _OPERANDS, _NOT, _PATTERNS),
    st.builds(lambda a, n, vs: f"{a} {n}IN ({', '.join(vs)})", _OPERANDS, _NOT, st.lists(_LITS, min_size=1, max_size=4)),
    st.builds(lambda a, n, lo, hi: f"{a} {n}BETWEEN {lo} AND {hi}", _OPERANDS, _NOT, _LITS, _LITS),
    st.builds(lambda a, n: f"{a} IS {n}NULL", _OPERANDS, _NOT),
    st.builds(lambda a, n, k, vs: f"{a} {n}{k} WITH ({', '.join(vs)})", _OPERANDS, _NOT, st.sampled_from(["BEGINS", "ENDS"]),
              st.lists(_STRINGS.map(_literal), min_size=1, max_size=3)),
)
_FILTERS = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(
        inner.map(lambda f: f"NOT ({f})"),
        st.lists(inner, min_size=2, max_size=3).map(lambda fs: " AND ".join(f"({f})" for f in fs)),
        st.lists(inner, min_size=2, max_size=3).map(lambda fs: " OR ".join(f"({f})" for f in fs)),
    ),
    max_leaves=4,
)
_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))


def _stored(record: dict) -> dict:
    return orjson.loads(orjson.dumps(record))


@_SETTINGS
@given(_FILTERS, st.lists(_RECORDS, min_size=1, max_size=4))
def test_raw_prefilter_never_rejects_a_match(text, records):
    f = compile_filter(text)
    check = raw_prefilter(f, RECORD_HEADER_SIZE)
    if check is None:
        return
    for record in map(_stored, records):
        if f.matches(record):
            assert check(encode_record(SowRecord(record, 1, None, 0))), (text, record)


_EQ_LEAVES = st.one_of(
    st.builds(lambda a, b: f"{a} = {b}", _PATHS, _LITS),
    st.builds(lambda a, b: f"{b} = {a}", _PATHS, _LITS),
    st.builds(lambda a, vs: f"{a} IN ({', '.join(vs)})", _PATHS, st.lists(_LITS, min_size=1, max_size=4)),
)
_EQ_FILTERS = st.lists(_EQ_LEAVES | _LEAVES, min_size=1, max_size=3).map(lambda fs: " AND ".join(f"({f})" for f in fs))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = open_partition_store("rocksdb", str(tmp_path_factory.mktemp("p0")), IndexSpec((("/a",), ("/b/c",), ("/x", "/b/a"))))
    yield s
    s.close()


@_SETTINGS
@given(text=_EQ_FILTERS, records=st.lists(_RECORDS, min_size=1, max_size=5))
def test_index_plans_find_every_match(store, text, records):
    f = compile_filter(text)
    store.clear()
    for n, record in enumerate(records):
        store.stage(str(n), SowRecord(record, n + 1, None, 0))
    store.commit()
    expected = {str(n) for n, record in enumerate(map(_stored, records)) if f.matches(record)}
    assert set(store.matching(f)) == expected, text
    found, _ = store.select(f.matches, raw_prefilter(f, RECORD_HEADER_SIZE))
    assert {k for k, _ in found} == expected, text


@_SETTINGS
@given(_FILTERS, st.lists(_RECORDS, min_size=1, max_size=4))
def test_formatted_filters_match_the_same_records(text, records):
    f = compile_filter(text)
    again = compile_filter(format_filter(f))
    for record in map(_stored, records):
        assert again._fn(record) == f._fn(record), (text, format_filter(f), record)


def test_a_field_above_a_selected_one_is_null_only_when_the_view_record_lacks_it():
    """A view selecting /b/c shows {"b": {"c": 1}}: /b IS NOT NULL is TRUE there (it read NULL)."""
    f = compile_filter("/b IS NOT NULL")
    through = f.seen_through(["/k", "/b/c"])
    assert through.matches({"b": {"c": 1, "d": 2}})
    assert not through.matches({"b": {"d": 2}}) and not through.matches({"b": 5})
    assert compile_filter("/b IS NULL").seen_through(["/b/c"]).matches({"b": 5})


_SELECT = st.lists(st.sampled_from(["/a", "/x", "/b/c", "/b/a", "/b/c/x", "/x/a"]), min_size=1, max_size=3)


@_SETTINGS
@given(_FILTERS | st.builds(lambda a, n: f"{a} IS {n}NULL", _OPERANDS, _NOT), _SELECT, st.lists(_RECORDS, min_size=1, max_size=4))
def test_a_filter_seen_through_a_select_list_reads_the_cut_record(text, select, records):
    f = compile_filter(text)
    through = f.seen_through(select)
    parts = [split_path(p) for p in select]
    for record in map(_stored, records):
        # A selected field that is JSON null or '' keeps its parent on the cut record, which no
        # filter can tell from a missing field (see _seen_through).
        if any(get_path(record, p) in (None, "") for p in parts):
            continue
        cut = project(record, parts)
        assert through.matches(record) is f.matches(cut), (text, through.text, record, cut)
