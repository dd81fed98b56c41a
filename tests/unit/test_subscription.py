"""What a subscriber sees: seed 001's examples, focus (oof), select lists, empties, conflation."""

from hypothesis import given
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


@given(_CHANGES, st.booleans(), st.booleans())
def test_a_conflated_subscriber_ends_each_interval_where_an_unconflated_one_is(changes, delta, oof):
    """Whatever a record goes through within an interval (in and out of the filter, deleted and
    published again, fields added and removed), what conflation sends takes the subscriber to the
    state the events one by one would have. Without oof the filter is 1=1 (a subscriber that is not
    told of leaves cannot be held to one)."""
    sub = SubscriptionSpec(filter=(lambda r: r.get("region") == "EU") if oof else (lambda r: True), delta=delta, oof=oof, key_paths=(("id",),))
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
        _apply(plain, "k", event, delta)
        now_sent, pending = conflate_event(pending, event, delta)
        if now_sent is not None:
            _apply(conflated, "k", now_sent, delta)
        if flush:
            if pending is not None:
                _apply(conflated, "k", pending, delta)
            pending = None
            assert conflated == plain, (changes, delta, oof)
