"""Raw-bytes prefilters (processor.core.rawfilter): a check on the stored bytes must never reject a
record the full filter matches, and the scan path must give the same answers with it."""

import sys

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processor.contract.types import SowRecord
from processor.core.filters import compile_filter
from processor.core.rawfilter import CASE_FROM_NON_ASCII, raw_prefilter
from processor.query.engine import SowQuery, run_query
from processor.state import IndexSpec, open_partition_store
from processor.state.base import RECORD_HEADER_SIZE, encode_record
from tests.unit.test_filters import PATTERNS, STRINGS, probes, render

SETTINGS = settings(max_examples=300, deadline=None)


def stored(record: dict) -> bytes:
    """The bytes a store keeps for a record (header, then orjson), as the scan sees them."""
    return encode_record(SowRecord(record, 2**40 + 12345, 1_700_000_000_123, 1_700_000_000_000))


def check_of(text: str):
    """The check as a plain predicate (checks return any true value for "may match")."""
    check = raw_prefilter(compile_filter(text), RECORD_HEADER_SIZE)
    return None if check is None else (lambda raw: bool(check(raw)))


# ---------------------------------------------------------------------------------------------
# Strategies: the filter tests' values plus what trips byte-level reasoning (escapes, keys at
# several depths, strings that look like JSON or numbers, case mapping outside ASCII, big numbers)

NASTY = ["", '"', "\\", '\\"', '"a":5', '{"a":1}', ',"a":', "c42", "C42", "c42\n", "\u212a", "İ", "ß", "ss", "SS",
         "ﬁ", "é", "\x00", "\x1f", "1e+20", "1e20", "10.0", "-0", "null", "true", "\u2028"]  # fmt: skip
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 12),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 2.5, 10.0, 1e20, 1e-7, 0.1, 123456789012345.6]),
    st.sampled_from(STRINGS + NASTY),
    st.text(max_size=6),
)
KEYS = ["a", "b", "x", "y"]  # nested objects reuse top-level names, before or after them
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYS), inner, max_size=3)),
    max_leaves=5,
)
records = st.dictionaries(st.sampled_from(["a", "b", "c", "n", "x"]), values, max_size=5)

PATHS = ["/a", "/b", "/n/x", "/n/a", "/x"]
literals = scalars.map(lambda v: ("lit", v))
paths = st.sampled_from(PATHS).map(lambda p: ("path", p))
funcs = st.tuples(st.just("func"), st.sampled_from(["UPPER", "LOWER"]), st.one_of(paths, literals))
operands = st.one_of(paths, paths, paths, literals, funcs)
negated = st.booleans()
predicates = st.one_of(
    st.tuples(st.just("cmp"), st.sampled_from(["=", "<>", "<", "<=", ">", ">="]), operands, operands),
    st.tuples(st.just("cmp"), st.just("="), st.one_of(paths, funcs), literals),
    st.tuples(st.just("like"), operands, st.sampled_from(PATTERNS), negated),
    st.tuples(st.just("in"), operands, st.lists(scalars, min_size=1, max_size=4), negated),
    st.tuples(st.just("between"), operands, scalars, scalars, negated),
    st.tuples(st.just("isnull"), operands, negated),
    st.tuples(st.just("affix"), operands, st.sampled_from(["BEGINS", "ENDS"]),
              st.lists(st.sampled_from(STRINGS + NASTY[:12]), min_size=1, max_size=3), negated, st.booleans()),
)  # fmt: skip
trees = st.recursive(
    predicates,
    lambda sub: st.one_of(st.tuples(st.just("not"), sub), st.tuples(st.just("and"), sub, sub), st.tuples(st.just("or"), sub, sub)),
    max_leaves=5,
)


def renderable(tree) -> bool:
    """Hypothesis text can hold what the filter grammar cannot quote or number literals it
    cannot read (a float repr like 'inf'); such trees are skipped."""
    try:
        compile_filter(render(tree, __import__("random").Random(0)))
        return True
    except Exception:
        return False


def assert_never_misses(text: str, recs: list) -> None:
    f = compile_filter(text)
    check = check_of(text)
    if check is None:
        return
    for record in recs:
        if f.matches(record):
            assert check(stored(record)), (text, record, stored(record))


@SETTINGS
@given(trees.filter(renderable), st.lists(records, min_size=1, max_size=8), st.randoms(use_true_random=False))
def test_prefilter_never_rejects_a_match(tree, recs, rnd) -> None:
    text = render(tree, rnd)
    assert_never_misses(text, recs)
    assert_never_misses(f"NOT ({text})", recs)


