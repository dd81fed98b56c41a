"""Delta publish merge and diff: seed 001's rules, and properties that tie them together."""

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from processor.core.merge import changed_fields, diff, has_data_changes, merge

KEY = (("id",),)

scalars = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), st.text(max_size=5))
names = st.sampled_from(["a", "b", "c", "d", "e"])
values = st.recursive(scalars | st.lists(scalars, max_size=3), lambda inner: st.dictionaries(names, inner, max_size=4), max_leaves=10)
records = st.dictionaries(names, values, max_size=5)


def test_absent_fields_unchanged_present_fields_replace():
    existing = {"id": 735, "customer": "Patrick", "item": 90123, "qty": 1000, "state": "new"}
    after = merge(merge(existing, {"id": 735, "inventory": "available"}), {"id": 735, "credit": "approved"})
    assert after == {**existing, "inventory": "available", "credit": "approved"}


def test_arrays_replace_whole_and_nested_objects_merge_by_name():
    doc = {"id": 42, "contents": {"packages": [{"box": "chocolates"}, {"bowl": "noodles"}], "owner": "x"}}
    out = merge(doc, {"id": 42, "contents": {"packages": [{"basket": "eggs"}]}})
    assert out == {"id": 42, "contents": {"packages": [{"basket": "eggs"}], "owner": "x"}}


def test_delta_cannot_remove_a_field():
    assert merge({"id": 42, "flowers": "roses"}, {"id": 42}) == {"id": 42, "flowers": "roses"}


def test_merge_does_not_modify_its_arguments():
    old, delta = {"id": 1, "n": {"a": 1}}, {"n": {"b": 2}}
    merge(old, delta)
    assert old == {"id": 1, "n": {"a": 1}} and delta == {"n": {"b": 2}}


def test_diff_has_key_fields_first_and_only_changes():
    old = {"order": 3, "customer": "Patrick", "status": "open", "qty": 1000, "ticker": "MSFT"}
    new = {**old, "status": "pending"}
    d = diff(old, new, (("order",),))
    assert d == {"order": 3, "status": "pending"}
    assert list(d) == ["order", "status"]


def test_diff_nested_and_removed_fields():
    old = {"id": 1, "m": {"a": 1, "b": 2}, "gone": True}
    new = {"id": 1, "m": {"a": 1, "b": 3}}
    assert diff(old, new, KEY) == {"id": 1, "m": {"b": 3}, "gone": None}


def test_diff_of_insert_is_the_record_and_type_changes_count():
    assert diff(None, {"id": 1, "x": 2}, KEY) == {"id": 1, "x": 2}
    assert changed_fields({"x": 1}, {"x": 1.0}) == {"x": 1.0}
    assert changed_fields({"x": 1}, {"x": True}) == {"x": True}


def test_nested_key_paths_kept_in_diff():
    old = {"k": {"region": "EU", "id": 5}, "v": 1}
    new = {"k": {"region": "EU", "id": 5}, "v": 2}
    assert diff(old, new, (("k", "region"), ("k", "id"))) == {"k": {"region": "EU", "id": 5}, "v": 2}


def test_empties():
    assert not has_data_changes({"id": 1}, KEY)
    assert has_data_changes({"id": 1, "x": 2}, KEY)
    assert not has_data_changes({"k": {"a": 1}}, (("k", "a"),))


@given(records)
def test_delta_on_nothing_is_the_delta(delta):
    assert merge(None, delta) == delta


@given(records, records)
def test_merging_a_records_own_diff_gives_the_record(old, new):
    merged = merge(old, diff(old, new, ()))
    # Fields removed by a full publish come back as null: a delta cannot remove a field.
    removed = {k: None for k in old if k not in new}
    assert merged == _with_nulls(new, old)
    assert all(merged[k] is None for k in removed)


def _with_nulls(new, old):
    out = dict(new)
    for k, v in old.items():
        if k not in new:
            out[k] = None
        elif isinstance(v, dict) and isinstance(new[k], dict):
            out[k] = _with_nulls(new[k], v)
    return out


@given(records, records, records)
@settings(max_examples=200)
def test_merge_is_idempotent_per_delta(base, d1, d2):
    once = merge(merge(base, d1), d2)
    assert merge(once, d2) == once


@given(records)
def test_no_changes_means_only_keys(rec):
    rec = {**rec, "id": 7}
    assert diff(rec, rec, KEY) == {"id": 7}


def test_a_change_of_type_inside_an_object_or_an_array_is_a_change():
    """Audit: Python's == calls [0, 1] and [False, True], or {"k": 1} and {"k": True}, equal, and
    the diff left them out; a delta subscriber kept the old values."""
    old = {"id": 1, "arr": [0, 1], "n": {"k": 1, "m": {"z": 2}}}
    assert diff(old, {**old, "arr": [False, True]}, KEY) == {"id": 1, "arr": [False, True]}
    assert diff(old, {**old, "n": {"k": True, "m": {"z": 2}}}, KEY) == {"id": 1, "n": {"k": True}}
    assert diff(old, {**old, "n": {"k": 1, "m": {"z": 2.0}}}, KEY) == {"id": 1, "n": {"m": {"z": 2.0}}}
    assert diff(old, {"id": 1, "n": {"m": {"z": 2}, "k": 1}, "arr": [0, 1]}, KEY) == {"id": 1}  # the same JSON


def _json(value) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


confusable = st.sampled_from([0, 1, 0.0, -0.0, 1.0, False, True, "1"])  # equal in Python, not in JSON
confusable_records = st.dictionaries(names, st.recursive(confusable | st.lists(confusable, max_size=2),
                                                         lambda inner: st.dictionaries(names, inner, max_size=2), max_leaves=4), max_size=3)


@settings(max_examples=300)
@given(confusable_records, confusable_records)
def test_a_records_own_diff_takes_the_old_one_to_the_same_json(old, new):
    """As test_merging_a_records_own_diff_gives_the_record, with types compared: 1, 1.0 and True differ."""
    assert _json(merge(old, diff(old, new, ()))) == _json(_with_nulls(new, old))


def test_a_zero_that_changed_sign_is_a_change_at_every_depth():
    """Audit: 0.0 -> -0.0 (two JSON texts) was no change at the top level, a change inside an
    array, and inside an object an empty object ({"m": {}}) that tells a subscriber nothing."""
    for old, new, told in (
        ({"id": 1, "x": 0.0}, {"id": 1, "x": -0.0}, {"id": 1, "x": -0.0}),
        ({"id": 1, "m": {"x": -0.0}}, {"id": 1, "m": {"x": 0.0}}, {"id": 1, "m": {"x": 0.0}}),
        ({"id": 1, "a": [0.0]}, {"id": 1, "a": [-0.0]}, {"id": 1, "a": [-0.0]}),
    ):
        d = diff(old, new, KEY)
        assert _json(d) == _json(told), (old, new, d)
        assert _json(merge(old, d)) == _json(new)
    assert diff({"id": 1, "x": -0.0, "m": {"y": 0.0}}, {"id": 1, "x": -0.0, "m": {"y": 0.0}}, KEY) == {"id": 1}
