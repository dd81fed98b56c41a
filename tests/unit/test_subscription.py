"""What a subscriber sees: seed 001's examples, focus (oof), select lists, empties, conflation."""

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from processor.contract.types import Op
from processor.core.merge import merge
from processor.core.subscription import SubscriptionSpec, conflate, conflate_event

ORDER_KEY = (("order",),)
ID_KEY = (("id",),)


def open_only(record):
    return record.get("status") == "open"


def test_delta_of_an_order_status_update():
    sub = SubscriptionSpec(delta=True, key_paths=ORDER_KEY)
    before = {"order": 3, "customer": "Patrick", "status": "open", "qty": 1000, "ticker": "MSFT"}
    after = {**before, "status": "pending"}
    event = sub.change(Op.UPDATE, "K3", 12, before, after)
    assert event == {"op": "update", "sow_key": "K3", "seq": 12, "record": {"order": 3, "status": "pending"}}


def test_a_subscription_limited_to_sowkeys_sees_only_those_records():
    """sow_and_subscribe may name a set of SowKeys (seed 003, SOW keys): the snapshot, the live
    changes and a resume's changes of other records are not the subscriber's."""
    sub = SubscriptionSpec(oof=True, key_paths=ID_KEY, keys=frozenset({"K1"}))
    one, two = {"id": 1, "status": "open"}, {"id": 2, "status": "open"}
    assert sub.snapshot("K1", 1, one) == {"op": "sow", "sow_key": "K1", "seq": 1, "record": one}
    assert sub.snapshot("K2", 2, two) is None
    assert sub.change(Op.UPDATE, "K1", 3, one, {**one, "qty": 5})["op"] == "update"
    assert sub.change(Op.INSERT, "K2", 4, None, two) is None
    assert sub.change(Op.DELETE, "K2", 5, two, None) is None
    assert sub.change(Op.DELETE, "K1", 6, one, None)["reason"] == "delete"
    assert sub.resumed(Op.UPDATE, "K2", 7, two) is None and sub.resumed(Op.DELETE, "K2", 8, None) is None
    assert sub.resumed(Op.UPDATE, "K1", 9, one)["op"] == "sow"
    assert SubscriptionSpec(key_paths=ID_KEY).snapshot("K2", 2, two) is not None  # no keys: every record


def test_conflated_sequence_for_id_99():
    sub = SubscriptionSpec(delta=True, key_paths=ID_KEY)
    states = [
        {"id": 99, "status": "open", "notes": "none", "xref": 82},
        {"id": 99, "status": "questioned", "notes": "none", "xref": 82},
        {"id": 99, "status": "questioned", "notes": "jcarlo hold", "xref": 82},
        {"id": 99, "status": "cleared", "notes": "none", "xref": 82},
        {"id": 99, "status": "open", "notes": "none", "xref": 82},
    ]
    pending = None
    for before, after in zip(states, states[1:]):
        pending = conflate(pending, sub.change(Op.UPDATE, "K99", None, before, after)["record"])
    assert pending == {"id": 99, "status": "open", "notes": "none"}


def test_select_list_with_no_empties_ignores_other_fields():
    sub = SubscriptionSpec(delta=True, no_empties=True, select=("/qty",), key_paths=ORDER_KEY)
    before = {"order": 1, "qty": 5, "note": "a"}
    assert sub.change(Op.UPDATE, "K", 1, before, {**before, "note": "b"}) is None
    assert sub.change(Op.UPDATE, "K", 2, before, {**before, "qty": 6})["record"] == {"order": 1, "qty": 6}
    assert sub.snapshot("K", 1, before)["record"] == {"order": 1, "qty": 5}


def test_empties_are_sent_unless_no_empties():
    record = {"order": 1, "qty": 5}
    assert SubscriptionSpec(delta=True, key_paths=ORDER_KEY).change(Op.UPDATE, "K", 1, record, dict(record))["record"] == {"order": 1}
    assert SubscriptionSpec(delta=True, no_empties=True, key_paths=ORDER_KEY).change(Op.UPDATE, "K", 1, record, dict(record)) is None


def test_out_of_focus_for_each_reason():
    sub = SubscriptionSpec(filter=open_only, oof=True, delta=True, key_paths=ID_KEY)
    rec = {"id": 1, "status": "open"}
    for op in (Op.DELETE, Op.EXPIRE, Op.EVICT):
        event = sub.change(op, "K", 5, rec, None)
        assert event["op"] == "oof" and event["reason"] == op.value and event["record"] == rec
    moved = sub.change(Op.UPDATE, "K", 6, rec, {"id": 1, "status": "done"})
    assert moved["op"] == "oof" and moved["reason"] == "no_match" and moved["record"] == {"id": 1, "status": "done"}


