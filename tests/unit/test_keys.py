"""SowKeys: deterministic over domain + values, independent of field order; owner partitions."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from processor.core.keys import KeyError_, KeySpec, murmur2, owner_partition

ORDERS = KeySpec("orders", ("/order_id",))


def test_same_values_same_key_and_domain_matters():
    a = ORDERS.sow_key({"order_id": 5, "x": 1})
    assert a == ORDERS.sow_key({"x": 2, "order_id": 5})
    assert a != ORDERS.sow_key({"order_id": 6})
    assert a != KeySpec("other", ("/order_id",)).sow_key({"order_id": 5})
    assert a == KeySpec("orders", ("/order_id",)).sow_key({"order_id": 5})


def test_types_are_part_of_the_value():
    assert ORDERS.sow_key({"order_id": 5}) != ORDERS.sow_key({"order_id": "5"})


def test_composite_and_nested_keys():
    spec = KeySpec("t", ("/a/b", "/c"))
    assert spec.sow_key({"a": {"b": 1}, "c": "x"}) == spec.sow_key({"c": "x", "a": {"z": 0, "b": 1}})
    assert spec.sow_key({"a": {"b": 1}, "c": "x"}) != spec.sow_key({"a": {"b": "x"}, "c": 1})


@pytest.mark.parametrize("record,reason", [({}, "missing key field /order_id"), ({"order_id": None}, "missing"), ({"order_id": [1]}, "scalar")])
def test_missing_or_bad_key_fields(record, reason):
    with pytest.raises(KeyError_, match=reason):
        ORDERS.sow_key(record)


def test_user_supplied_keys():
    spec = KeySpec("t")
    assert spec.user_keys
    assert spec.sow_key({"any": 1}, "abc123==") == "abc123=="
    with pytest.raises(KeyError_, match="sow-key header"):
        spec.sow_key({"any": 1})
    with pytest.raises(KeyError_, match="Base64"):
        spec.sow_key({}, "no spaces!")


@given(st.dictionaries(st.text(min_size=1, max_size=4), st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=6), st.randoms())
def test_key_independent_of_field_order(fields, rnd):
    spec = KeySpec("d", tuple("/" + k for k in fields if "/" not in k) or ("/x",))
    record = dict(fields, x=1)
    items = list(record.items())
    rnd.shuffle(items)
    assert spec.sow_key(record) == spec.sow_key(dict(items))


def test_murmur2_matches_kafka_java_client():
    # Values from Kafka's own UtilsTest (org.apache.kafka.common.utils).
    assert murmur2(b"21") == -973932308
    assert murmur2(b"foobar") == -790332482
    assert murmur2(b"a-little-bit-long-string") == -985981536
    assert murmur2(b"a-little-bit-longer-string") == -1486304829
    assert murmur2(b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8") == -58897971
    assert murmur2(b"abc") == 479470107


@given(st.text(min_size=1), st.integers(1, 64))
def test_owner_partition_in_range(key, n):
    assert 0 <= owner_partition(key, n) < n
