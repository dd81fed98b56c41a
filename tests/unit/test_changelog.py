"""Parsing `<topic>.sow` messages: anything may write there, so every defect is a MalformedSowMessage."""

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from processor.contract.errors import InputError
from processor.contract.types import Op, UnreadableHeaders
from processor.core.changelog import MalformedSowMessage, SowMessage, parse_sow_message
from processor.core.codec import JsonCodec

CODEC = JsonCodec()
GOOD = [("sow-op", b"insert"), ("sow-seq", b"1025"), ("sow-expires-at", b"1700000000000")]


def test_a_worker_written_message():
    assert parse_sow_message(CODEC, b"k1", b'{"id": 1}', GOOD) == SowMessage(Op.INSERT, "k1", 1025, 1700000000000, {"id": 1})
    assert parse_sow_message(CODEC, b"k1", None, [("sow-op", b"expire")]) == SowMessage(Op.EXPIRE, "k1", None, None, None)
    assert parse_sow_message(CODEC, b"k1", b"{}", None).op is Op.UPDATE  # no headers: defaults
    assert parse_sow_message(CODEC, b"k1", None, [("other", b"\xff")]).op is Op.DELETE


@pytest.mark.parametrize(
    "key,value,headers,reason",
    [
        (None, b"{}", GOOD, "no key"),
        (b"\xff", b"{}", GOOD, "key is not UTF-8"),
        (b"k", b"\x00garbage", GOOD, "not valid JSON"),
        (b"k", b"[1]", GOOD, "JSON object"),
        (b"k", b"{}", [("sow-op", b"explode")], "unknown sow-op"),
        (b"k", b"{}", [("sow-op", b"\xff")], "sow-op is not ASCII"),
        (b"k", b"{}", [("sow-seq", b"abc")], "sow-seq is not a 64-bit integer"),
        (b"k", b"{}", [("sow-seq", b"")], "sow-seq is not a 64-bit integer"),
        (b"k", b"{}", [("sow-expires-at", b"1e99")], "sow-expires-at is not a 64-bit integer"),
        (b"k", b"{}", [("sow-expires-at", b"9" * 5000)], "sow-expires-at is not a 64-bit integer"),
        (b"k", b"{}", [("sow-expires-at", str(2**63).encode())], "sow-expires-at is not a 64-bit integer"),
    ],
)
def test_malformed_messages(key, value, headers, reason):
    with pytest.raises(MalformedSowMessage, match=reason) as err:
        parse_sow_message(CODEC, key, value, headers)
    assert isinstance(err.value, InputError) and len(str(err.value)) < 200


@given(st.one_of(st.none(), st.binary(max_size=30)), st.one_of(st.none(), st.binary(max_size=60)),
       st.lists(st.tuples(st.sampled_from(["sow-op", "sow-seq", "sow-expires-at", "x"]), st.one_of(st.none(), st.binary(max_size=25)))))
def test_any_bytes_parse_or_are_malformed(key, value, headers):
    """Nothing else escapes: a reader catches MalformedSowMessage alone."""
    try:
        parsed = parse_sow_message(CODEC, key, value, headers)
    except MalformedSowMessage:
        return
    assert parsed.key == key.decode() and (parsed.record is None) == (value is None)


def test_a_sow_record_whose_headers_cannot_be_read_is_malformed():
    with pytest.raises(MalformedSowMessage, match="a header name is not UTF-8 text"):
        parse_sow_message(JsonCodec(), b"k", b'{"id": 1}', UnreadableHeaders())


@given(st.integers(-(2**64), 2**64), st.sampled_from(["sow-seq", "sow-expires-at"]), st.sampled_from(["", "0", "+", " "]))
@example(2**63 - 1, "sow-seq", "")
@example(2**63, "sow-seq", "")
@example(10**18, "sow-seq", "0")
@example(10**17, "sow-seq", "0")
@example(-(2**63), "sow-expires-at", "")
@example(-(2**63) - 1, "sow-expires-at", "")
def test_integer_headers_are_read_exactly_in_64_bits(number, name, prefix):
    """A header of up to 19 digits is read without decoding it first (`_integer`'s quick path): it
    must take and refuse what the checked path does (2**63 has 19 digits)."""
    text = prefix + str(number) if number >= 0 else str(number)
    digits = text.removeprefix("-")
    exact = digits.isdigit() and len(digits) <= 19 and -(2**63) <= number < 2**63  # the rule before the quick path
    raw = text.encode()
    try:
        parsed = parse_sow_message(CODEC, b"k", None, [(name, raw)])
    except MalformedSowMessage:
        assert not exact
        return
    assert exact and (parsed.seq if name == "sow-seq" else parsed.expires_at) == number