@SETTINGS
@given(predicates.filter(renderable), st.lists(records, max_size=4), st.randoms(use_true_random=False))
def test_prefilter_never_rejects_a_match_near_the_literals(predicate, recs, rnd) -> None:
    """Values at and around the predicate's own literals, alone, in arrays, and nested under the
    same key elsewhere in the record."""
    near = probes(predicate)
    field = next((p[1] for p in predicate[1:] if isinstance(p, tuple) and p[0] == "path"), "/a")
    keyed = []
    for v in near:
        parts = field.strip("/").split("/")
        rec = v
        for part in reversed(parts):
            rec = {part: rec}
        keyed += [rec, {"b": {parts[-1]: "zz"}, **rec}, {**rec, "x": {parts[-1]: v}}]
    assert_never_misses(render(predicate, rnd), recs + keyed)


def record_from(fields: dict) -> dict:
    """A record with the given values at the given paths ('/n/x' nests)."""
    out: dict = {}
    for path, value in fields.items():
        *outer, last = path.strip("/").split("/")
        node = out
        for part in outer:
            node = node.setdefault(part, {}) if isinstance(node.get(part), dict) or part not in node else {}
        node[last] = value
    return out


@SETTINGS
@given(trees.filter(renderable), st.data(), st.randoms(use_true_random=False))
def test_prefilter_never_rejects_a_match_on_records_made_of_the_literals(tree, data, rnd) -> None:
    """Records whose fields take the filter's own literals (and neighbours), so that many match."""
    near = st.sampled_from(probes(tree))
    recs = []
    for _ in range(6):
        fields = {p: data.draw(near) for p in PATHS if data.draw(st.booleans())}
        record = record_from(fields)
        if data.draw(st.booleans()):  # the same keys once more, nested elsewhere, first
            record = {"c": record_from({p: data.draw(near) for p in PATHS}), **record}
        recs.append(record)
    text = render(tree, rnd)
    assert_never_misses(text, recs)
    assert_never_misses(f"NOT ({text})", recs)


# ---------------------------------------------------------------------------------------------
# Which filters get a check, and that it rejects what it should


RECORD = {"order_id": 7, "customer": "c4201", "region": "EU", "status": "open", "qty": 2090, "px": 67.78,
          "desk": {"name": "d7", "book": 3}}  # fmt: skip


@pytest.mark.parametrize(
    "text, passes",
    [
        ("/customer = 'c42'", False),  # c4201 holds c42, but not "c42" quoted
        ("/customer = 'c4201'", True),
        ("'c4201' = /customer", True),
        ("/customer IN ('c1', 'c42')", False),
        ("/customer IN ('c1', 'c4201', NULL)", True),
        ("LOWER(/customer) = 'c4201'", True),
        ("UPPER(/customer) = 'C4201'", True),
        ("LOWER(/customer) = 'C4201'", False),  # LOWER never gives an upper-case letter
        ("/qty > 4990", False),
        ("/qty > 2089", True),
        ("/qty BETWEEN 1 AND 10", False),
        ("/qty NOT BETWEEN 1 AND 10", True),
        ("/px < 20", False),
        ("/qty > 4990 AND /px < 20", False),
        ("/qty > 4990 OR /px < 20", False),
        ("/qty > 4990 OR /px > 20", True),
        ("/desk/book = 4", False),
        ("/desk/book = 3", True),
        ("/desk/name LIKE '^d[0-6]$'", False),
        ("/desk/name LIKE '^d7'", True),
        ("/status BEGINS WITH ('cl', 'fi')", False),
        ("/region ENDS WITH 'U'", True),
        ("/nope > 1", False),  # a missing field is NULL: never TRUE
    ],
)
def test_checks_on_a_record(text: str, passes: bool) -> None:
    check = check_of(text)
    assert check is not None
    assert check(stored(RECORD)) is passes
    assert compile_filter(text).matches(RECORD) is False or passes


@pytest.mark.parametrize(
    "text",
    [
        "/customer IS NULL",  # TRUE for a missing field
        "/customer IS NOT NULL",
        "NOT /qty > 4990",
        "/qty > 4990 OR NOT /px < 20",  # one disjunct without a check: none for the OR
        "/qty = /px",
        "1 = 1",
    ],
)
def test_no_check(text: str) -> None:
    assert check_of(text) is None


