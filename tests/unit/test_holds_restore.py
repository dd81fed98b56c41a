"""`<topic>.holds` records that parse as held view events but that a worker never writes."""

import time

from processor.contract.types import InputMessage
from processor.testing import LocalTopic
from processor.topology import parse_topology


def _view(tmp_path):
    topology = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1}],
                               "views": [{"name": "conf", "topic": "orders", "filter": "1=1", "conflation": "1s"}]})
    proc = LocalTopic(topology.topic("orders"), tmp_path, views=topology.views_of("orders"))
    proc.open(0)
    (view,) = proc.engine.views
    return proc, view


def test_a_held_record_nested_past_what_orjson_writes_is_skipped_not_a_crash_at_release(tmp_path):
    """A held event nested 300 levels deep was taken back, then its release (orjson writes 254
    levels at most) raised out of the sweep: the worker stopped, and again at every restart."""
    proc, view = _view(tmp_path)
    depth = 300
    view.restore_hold(0, b"0|x", b'{"due": 0, "event": {"op": "update", "record": {"d": ' + b"[" * depth + b"]" * depth
                      + b'}}, "headers": []}')
    view.restore_hold(0, b"0|y", b'{"due": 0, "event": {"op": "update", "record": {"d": 1}}, "headers": [["sow-op", "update"]]}')
    released: list = []
    proc.engine.release_views(0, 10_000, released)
    assert [o.key for o in released if o.topic == "conf.diff"] == [b"y"]


def test_a_held_event_due_far_in_the_future_is_released_within_an_interval(tmp_path):
    """A held event due in 2**62 ms was taken back as it was: every later change of the record
    merged into it, and the view's `.diff` never told that record again."""
    proc, view = _view(tmp_path)
    key = proc.spec.key_spec.sow_key({"id": "x"})
    view.restore_hold(0, f"0|{key}".encode(), b'{"due": 4611686018427387904, "event": {"op": "update", "record": {"id": "x"}}, "headers": []}')
    now = time.time_ns() // 1_000_000
    out = proc.handle([InputMessage("orders", 0, 1, None, b'{"id": "x", "v": 1}', None, now)], now)
    assert not [o for o in out if o.topic == "conf.diff"]  # held (conflated with the one taken back)
    released: list = []
    proc.engine.release_views(0, now + 2_000, released)
    assert [o.value for o in released if o.topic == "conf.diff"] == [b'{"id":"x","v":1}']
