"""The merge of a worker's input partitions of one SOW topic (processor.engine.ordering)."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from processor.engine import ordering


def drain_in_order(*args, **kwargs) -> list:
    """The merge, as the items of the entries it took."""
    return [entry[4] for entry in ordering.drain_in_order(*args, **kwargs)]


def entries(rank: int, stamps: list[int], partition: int = 0) -> deque:
    """A queue as the runner files it: sort time = the largest timestamp so far on the partition."""
    q: deque = deque()
    top = 0
    for offset, ts in enumerate(stamps):
        top = max(top, ts)
        q.append((top, rank, partition, offset, (rank, partition, offset, ts)))
    return q


stamps = st.lists(st.integers(0, 50), max_size=30)


@settings(max_examples=300, deadline=None)
@given(st.lists(stamps, min_size=1, max_size=6))
def test_inputs_at_their_end_apply_in_timestamp_order_each_in_offset_order(streams):
    queues = [entries(i % 3, s, i // 3) for i, s in enumerate(streams)]
    out = drain_in_order(queues, [False] * len(queues))
    assert len(out) == sum(map(len, streams)) and not any(queues)
    for i in range(len(streams)):
        offsets = [o for r, p, o, _ in out if (r, p) == (i % 3, i // 3)]
        assert offsets == sorted(offsets)
    if all(s == sorted(s) for s in streams):  # monotonic inputs: exactly (timestamp, rank, partition, offset)
        keys = [(ts, r, p, o) for r, p, o, ts in out]
        assert keys == sorted(keys)


@settings(max_examples=300, deadline=None)
@given(st.lists(stamps, min_size=1, max_size=6), st.randoms())
def test_entries_all_at_hand_come_in_the_order_the_merge_of_their_queues_gives(streams, rnd):
    """The Spark engine sorts a micro-batch at once (audit: by raw timestamp, a timestamp that went
    backwards jumped ahead of earlier offsets of its partition); it must give the worker's order."""
    queues = [entries(i % 3, s, i // 3) for i, s in enumerate(streams)]
    raw = [(ts, r, p, o, item) for q in queues for (_, r, p, o, item) in q for ts in [item[3]]]
    read = _as_read(raw, rnd)  # each partition in offset order, partitions in runs: no sort needed first
    rnd.shuffle(raw)
    merged = [e[4] for e in ordering.in_partition_time_order(raw)]
    assert merged == drain_in_order(queues, [False] * len(queues))
    assert [e[4] for e in ordering.in_partition_time_order(read)] == merged


def _as_read(raw: list, rnd) -> list:
    """Entries as a consumer hands them: runs of each partition's entries in offset order."""
    pending = {}
    for entry in sorted(raw, key=lambda e: e[1:4]):
        pending.setdefault(entry[1:3], deque()).append(entry)
    out = []
    while pending:
        tp = rnd.choice(sorted(pending))
        q = pending[tp]
        out += [q.popleft() for _ in range(min(len(q), rnd.randint(1, 4)))]
        if not q:
            del pending[tp]
    return out


def test_a_timestamp_that_goes_back_keeps_its_place_when_sorted_at_once():
    later, earlier_stamp = (5, 0, 0, 0, "v1"), (0, 0, 0, 1, "v2")  # one partition: v1 stamped now+5, then v2 stamped now
    assert [e[4] for e in ordering.in_partition_time_order([earlier_stamp, later])] == ["v1", "v2"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=20).map(sorted), min_size=2, max_size=5), st.data())
