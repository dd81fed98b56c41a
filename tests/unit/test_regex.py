"""LIKE matches in linear time (RE2): hostile patterns cannot hold a worker, unsupported syntax is
a FilterError at compile time, and filters stay deep enough to compile and match."""

import pickle
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from processor.core.filters import MAX_DEPTH, FilterError, compile_filter
from processor.core.regex import Regex, RegexError


@pytest.mark.parametrize("pattern", ["^(a+)+$", "(a|a)*$", "^(a|aa)+$", "(.*a){12}$", "^(\\w+\\s?)*$"])
def test_backtracking_patterns_finish_in_milliseconds_on_long_values(pattern):
    """Python's re takes 0.5 s for ^(a+)+$ on 24 characters, and twice as long per added one."""
    f = compile_filter(f"/a LIKE '{pattern}'")
    value = "a" * 100_000 + "!"
    began = time.perf_counter()
    f.matches({"a": value})
    assert time.perf_counter() - began < 0.05


def test_the_pathological_pattern_still_matches_correctly():
    f = compile_filter("/a LIKE '^(a+)+$'")
    assert f.matches({"a": "a" * 10_000})
    assert not f.matches({"a": "a" * 10_000 + "b"})


@pytest.mark.parametrize(
    "pattern,fragment",
    [
        ("(a)\\1", "\\1"),  # backreference
        ("x(?=y)", "(?="),  # look-ahead
        ("x(?!y)", "(?!"),
        ("(?<=x)y", "(?<="),  # look-behind
        ("(?<!x)y", "(?<!"),
        ("a++", "++"),  # possessive
        ("(?>a)", "(?>"),  # atomic group
        ("a{1001}", "{1001}"),
    ],
)
def test_constructs_re2_cannot_match_in_linear_time_are_filter_errors(pattern, fragment):
    text = f"/name LIKE '{pattern}'"
    with pytest.raises(FilterError) as err:
        compile_filter(text)
    assert err.value.position == text.index(fragment)
    assert "LIKE uses RE2 syntax" in str(err.value)


def test_a_pattern_error_points_into_the_pattern_past_doubled_quotes():
    text = "/a LIKE 'it''s (x)\\1'"
    with pytest.raises(FilterError) as err:
        compile_filter(text)
    assert err.value.position == text.index("\\1")


@pytest.mark.parametrize(
    "pattern,value,expected",
    [
        ("^\\d{3}-[A-Z]+$", "123-ABC", True),  # PCRE classes and counts
        ("(?i)^open", "OPEN now", True),  # inline flags
        ("^\\p{Lu}", "Émile", True),  # Unicode classes
        ("^.$", "é", True),  # a character, not a byte
        ("\\bfoo\\b", "a foo b", True),
        ("colou?r", "color", True),
        ("^x|y$", "zzy", True),
        ("\\d", "٣", False),  # \d is ASCII, as in PCRE by default
        ("a", "\ud800a", True),  # a lone surrogate in the value does not raise
    ],
)
def test_amps_style_patterns_keep_working(pattern, value, expected):
    assert compile_filter(f"/s LIKE '{pattern}'").matches({"s": value}) is expected


@given(st.text(alphabet="ab(|)*+?.^$", max_size=12), st.text(alphabet="ab", max_size=30))
def test_agrees_with_python_re_where_both_compile(pattern, text):
    import re

    try:
        python = re.compile(pattern)
        ours = Regex(pattern)
    except (re.error, RegexError):
        return
    assert ours.search(text) == (python.search(text) is not None)


def test_compiled_filters_with_like_pickle():
    """Spark ships filters to its Python workers: the RE2 program is rebuilt from the pattern."""
    f = pickle.loads(pickle.dumps(compile_filter("/s LIKE '^a(b|c)'")))
    assert f.matches({"s": "ac"}) and not f.matches({"s": "ad"})


def test_nesting_beyond_the_limit_is_a_filter_error_not_a_recursion_error():
    assert compile_filter("NOT " * (MAX_DEPTH - 2) + "/a = 1").matches({"a": 2}) in (True, False)
    for depth in (MAX_DEPTH + 1, 16_000):  # 16,000 NOTs: just under the size bound
        with pytest.raises(FilterError, match="nested at most"):
            compile_filter("NOT " * depth + "/a = 1")


def test_error_messages_quote_a_window_of_a_huge_filter():
    text = "/a = 1 AND " * 5_000 + "/b >> 3"
    with pytest.raises(FilterError) as err:
        compile_filter(text)
    assert err.value.position == text.index(">>") + 1
    shown, caret = str(err.value).splitlines()[-2:]
    assert len(shown) < 100 and shown[caret.index("^")] == ">"


def test_a_long_digit_run_compared_with_a_number_is_linear():
    """'111...1x' against a number: the number pattern was ambiguous, 7 s for 20,000 digits."""
    began = time.perf_counter()
    assert not compile_filter("/a > 5").matches({"a": "1" * 200_000 + "x"})
    assert time.perf_counter() - began < 0.5


def test_patterns_whose_matches_cost_text_times_program_are_refused():
    """Review: `.{1000}.{1000}z` (16,005 RE2 instructions) matched 100 KB in 4 s, where no budget
    can interrupt it; a filter of 1,941 LIKEs of 62,000 instructions each took minutes and
    gigabytes to compile. A pattern may compile to MAX_PROGRAM instructions, a filter's distinct
    patterns to MAX_FILTER_PROGRAM in all; patterns people write stay far below."""
    from processor.core.filters import MAX_FILTER_PROGRAM
    from processor.core.regex import MAX_PROGRAM

    with pytest.raises(RegexError, match="16,005 RE2 instructions, over the 5,000"):
        Regex(".{1000}.{1000}z")
    with pytest.raises(FilterError, match="a valid regular expression"):
        compile_filter(r"/a LIKE '\p{Greek}{1000}'")
    assert Regex(r"[0-9a-f]{32}").size < 100 and Regex(r"\p{L}+").size < MAX_PROGRAM
    six = " OR ".join(f"/a LIKE '.{{{590 + i}}}'" for i in range(6))  # about 4,800 instructions each
    with pytest.raises(FilterError, match=f"LIKE patterns of at most {MAX_FILTER_PROGRAM:,} RE2 instructions in all"):
        compile_filter(six)
    assert compile_filter(" OR ".join(["/a LIKE '.{590}'"] * 6)).matches({"a": "x" * 600})  # one pattern, compiled once


def test_fullmatch_takes_the_whole_text_search_any_part():
    pattern = Regex("ab|abc")
    assert pattern.fullmatch("abc") and pattern.fullmatch("ab") and not pattern.fullmatch("xabc")
    assert pattern.search("xabc") and not Regex("^b").search("ab")