def test_without_oof_leaving_records_are_silent_and_coming_back_is_a_delta():
    sub = SubscriptionSpec(filter=open_only, delta=True, key_paths=ID_KEY)
    assert sub.change(Op.DELETE, "K", 1, {"id": 1, "status": "open"}, None) is None
    back = sub.change(Op.UPDATE, "K", 2, {"id": 1, "status": "done", "q": 1}, {"id": 1, "status": "open", "q": 1})
    assert back["record"] == {"id": 1, "status": "open"}


def test_oof_delivers_the_full_record_when_it_comes_into_focus():
    sub = SubscriptionSpec(filter=open_only, oof=True, delta=True, key_paths=ID_KEY)
    back = sub.change(Op.UPDATE, "K", 2, {"id": 1, "status": "done", "q": 1}, {"id": 1, "status": "open", "q": 1})
    assert back["record"] == {"id": 1, "status": "open", "q": 1}


def test_no_sowkey_and_full_records():
    sub = SubscriptionSpec(no_sowkey=True)
    event = sub.change(Op.UPDATE, "K", 3, {"id": 1, "a": 1}, {"id": 1, "a": 2})
    assert "sow_key" not in event and event["record"] == {"id": 1, "a": 2}
    assert sub.snapshot("K", 1, {"id": 1}) == {"op": "sow", "seq": 1, "record": {"id": 1}}


def test_conflation_merges_deltas_and_keeps_the_last_full_record():
    """A regular subscriber gets whole records: within an interval the last one replaces what was
    waiting (a field the last publish removed stays removed); a delta subscriber's deltas merge."""
    first = {"op": "insert", "record": {"id": 1, "status": "open", "note": "rush", "m": {"a": 1}}}
    last = {"op": "update", "record": {"id": 1, "status": "done", "m": {"b": 2}}}
    assert conflate_event(first, last, delta=False) == (None, {"op": "insert", "record": {"id": 1, "status": "done", "m": {"b": 2}}})
    assert conflate_event(first, last, delta=True)[1]["record"] == {"id": 1, "status": "done", "note": "rush", "m": {"a": 1, "b": 2}}
    gone = {"op": "delete", "record": {"id": 1}}
    assert conflate_event(last, gone, delta=True) == (None, gone)


def test_a_record_in_and_out_within_one_interval_is_never_told():
    """Audit: a record that came into a conflated subscription and left it within one interval gave
    an oof for a record the subscriber never had. It now gives nothing (the oof or removal cancels
    the insert that was waiting); one the subscriber had still gets its oof."""
    sub = SubscriptionSpec(filter=lambda r: r["region"] == "EU", oof=True, key_paths=(("id",),))
    came = sub.change(Op.UPDATE, "k", 1, {"id": 1, "region": "US"}, {"id": 1, "region": "EU"})
    left = sub.change(Op.UPDATE, "k", 2, {"id": 1, "region": "EU"}, {"id": 1, "region": "US"})
    assert came["op"] == "insert"  # new to this subscriber, though an update to the SOW
    assert left["op"] == "oof" and left["reason"] == "no_match"
    assert conflate_event(came, left, delta=False) == (None, None)
    deleted = sub.change(Op.DELETE, "k", 3, {"id": 1, "region": "EU"}, None)
    assert conflate_event(came, deleted, delta=True) == (None, None)
    had = sub.change(Op.UPDATE, "k", 1, {"id": 1, "region": "EU", "q": 1}, {"id": 1, "region": "EU", "q": 2})
    assert had["op"] == "update" and conflate_event(had, left, delta=False) == (None, left)
    # Audit (the fix above): out, back in and out again within one interval said nothing at all,
    # and the subscriber kept a record that had left. Its leave goes at once when it comes back.
    assert conflate_event(left, came, delta=False) == (left, came)


def _apply(held: dict, key: str, event: dict, delta: bool) -> None:
    """A subscriber: a whole record replaces, a delta merges, a leave removes."""
    op = event["op"]
    if op in ("oof", "delete", "expire", "evict"):
        held.pop(key, None)
    elif delta and op == "update" and key in held:
        held[key] = merge(held[key], event["record"])
    else:
        held[key] = event["record"]


_CHANGES = st.lists(st.tuples(st.sampled_from(["publish", "delta", "delete"]), st.sampled_from(["EU", "US"]),
                              st.integers(0, 3), st.booleans(), st.booleans()), min_size=1, max_size=25)


def _tell_both(plain: dict, conflated: dict, pending: dict | None, event: dict, delta: bool) -> dict | None:
    """An event to an unconflated subscriber at once, and through conflation to another; what the
    conflated one holds after it."""
    _apply(plain, "k", event, delta)
    now_sent, pending = conflate_event(pending, event, delta)
    if now_sent is not None:
        _apply(conflated, "k", now_sent, delta)
    return pending