def test_nothing_passes_the_last_entry_of_an_input_that_is_behind(streams, data):
    queues = [entries(i % 3, s, i // 3) for i, s in enumerate(streams)]
    behind = [data.draw(st.booleans()) for _ in queues]
    lasts = [q[-1] for q, b in zip(queues, behind) if b]
    out = drain_in_order(queues, behind)
    if lasts:
        bound = min(lasts)
        assert all((ts, r, p, o) <= bound[:4] for r, p, o, ts in out)
        # what stays is all after the bound: applying it now could go before an unfetched entry
        assert all(q[0] > bound for q in queues if q)
    else:
        assert not any(queues)


@settings(max_examples=200, deadline=None)
@given(stamps, stamps, st.integers(0, 2))
def test_an_empty_input_that_is_behind_holds_everything_until_forced(a, b, empty):
    queues = [entries(0, sorted(a)), entries(1, sorted(b)), deque()]
    queues.insert(empty, queues.pop(2))
    behind = [i == empty for i in range(3)]
    assert drain_in_order(queues, behind) == []
    assert len(drain_in_order(queues, behind, force=True)) == len(a) + len(b)


def test_a_publish_and_a_delta_one_millisecond_apart_apply_in_timestamp_order():
    full = entries(0, [1000, 1002])
    delta = entries(1, [1001, 1001])
    assert [(r, o) for r, _, o, _ in drain_in_order([full, delta, deque()], [False, False, False])] == [(0, 0), (1, 0), (1, 1), (0, 1)]


def test_a_timestamp_that_goes_back_keeps_its_place_in_its_partition():
    full = entries(0, [10, 5])  # the second message's timestamp is older than the first's
    delta = entries(1, [7])
    assert [(r, o) for r, _, o, _ in drain_in_order([full, delta], [False, False])] == [(1, 0), (0, 0), (0, 1)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), max_size=20).map(sorted), min_size=2, max_size=5), st.data())
def test_nothing_passes_what_a_caught_up_input_may_still_deliver(streams, data):
    """The order grace: a caught-up input bounds the merge at the sort key its next entries follow."""
    queues = [entries(i % 3, s, i // 3) for i, s in enumerate(streams)]
    cut = data.draw(st.integers(0, 60))
    caught_up = [data.draw(st.sampled_from([None, (cut, float("inf"))])) for _ in queues]
    before = sum(map(len, queues))
    out = drain_in_order(queues, [False] * len(queues), caught_up=caught_up)
    if any(b is not None for b in caught_up):
        assert all(ts <= cut for r, p, o, ts in out)  # (monotonic inputs: sort time == timestamp)
        assert all(q[0][0] > cut for q in queues if q)
    else:
        assert not any(queues)
    assert len(out) + sum(map(len, queues)) == before
    left = sum(map(len, queues))
    assert len(drain_in_order(queues, [False] * len(queues), force=True, caught_up=caught_up)) == left  # force: everything


@settings(max_examples=300, deadline=None)
@given(st.lists(stamps, min_size=1, max_size=5), st.integers(1, 40), st.data())
def test_a_limited_merge_takes_the_first_entries_and_leaves_the_rest_in_order(streams, limit, data):
    """The runner merges at most a cycle's worth (`limit` entries): merge after merge, the same
    order as one whole merge, and never past what an input that is behind, or the bound of one
    that is caught up, may still deliver."""
    behind = [data.draw(st.booleans()) for _ in streams]
    cut = data.draw(st.integers(0, 60))
    caught_up = [data.draw(st.sampled_from([None, (cut, float("inf"))])) for _ in streams]
    whole = drain_in_order([entries(i % 3, s, i // 3) for i, s in enumerate(streams)], behind, caught_up=caught_up)
    queues = [entries(i % 3, s, i // 3) for i, s in enumerate(streams)]
    sliced: list = []
    while part := drain_in_order(queues, behind, caught_up=caught_up, limit=limit):
        assert len(part) <= limit
        sliced += part
    assert sliced == whole


def test_a_limited_merge_takes_from_one_input_far_ahead_of_the_others_in_time():
    """The merge first takes a share of the limit from each input; when one input holds all the
    earliest entries, that share is not enough, and it must take the limit from that one."""
    queues = [entries(0, list(range(100)))] + [entries(1, [1000 + i for i in range(50)], p) for p in range(5)]
    part = drain_in_order(queues, [False] * 6, limit=40)
    assert part == [(0, 0, offset, offset) for offset in range(40)]
    assert len(queues[0]) == 60 and all(len(q) == 50 for q in queues[1:])

