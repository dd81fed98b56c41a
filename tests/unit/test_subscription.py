"""What a subscriber sees: seed 001's examples, focus (oof), select lists, empties, conflation."""

from processor.contract.types import Op
from processor.core.subscription import SubscriptionSpec, conflate

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
    from processor.core.subscription import conflate_event

    first = {"op": "insert", "record": {"id": 1, "status": "open", "note": "rush", "m": {"a": 1}}}
    last = {"op": "update", "record": {"id": 1, "status": "done", "m": {"b": 2}}}
    assert conflate_event(first, last, delta=False) == {"op": "insert", "record": {"id": 1, "status": "done", "m": {"b": 2}}}
    assert conflate_event(first, last, delta=True)["record"] == {"id": 1, "status": "done", "note": "rush", "m": {"a": 1, "b": 2}}
    gone = {"op": "delete", "record": {"id": 1}}
    assert conflate_event(last, gone, delta=True) is gone and conflate_event(gone, last, delta=False) is last


def test_a_record_in_and_out_within_one_interval_is_never_told():
    """Audit: a record that came into a conflated subscription and left it within one interval gave
    an oof for a record the subscriber never had. It now gives nothing (the oof or removal cancels
    the insert that was waiting); one the subscriber had still gets its oof."""
    from processor.core.subscription import conflate_event

    sub = SubscriptionSpec(filter=lambda r: r["region"] == "EU", oof=True, key_paths=(("id",),))
    came = sub.change(Op.UPDATE, "k", 1, {"id": 1, "region": "US"}, {"id": 1, "region": "EU"})
    left = sub.change(Op.UPDATE, "k", 2, {"id": 1, "region": "EU"}, {"id": 1, "region": "US"})
    assert came["op"] == "insert"  # new to this subscriber, though an update to the SOW
    assert left["op"] == "oof" and left["reason"] == "no_match"
    assert conflate_event(came, left, delta=False) is None
    deleted = sub.change(Op.DELETE, "k", 3, {"id": 1, "region": "EU"}, None)
    assert conflate_event(came, deleted, delta=True) is None
    had = sub.change(Op.UPDATE, "k", 1, {"id": 1, "region": "EU", "q": 1}, {"id": 1, "region": "EU", "q": 2})
    assert had["op"] == "update" and conflate_event(had, left, delta=False) is left