def _end_interval(conflated: dict, pending: dict | None, delta: bool) -> None:
    """The conflation interval ends: the held event goes."""
    if pending is not None:
        _apply(conflated, "k", pending, delta)


@given(_CHANGES, st.booleans(), st.booleans())
def test_a_conflated_subscriber_ends_each_interval_where_an_unconflated_one_is(changes, delta, oof):
    """Whatever a record goes through within an interval (in and out of the filter, deleted and
    published again, fields added and removed), what conflation sends takes the subscriber to the
    state the events one by one would have. Without oof, leaves are told to neither: the interval
    sends the record as it last matched, even after it left (audit: that is what the events one by
    one leave with the subscriber, and what AMPS conflation sends)."""
    sub = SubscriptionSpec(filter=lambda r: r.get("region") == "EU", delta=delta, oof=oof, key_paths=(("id",),))
    record: dict | None = None
    plain: dict = {}
    conflated: dict = {}
    pending: dict | None = None
    for n, (kind, region, q, extra, flush) in enumerate(changes):
        before = record
        if kind == "delete":
            if record is None:
                continue
            after, op = None, Op.DELETE
        elif kind == "delta" and record is not None:
            fields = {"id": 1, "region": region, "q": q, **({"x": n} if extra else {})}
            after, op = {**record, **fields}, Op.UPDATE
        else:  # a publish (a delta on no record becomes the record)
            after = {"id": 1, "region": region, "q": q, **({"x": n} if extra else {})}
            op = Op.UPDATE if record is not None else Op.INSERT
        record = after
        event = sub.change(op, "k", n, before, after)
        if event is None:
            continue
        pending = _tell_both(plain, conflated, pending, event, delta)
        if flush:
            pending = _end_interval(conflated, pending, delta)
            assert conflated == plain, (changes, delta, oof)


def test_a_selected_nested_field_the_change_took_away_comes_as_null():
    """Audit: with `select: [/n/x]`, a full publish without `n`, or a delta that made `n` a number,
    told a delta subscriber nothing (with no_empties) or an update without the removal."""
    for no_empties in (False, True):
        sub = SubscriptionSpec(delta=True, no_empties=no_empties, select=("/n/x",), key_paths=ID_KEY)
        before = {"id": 1, "n": {"x": 1, "y": 2}}
        for after in ({"id": 1}, {"id": 1, "n": 5}, {"id": 1, "n": None}, {"id": 1, "n": [1]}, {"id": 1, "n": {"y": 2}}):
            assert sub.change(Op.UPDATE, "K", 2, before, after)["record"] == {"id": 1, "n": {"x": None}}
        # a field it never had, taken away again: nothing changed for this subscriber
        unselected = sub.change(Op.UPDATE, "K", 3, {"id": 1, "n": {"y": 2}}, {"id": 1})
        assert (unselected is None) if no_empties else unselected["record"] == {"id": 1}


leaf = st.sampled_from([0, 1, 0.0, 1.0, False, True, "a"])
tree = st.recursive(leaf | st.lists(leaf, max_size=2), lambda inner: st.dictionaries(st.sampled_from("nxy"), inner, max_size=3), max_leaves=6)
with_id = st.dictionaries(st.sampled_from("nxy"), tree, max_size=3).map(lambda r: {"id": 1, **r})
select_paths = st.lists(st.sampled_from(["/n", "/n/x", "/n/x/y", "/x", "/y/n"]), min_size=1, max_size=3, unique=True)


def _without_nulls(value):
    """A delta subscriber's copy, where null means removed (the records here hold no nulls)."""
    if not isinstance(value, dict):
        return value
    out = {}
    for name, v in value.items():
        v = _without_nulls(v)
        if v is not None and v != {}:
            out[name] = v
    return out


@settings(max_examples=300)
@given(with_id, with_id, select_paths)
def test_a_delta_subscriber_with_a_select_list_ends_with_the_selected_record(before, after, select):
    """Merging each delta (null: removed) into what the subscriber held gives the select list of the
    record, as the same JSON (1, 1.0 and True differ)."""
    sub = SubscriptionSpec(delta=True, select=tuple(select), key_paths=ID_KEY)
    event = sub.change(Op.UPDATE, "K", 2, before, after)
    held = _without_nulls(merge(sub.shape(before), event["record"]))
    dumps = lambda v: orjson.dumps(v, option=orjson.OPT_SORT_KEYS)  # noqa: E731
    assert dumps(held) == dumps(_without_nulls(sub.shape(after)))


