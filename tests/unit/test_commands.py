"""Parsing input messages into commands; every bad input is an InputError with a reason."""

import re

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from processor.contract.errors import ConfigError, InputError
from processor.contract.limits import MAX_DELETE_KEYS, check_environment
from processor.contract.types import Command, UnreadableHeaders
from processor.core.codec import JsonCodec
from processor.core.commands import header_map, parse_command
from processor.core.keys import KeySpec

KEYS = KeySpec("orders", ("/id",))
CODEC = JsonCodec()


def parse(value, headers=None, default=Command.PUBLISH, keys=KEYS):
    return parse_command(keys, CODEC, default, value, header_map(headers or []))


def test_defaults_from_topic():
    cmd = parse(b'{"id": 1, "x": 2}')
    assert cmd.command is Command.PUBLISH and cmd.data == {"id": 1, "x": 2}
    assert cmd.sow_key == KEYS.sow_key({"id": 1})
    assert parse(b'{"id": 1}', default=Command.DELTA_PUBLISH).command is Command.DELTA_PUBLISH


def test_headers_override_and_expiration():
    cmd = parse(b'{"id": 1}', [("sow-command", b"delta_publish"), ("sow-expiration", b"5s")])
    assert cmd.command is Command.DELTA_PUBLISH and cmd.expiration_ms == 5000
    assert parse(b'{"id": 1}', [("sow-expiration", b"0")]).expiration_ms == 0


def test_deletes():
    by_data = parse(b'{"id": 3, "whatever": 1}', [("sow-command", b"sow_delete")])
    assert by_data.command is Command.SOW_DELETE and by_data.sow_key == KEYS.sow_key({"id": 3})
    by_keys = parse(None, [("sow-command", b"sow_delete"), ("sow-keys", b"a1, b2")])
    assert by_keys.keys == ("a1", "b2") and by_keys.sow_key is None
    by_filter = parse(None, [("sow-command", b"sow_delete"), ("sow-filter", b"/x > 1")])
    assert by_filter.filter == "/x > 1"


@pytest.mark.parametrize("value,headers,reason", [
    (b"not json", [], "not valid JSON"),
    (b"[1,2]", [], "JSON object"),
    (b'{"x": 1}', [], "missing key field /id"),
    (b'{"id": 1}', [("sow-command", b"upsert")], "unknown sow-command"),
    (b'{"id": 1}', [("sow-expiration", b"later")], "bad sow-expiration"),
    (None, [], "has no value"),
    (None, [("sow-command", b"sow_delete")], "sow_delete needs"),
    (None, [("sow-command", b"sow_delete"), ("sow-keys", b" , ")], "empty sow-keys"),
    (b'{"id": 1}', [("sow-command", b"\xff")], "not UTF-8"),
    (b'{"id": 1}', [("sow-key", None)], "has no value"),
    (b'{"id": 1}', [("sow-expiration", b"200000000000d")], "over the limit of 36500d"),
])
def test_bad_inputs(value, headers, reason):
    with pytest.raises(InputError, match=reason):
        parse(value, headers)


@pytest.mark.parametrize("value,headers,named", [
    (None, [("sow-filter", b"1=1"), ("sow-keys", b"a1,b2")], "sow-filter and sow-keys"),
    (b'{"id": 3}', [("sow-filter", b"/id = 4")], "sow-filter and a value"),
    (b'{"id": 3}', [("sow-keys", b"a1")], "sow-keys and a value"),
])
def test_a_delete_that_names_what_to_delete_twice_is_an_error(value, headers, named):
    """Not one of them applied and the others dropped: the filter 1=1 beside sow-keys a1,b2 deleted every record."""
    with pytest.raises(InputError, match=f"sow_delete with {named}"):
        parse(value, [("sow-command", b"sow_delete"), *headers])


def _delete_keys(n: int):
    keys = ",".join(f"k{i}" for i in range(n)).encode()
    return parse(None, [("sow-command", b"sow_delete"), ("sow-keys", keys)])