def test_strings_that_spell_numbers_or_booleans_are_not_substring_checks() -> None:
    """'10' equals the number 10 and 10.0; 'true' equals the boolean: a byte search for the quoted
    literal would miss those, so these take the decoding check."""
    for text, record in [("/a = '10'", {"a": 10.0}), ("/a = '10'", {"a": [1, 10]}), ("/a = 'TRUE'", {"a": True}),
                         ("/a IN ('x', '2.5')", {"a": 2.5}), ("/a = '1e1'", {"a": 10})]:  # fmt: skip
        assert compile_filter(text).matches(record)
        assert check_of(text)(stored(record)), (text, record)


def test_keys_elsewhere_and_escapes() -> None:
    check = check_of("/a > 5")
    assert check(stored({"b": {"a": 1}, "a": 9}))  # the nested "a" first
    # Every "a" counts, at any depth: a nested 9 keeps the record a candidate (the filter then
    # says no); only when no "a" anywhere could match is the record skipped.
    assert check(stored({"b": {"a": 9}, "a": 1})) and not compile_filter("/a > 5").matches({"b": {"a": 9}, "a": 1})
    assert not check(stored({"b": {"a": 2}, "a": 1}))
    assert check(stored({"a": "9"}))  # a string that spells a number: decoded and compared
    assert check(stored({"a": [1, 9]}))
    assert not check(stored({"s": '"a":9', "a": 1}))
    quoted = check_of("/s = 'say \"hi\"'")
    assert quoted(stored({"s": 'say "hi"'})) and not quoted(stored({"s": "say hi"}))


def test_case_mapping_outside_ascii() -> None:
    """'K' (KELVIN SIGN) lowers to 'k', 'ß' uppers to 'SS': literals with such letters get no
    byte search, and the decoding check still finds these records."""
    for text, record in [("LOWER(/a) = 'kb'", {"a": "\u212aB"}), ("UPPER(/a) = 'SS'", {"a": "ß"}),
                         ("LOWER(/a) = 'i̇'", {"a": "İ"})]:  # fmt: skip
        assert compile_filter(text).matches(record), text
        assert check_of(text)(stored(record)), text


def test_case_from_non_ascii_table_is_complete() -> None:
    """Recompute over all of Unicode which ASCII characters LOWER/UPPER make from non-ASCII ones."""
    lower, upper = set(), set()
    for code in range(0x80, sys.maxunicode + 1):
        c = chr(code)
        lower.update(x for x in c.lower() if x.isascii())
        upper.update(x for x in c.upper() if x.isascii())
    assert CASE_FROM_NON_ASCII == {"LOWER": frozenset(lower), "UPPER": frozenset(upper)}


# ---------------------------------------------------------------------------------------------
# The scan path with checks: same answers, reads counted, useless checks dropped


@pytest.fixture(params=["rocksdb", "memory"])
def store(request, tmp_path):
    s = open_partition_store(request.param, str(tmp_path / "p"), IndexSpec())
    for i in range(3000):
        s.stage(f"k{i:05d}", SowRecord({"id": i, "name": f"n{i % 100}", "qty": i % 1000, "tags": [f"t{i % 7}"]}, i))
    s.commit()
    yield s
    s.close()


@pytest.mark.parametrize(
    "text",
    ["/name = 'n7'", "/qty > 990", "/qty >= 0", "/tags = 't3' AND /qty < 10", "LOWER(/name) IN ('n1', 'n2')",
     "/name LIKE '^n9' OR /qty = 5", "/id BETWEEN 100 AND 120"],
)  # fmt: skip
def test_select_with_check_gives_the_same_rows(store, text: str) -> None:
    f = compile_filter(text)
    plain, read_plain = store.select(f.matches)
    checked, read_checked = store.select(f.matches, raw_prefilter(f, RECORD_HEADER_SIZE))
    assert [(k, r.data, r.seq) for k, r in checked] == [(k, r.data, r.seq) for k, r in plain]
    assert read_plain == read_checked == 3000


def test_select_drops_a_check_that_rejects_too_little(store) -> None:
    calls = []

    def check(raw: bytes) -> bool:
        calls.append(1)
        return True

    rows, read = store.select(compile_filter("/qty >= 0").matches, check)
    assert read == 3000 and len(rows) == 3000
    assert len(calls) == store.PROBE


