"""Seeding a view's `<view>.sow` from the records a partition already holds: which views a partition
must seed, given the views mark its inputs' committed offsets carry, and what a seed writes."""

import pytest

from processor.contract.types import SowRecord
from processor.engine.views import views_mark, views_of, views_to_seed
from processor.topology import MAX_VIEWS_PER_TOPIC, TopologyError, parse_topology


def _views(*defs: dict) -> list:
    topology = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1}],
                               "views": [{"topic": "orders", **d} for d in defs]})
    return views_of(topology.topic("orders"), topology.views_of("orders"))


OPEN = {"name": "open", "filter": "/status = 'open'"}
BIG = {"name": "big", "filter": "/qty > 10", "select": ["/qty"]}


def test_a_partition_whose_inputs_carry_the_views_as_they_are_seeds_none():
    views = _views(OPEN, BIG)
    mark = views_mark(views)
    assert views_to_seed(views, [mark, mark, None]) == ([], True)  # an input never committed says nothing


def test_a_view_added_to_the_topic_is_seeded():
    before, after = _views(OPEN), _views(OPEN, BIG)
    assert [v.view.name for v in views_to_seed(after, [views_mark(before)] * 3)[0]] == ["big"]


def test_a_view_whose_filter_changed_is_seeded():
    before = _views(OPEN, BIG)
    after = _views(OPEN, {**BIG, "filter": "/qty > 100"})
    assert [v.view.name for v in views_to_seed(after, [views_mark(before)] * 2)[0]] == ["big"]


@pytest.mark.parametrize("change", [{"select": ["/qty", "/status"]}, {"options": ["oof"]}])
def test_a_view_whose_select_list_or_options_changed_is_seeded(change):
    before, after = _views(BIG), _views({**BIG, **change})
    assert [v.view.name for v in views_to_seed(after, [views_mark(before)])[0]] == ["big"]


def test_with_no_mark_at_all_every_view_is_returned_and_its_topic_decides():
    """Offsets committed by a release before views were seeded, or none committed yet."""
    views = _views(OPEN, BIG)
    seeding, marked = views_to_seed(views, [None, "", "something else"])
    assert [v.view.name for v in seeding] == ["open", "big"] and not marked


def test_a_view_counts_as_seeded_only_when_every_marked_input_names_it():
    """Inputs whose marks disagree (one committed since the seed, one not): seeded again."""
    before, after = _views(OPEN), _views(OPEN, BIG)
    seeding, marked = views_to_seed(after, [views_mark(after), views_mark(before)])
    assert [v.view.name for v in seeding] == ["big"] and marked


def test_the_seed_writes_what_the_view_selects_and_tombstones_the_rest_when_asked():
    (view,) = _views({**BIG, "filter": "/qty > 10"})
    records = [("k1", SowRecord({"id": 1, "qty": 50, "status": "open"}, 7, 1_000, 5)),
               ("k2", SowRecord({"id": 2, "qty": 5, "status": "open"}, 8, None, 5))]
    seeded = view.seed(0, records, tombstones=True)
    assert [(o.topic, o.key, o.value) for o in seeded] == [("big.sow", b"k1", b'{"id":1,"qty":50}'), ("big.sow", b"k2", None)]
    assert dict(seeded[0].headers) == {"sow-key": b"k1", "sow-seq": b"7", "sow-expires-at": b"1000", "sow-op": b"insert"}
    assert dict(seeded[1].headers)["sow-op"] == b"oof"
    assert [o.key for o in view.seed(0, records, tombstones=False)] == [b"k1"]  # an empty `<view>.sow`: no tombstones


def test_a_topology_with_more_views_of_a_topic_than_a_mark_holds_is_refused():
    views = [{"name": f"v{i}", "topic": "orders", "filter": "1=1"} for i in range(MAX_VIEWS_PER_TOPIC + 1)]
    with pytest.raises(TopologyError, match="over the limit of 256"):
        parse_topology({"sow": [{"topic": "orders", "key": ["/id"]}], "views": views})
    assert len(views_mark(_views(*views[:MAX_VIEWS_PER_TOPIC]))) < 4096