def test_keys_per_delete_are_capped():
    """One sow_delete with N keys becomes N rerouted copies: N is bounded, the rest is an error."""
    assert len(_delete_keys(MAX_DELETE_KEYS).keys) == MAX_DELETE_KEYS
    with pytest.raises(InputError, match=f"lists {MAX_DELETE_KEYS + 1} keys, over the limit of {MAX_DELETE_KEYS}"):
        _delete_keys(MAX_DELETE_KEYS + 1)


def test_keys_per_delete_cap_follows_the_environment(monkeypatch):
    monkeypatch.setenv("KSOW_MAX_DELETE_KEYS", "3")
    assert len(_delete_keys(3).keys) == 3
    with pytest.raises(InputError, match="over the limit of 3"):
        _delete_keys(4)
    monkeypatch.setenv("KSOW_MAX_DELETE_KEYS", "lots")
    with pytest.raises(ConfigError, match="KSOW_MAX_DELETE_KEYS must be a positive integer"):
        check_environment()


def test_user_keys_topic():
    keys = KeySpec("blobs")
    assert parse(b'{"a": 1}', [("sow-key", b"K1")], keys=keys).sow_key == "K1"
    with pytest.raises(InputError, match="sow-key header"):
        parse(b'{"a": 1}', keys=keys)
    assert parse(None, [("sow-command", b"sow_delete"), ("sow-key", b"K1")], keys=keys).sow_key == "K1"


def test_unrelated_headers_ignored():
    assert header_map([("traceparent", b"\xff\xfe"), ("sow-key", b"x")]) == {"sow-key": "x"}


@pytest.mark.parametrize("value", [b'{"id": 18446744073709551616}', b'{"id": 1, "n": [-9223372036854775809]}',
                                   b'{"id": 1, "deep": {"n": 123456789012345678901234567890}}'])
def test_an_integer_json_cannot_keep_exactly_is_an_error_not_a_float(value):
    """orjson would read it as a float: two IDs differing in their last digits would share a SowKey."""
    with pytest.raises(InputError, match="outside the 64-bit range"):
        parse(value)


@given(st.integers(-(1 << 63), (1 << 64) - 1), st.text(alphabet="0123456789-", max_size=40))
def test_integers_in_range_and_digit_strings_are_kept_exactly(n, digits):
    cmd = parse(orjson.dumps({"id": n, "s": digits}))
    assert cmd.data == {"id": n, "s": digits} and type(cmd.data["id"]) is int


def test_headers_the_kafka_client_could_not_read_refuse_the_input():
    """Such a message is refused with the reason, never applied as if it carried no header."""
    with pytest.raises(InputError, match="a header name is not UTF-8 text"):
        header_map(UnreadableHeaders())


@pytest.mark.parametrize("headers,says", [
    ([("Sow-Command", b"sow_delete")], "unknown header 'Sow-Command'"),
    ([("sow-expire", b"5s")], "unknown header 'sow-expire'"),
    ([("SOW-KEY", b"abc")], "unknown header 'SOW-KEY'"),
    ([("sow-filter", b"/id = 3")], "sow-filter goes with sow-command: sow_delete, and this input is a publish"),
    ([("sow-command", b"delta_publish"), ("sow-keys", b"a1")], "sow-keys goes with sow-command: sow_delete, and this input is a delta_publish"),
])
def test_headers_that_would_be_ignored_are_errors(headers, says):
    """Each was ignored and the input applied as a publish: `Sow-Command: sow_delete` wrote the
    record it meant to delete, `sow-expire: 5s` gave it no lifetime, `sow-filter` without a
    sow_delete published the value."""
    with pytest.raises(InputError, match=re.escape(says)):
        parse(b'{"id": 3}', headers)


def test_output_and_error_headers_on_an_input_are_read_as_any_input():
    """A `.sow` or `.errors` record published again carries ksow's own headers: not misspelt ones."""
    headers = [(h, b"1") for h in ("sow-op", "sow-seq", "sow-expires-at", "sow-actual-expiry", "sow-topic", "sow-oof-reason",
                                   "sow-error", "sow-error-topic", "sow-error-partition", "sow-error-offset", "x-trace", "Sow")]
    assert parse(b'{"id": 3}', headers).data == {"id": 3}