def test_a_resumed_removal_says_which_record_went_without_a_sowkey():
    """Audit: with no_sowkey, a removal on resume carried neither the SowKey nor a record."""
    plain = SubscriptionSpec(key_paths=ID_KEY)
    assert plain.resumed(Op.DELETE, "K", 7, None, None, {"id": 1, "v": 2}) == {"op": "delete", "sow_key": "K", "seq": 7, "record": None}
    quiet = SubscriptionSpec(no_sowkey=True, oof=True, key_paths=ID_KEY)
    assert quiet.resumed(Op.EXPIRE, "K", 7, None, None, {"id": 1, "v": 2}) == {"op": "expire", "seq": 7, "record": {"id": 1}}
    # the version removed unknown to the reader, or no key fields (publisher SowKeys): the SowKey says which
    assert quiet.resumed(Op.DELETE, "K", 7, None) == {"op": "delete", "seq": 7, "record": None, "sow_key": "K"}
    assert SubscriptionSpec(no_sowkey=True).resumed(Op.DELETE, "K", 7, None, None, {"v": 2})["sow_key"] == "K"


@pytest.mark.parametrize("steps", [
    [{"id": 1, "m": {"x": 0, "y": 0}}, {"id": 1}, {"id": 1, "m": {"x": 1}}],  # removed, back smaller
    [{"id": 1, "m": {"x": 0, "y": 0}}, {"id": 1, "m": 5}, {"id": 1, "m": {"x": 1}}],  # a number, then an object again
    [{"id": 1, "m": {"x": 0, "y": 0}}, {"id": 1, "m": [1]}, {"id": 1, "m": {"x": 1}}],  # an array, then an object
    [{"id": 1, "m": {"x": {"a": 0, "b": 0}}}, {"id": 1, "m": {"x": 3}}, {"id": 1, "m": {"x": {"a": 1}}}],  # one level down
])
def test_a_conflated_delta_subscriber_gets_an_object_back_whole_after_its_removal(steps):
    """Audit: `m` removed (delta null), then published again with fewer fields, within one
    interval: the merged delta {"m": {"x": 1}} was merged into the subscriber's old `m`, which
    kept "y", where the events one by one leave {"x": 1}. The held delta now goes at once."""
    sub = SubscriptionSpec(delta=True, key_paths=ID_KEY)
    plain, conflated = {"k": steps[0]}, {"k": steps[0]}
    pending = None
    for n, (before, after) in enumerate(zip(steps, steps[1:])):
        event = sub.change(Op.UPDATE, "k", n, before, after)
        _apply(plain, "k", event, True)
        now_sent, pending = conflate_event(pending, event, True)
        if now_sent is not None:
            _apply(conflated, "k", now_sent, True)
    _apply(conflated, "k", pending, True)
    assert _without_nulls(plain["k"]) == steps[-1]
    assert _without_nulls(conflated["k"]) == steps[-1]


nested_record = st.fixed_dictionaries({"id": st.just(1), "region": st.sampled_from(["EU", "US"])},
                                      optional={"m": st.one_of(st.integers(0, 2), st.dictionaries(st.sampled_from("xy"), st.integers(0, 2) | st.dictionaries(st.sampled_from("ab"), st.integers(0, 2), max_size=2), max_size=2))})


@settings(max_examples=300)
@given(st.lists(st.tuples(nested_record, st.booleans()), min_size=1, max_size=12), st.booleans())
@example([({"id": 1, "region": "EU", "m": {"x": 0, "y": 0}}, True), ({"id": 1, "region": "EU"}, False),
          ({"id": 1, "region": "EU", "m": {"x": 1}}, False)], False)
def test_a_conflated_delta_subscriber_ends_each_interval_where_an_unconflated_one_is_with_nested_objects(changes, oof):
    """As the test above for flat records, with objects that come, go, shrink and turn into numbers."""
    sub = SubscriptionSpec(filter=lambda r: r.get("region") == "EU", delta=True, oof=oof, key_paths=ID_KEY)
    record = None
    plain: dict = {}
    conflated: dict = {}
    pending = None
    for n, (after, flush) in enumerate(changes + [(None, True)]):
        if after is None and record is None:
            break
        before, record = record, after
        op = Op.DELETE if after is None else Op.UPDATE if before is not None else Op.INSERT
        event = sub.change(op, "k", n, before, after)
        if event is not None:
            pending = _tell_both(plain, conflated, pending, event, True)
        if flush:
            pending = _end_interval(conflated, pending, True)
            assert {k: _without_nulls(v) for k, v in conflated.items()} == {k: _without_nulls(v) for k, v in plain.items()}, changes


def test_no_empties_sends_no_update_that_tells_nothing():
    """Audit (seed 001, no_empties): a zero inside an object that changed sign gave a no_empties
    delta subscriber an update of {"m": {}}, no field in it; it now tells the changed value."""
    sub = SubscriptionSpec(delta=True, no_empties=True, key_paths=ID_KEY)
    event = sub.change(Op.UPDATE, "K", 1, {"id": 1, "m": {"x": 0.0}}, {"id": 1, "m": {"x": -0.0}})
    assert orjson.dumps(event["record"]) == b'{"id":1,"m":{"x":-0.0}}'
