"""Bookmarks: one event ID per partition, so that a subscriber resumes where it was in each."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from processor.client.sow_client import _released
from processor.core.bookmarks import Bookmark, BookmarkError, before, partition_of


def seq(counter: int, p: int) -> int:
    return counter << 10 | p


def test_a_bookmark_reads_back_what_it_wrote_and_takes_the_highest_of_a_partition():
    bookmark, missing = Bookmark.parse(f"{seq(7, 0)}, {seq(9, 2)},{seq(3, 2)}", 3)
    assert missing == [1]
    assert bookmark.positions == [seq(7, 0), 1, seq(9, 2)]  # partition 1 at its start
    again, missing = Bookmark.parse(str(bookmark), 3)
    assert again.positions == bookmark.positions and missing == []
    assert Bookmark.parse(seq(5, 1), 3)[1] == [0, 2]  # an event ID alone names its own partition only
    assert Bookmark.parse([seq(5, 1), seq(6, 0), seq(1, 2)], 3)[1] == []


def test_what_is_new_after_a_bookmark_is_decided_in_each_partition():
    bookmark = Bookmark([seq(100, 0), seq(5, 1)])
    assert not bookmark.is_new(seq(100, 0)) and bookmark.is_new(seq(101, 0))
    assert bookmark.is_new(seq(6, 1))  # lower than partition 0's position, yet new in its own
    bookmark.advance(seq(50, 1))
    bookmark.advance(seq(40, 1))  # going back never moves it
    assert str(bookmark) == f"{seq(100, 0)},{seq(50, 1)}"
    assert partition_of(seq(50, 1)) == 1 and before(seq(50, 1)) == seq(49, 1)


def test_a_bookmark_stopped_short_of_changes_not_given_leaves_itself_alone():
    position = Bookmark([seq(100, 0), seq(50, 1)])
    short = position.short_of([seq(80, 0), None, seq(90, 0), seq(60, 1)])
    assert short.positions == [seq(79, 0), seq(50, 1)]  # the lowest held change of a partition decides
    assert position.positions == [seq(100, 0), seq(50, 1)]  # a copy: the stream's position goes on
    assert position.short_of([seq(101, 0), seq(51, 1)]) is position  # nothing held it has passed


@pytest.mark.parametrize(("value", "says"), [
    ("", "separated by commas"),
    ("1,,2", "separated by commas"),
    ("-3", "never negative"),
    (str(seq(4, 5)), "is of partition 5, and the topic has 4 partitions"),
    ([], "at least one event ID"),
])
def test_a_bookmark_of_another_topic_or_no_bookmark_is_refused(value, says):
    with pytest.raises(BookmarkError, match=says):
        Bookmark.parse(value, 4)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 10_000)), min_size=1, max_size=40, unique=True), st.integers(0, 50))
def test_each_released_event_resumes_before_the_ones_still_to_come(changes, ahead):
    """A conflation interval releases its events at once; a subscriber may stop after any of them.
    Each event's bookmark must take in it and the ones before it, and none of those after it,
    though the stream's position has gone past them all."""
    pending = {f"k{i}": {"op": "update", "seq": seq(counter, p)} for i, (p, counter) in enumerate(changes)}
    top = max(counter for _, counter in changes) + ahead
    position = Bookmark([seq(top, p) for p in range(4)])
    released = list(_released(pending, position))
    assert not pending and len(released) == len(changes)
    seqs = [e["seq"] for e in released]
    for i, event in enumerate(released):
        bookmark = Bookmark.parse(event["bookmark"], 4)[0]
        assert not any(bookmark.is_new(s) for s in seqs[: i + 1])
        assert all(bookmark.is_new(s) for s in seqs[i + 1:])
    assert released[-1]["bookmark"] == str(position)