def test_run_query_scans_with_the_check(store) -> None:
    rows, plan = run_query([store], SowQuery("/name = 'n7' AND /qty < 500"), ())
    assert plan.index is None and plan.candidates == 3000 and plan.extra["prefilter"] is True
    assert sorted(r["record"]["id"] for r in rows) == [i for i in range(3000) if i % 100 == 7 and i % 1000 < 500]
    _, plan = run_query([store], SowQuery("/name IS NULL"), ())
    assert plan.extra["prefilter"] is False


def test_rocksdb_scan_stops_at_the_bound(tmp_path) -> None:
    """The RocksDB scan bounds its iterator in RocksDB (keys with high bytes, the bound itself)."""
    from processor.state.rocksdb import RocksDBBackend

    backend = RocksDBBackend(tmp_path / "db")
    keys = [b"i\x007h\xb8T\x86a", b"i\x007h\xb8T\x86b", b"i\x007h\xb8T\x87", b"i\x01", b"m1", b"r\xff"]
    batch = backend.batch()
    for k in keys:
        batch.put(k, b"v")
    backend.write(batch)
    prefix = b"i\x007h\xb8T\x86"
    for _ in range(3):  # after other allocations too: the bound must outlive the call
        scans = [backend.scan(prefix, prefix + b"\xff" * 9) for _ in range(5)]
        junk = [bytes(64) for _ in range(1000)]
        assert all([k for k, _ in s] == keys[:2] for s in scans) and junk
    assert [k for k, _ in backend.scan(b"i", b"m1")] == keys[:4]
    assert [k for k, _ in backend.scan(b"", b"r\xff")] == keys[:5]
    backend.close()


def test_stored_bytes_are_orjson_after_the_header() -> None:
    """What the checks rely on: the JSON starts at RECORD_HEADER_SIZE and is orjson's output."""
    record = {"a": 'x"y', "b": [1, 2.5], "c": {"d": None}}
    assert stored(record)[RECORD_HEADER_SIZE:] == orjson.dumps(record)


# ---------------------------------------------------------------------------------------------
# Number comparisons as one regex over the number's text


numbers = st.one_of(
    st.integers(-20_000, 20_000),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(-20_000, 20_000).map(lambda x: round(x, 2)),
    st.sampled_from([0, 0.0, -0.0, 1, -1, 0.5, -0.5, 19.99, 20.0, 20, 4990, 4990.0, 4990.5, 4991, 1e15, 1e16, -1e15, 1e-7]),
)
number_texts = st.one_of(
    numbers.map(orjson.dumps),
    st.sampled_from([b"19.99999999999999999", b"-19.99999999999999999", b"4989.9999999999999999", b"4990.0000000000000001",
                     b"-0", b"-0.0", b"0.0", b"1e3", b"1E3", b"-1.5e2", b"20.000"]),  # not orjson's, still read right
)  # fmt: skip


@settings(max_examples=2000, deadline=None)
@given(st.sampled_from(["=", "<", "<=", ">", ">=", "BETWEEN"]), numbers, numbers, number_texts)
def test_number_regex_only_rejects_what_the_filter_rejects(op, lit, high, text) -> None:
    import re

    from processor.core.rawfilter import _number_fails

    if op == "BETWEEN":
        f = compile_filter(f"/a BETWEEN {lit!r} AND {high!r}")
    else:
        f = compile_filter(f"/a {op} {lit!r}")
    fails = _number_fails(f._ast)
    if fails is None:
        return
    value = orjson.loads(text)
    if re.fullmatch(b"(?:" + fails + b")", text):
        assert not f.matches({"a": value}), (f.text, text)
    # and through the store's check, with the value alone, nested, or in an array
    check = check_of(f.text)
    for record in ({"a": value}, {"b": {"a": value}, "a": value}, {"a": [value, 0]}):
        raw = stored({})[:RECORD_HEADER_SIZE] + orjson.dumps(record).replace(orjson.dumps(value), text)
        if f.matches(orjson.loads(raw[RECORD_HEADER_SIZE:])):
            assert check(raw), (f.text, raw)


def test_number_regex_rejects_most_non_matches() -> None:
    """The regex is not just safe but useful: it rejects nearly every number that fails."""
    for text in ["/a > 4990", "/a >= 20", "/a < 20", "/a <= -2.5", "/a = 7", "/a BETWEEN 10 AND 20.5", "/a > -3"]:
        f = compile_filter(text)
        check = check_of(text)
        values = list(range(-50, 5100, 7)) + [x / 4 for x in range(-200, 200)]
        misses = [v for v in values if not f.matches({"a": v}) and check(stored({"a": v}))]
        assert len(misses) <= 0.02 * len(values), (text, misses[:10])
