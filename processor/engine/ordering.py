"""The order in which a worker applies the inputs of a SOW topic.

A worker owns some SOW partitions of a topic; each has three input partitions: `<topic>` p,
`<topic>.delta` p and `<topic>.repartition` p. All the input partitions a worker owns for a topic are
merged into one order by Kafka timestamp, so a delta sent 1 ms after a full publish is applied after
it, whichever topic each used, and an input that belongs to another partition of the same worker
is applied there in that same order (without a round trip through `.repartition`). Ties go to
`<topic>`, then `<topic>.delta`, then `<topic>.repartition` (a rerouted input keeps its original
timestamp), then partition, then offset.

Each input partition is applied in offset order whatever its timestamps: an entry's sort time is the
largest timestamp seen so far on its partition (as Kafka Streams' partition time), so a timestamp
that goes backwards never jumps the queue.

A merge may only take an entry when no input partition that is behind (data on the broker not yet
fetched) could still hold an older one: the merge stops at the last entry of the least advanced
such partition, and at once when one of them is empty. The runner then waits, bounded by its max
idle time, and forces the merge when that has passed (stream-time synchronisation, as Kafka
Streams' `max.task.idle.ms`).

An input partition that is caught up can still receive a message sent just before one the merge is
about to take: appended to the log after the fetch that found it caught up. The runner knows a sort
key such messages come after (a grace period after which any message appended earlier has been
fetched) and hands it in as that partition's bound: see the runner's order grace.

A merge takes at most `limit` entries: the runner merges a cycle's worth at once and applies it a
chunk at a time; while records may come due, it merges a chunk at a time, so it can end a cycle
between two chunks (one transaction and one store commit stay bounded, and so does the time between
two expiry sweeps) without merging more than it applies. The entries past the limit stay queued and
go, in order, with the next merge, which costs in proportion to the limit, not to the backlog queued.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from itertools import islice, repeat, takewhile
from operator import itemgetter
from typing import Iterable, Sequence

_NO_BOUND = (float("inf"),)
_PLACE, _ORDER = itemgetter(1, 2, 3), itemgetter(0, 1, 2, 3)  # (input, offset); (sort time, input, offset)


def drain_in_order(queues: Sequence[deque], behind: Sequence[bool], force: bool = False,
                   caught_up: Sequence[tuple | None] | None = None, limit: int | None = None) -> list:
    """Pop every entry that can be applied now from FIFO queues of entries (each in increasing
    order; an entry is (sort time, rank, partition, offset, item)), at most the `limit` first of
    them, and return them in merged order.

    `behind[i]` says queue i may receive older entries that are not fetched yet: nothing past the
    last entry of such a queue may go (nothing at all while one is empty), unless `force`.
    `caught_up[i]`, for a queue that is not behind, is a sort key its entries still to come are known
    to follow (None: no bound): nothing past it may go either, unless `force`.
    """
    bound: tuple = _NO_BOUND
    if not force:
        for i, (q, b) in enumerate(zip(queues, behind)):
            if b:
                if not q:
                    return []
                last = q[-1]
            elif caught_up is None or caught_up[i] is None:
                continue
            else:
                last = caught_up[i]
            if last < bound:
                bound = last
    if limit is not None and sum(map(len, queues)) > limit:
        # The first `limit` of the entries that may go go now, and the rest stay queued for the next
        # merge, where they meet what arrives meanwhile in order. Each queue is in order, so they
        # are among the first `limit` that may go of each queue: those heads, merged, are the answer,
        # and each queue gives up as many as its head has up to the last one taken.
        heads, taken = _heads(queues, bound, limit)
        if len(taken) > limit:
            del taken[limit:]
            last = taken[-1]
            for q, head in zip(queues, heads):
                if head:
                    _drop_first(q, bisect_right(head, last))
        else:
            for q, head in zip(queues, heads):
                _drop_first(q, len(head))
        return taken
    taken: list = []
    live = 0
    for q in queues:
        if not q:
            continue
        live += 1
        if bound is _NO_BOUND:
            taken.extend(q)
            q.clear()
        else:
            popleft = q.popleft
            while q and q[0] <= bound:
                taken.append(popleft())
    if live > 1:
        taken.sort()  # runs of already ordered entries: timsort merges them in C
    return taken


def in_partition_time_order(entries: Iterable[tuple]) -> list[tuple]:
    """Entries (timestamp, rank, partition, offset, item) of several input partitions, all at hand,
    in the order a merge of their queues gives: each entry's sort time is the largest timestamp so far
    on its input partition (rank, partition), so a timestamp that goes backwards keeps its offset's
    place. Returned as (sort time, rank, partition, offset, item)."""
    entries = entries if isinstance(entries, list) else list(entries)
    keyed = _with_sort_times(entries)
    if keyed is None:  # some partition's entries are not in offset order (any order is allowed): sort them so
        keyed = _with_sort_times(sorted(entries, key=_PLACE))
    keyed.sort(key=_ORDER)  # runs of ordered entries (a read of each partition): timsort merges them
    return keyed


def _with_sort_times(entries: list) -> list | None:
    """The entries keyed by sort time, or None when an input partition's entries are not in offset
    order (a read hands each partition's messages in order: that case needs no sort first)."""
    seen: dict[tuple[int, int], tuple[int, int]] = {}  # input partition -> (its sort time so far, last offset)
    keyed = []
    append = keyed.append
    run_rank = run_partition = None  # the partition of the current run of entries (a read hands them in runs)
    top = last = 0
    for ts, rank, partition, offset, item in entries:
        if partition != run_partition or rank != run_rank:
            if run_rank is not None:
                seen[(run_rank, run_partition)] = (top, last)
            run_rank, run_partition = rank, partition
            top, last = seen.get((rank, partition), (ts, -1))
        if offset < last:
            return None
        last = offset
        if ts > top:
            top = ts
        append((top, rank, partition, offset, item))
    return keyed


def _drop_first(q: deque, n: int) -> None:
    """Remove the first n entries of q (taken already)."""
    if n == len(q):
        q.clear()
        return
    popleft = q.popleft
    for _ in repeat(None, n):
        popleft()


def _heads(queues: Sequence[deque], bound: tuple, limit: int) -> tuple[list[list], list]:
    """The first entries of each queue that may go (up to `bound`), enough to hold the first `limit`
    of their merge, and that merge (sorted). A first try takes a share of `limit` from each queue,
    twice what they would give if their entries were spread evenly in time; it holds the first
    `limit` when none of the queues it cut short could have an earlier one after the cut."""
    take = min(limit, 2 * -(-limit // sum(1 for q in queues if q)))
    while True:
        heads = [list(islice(q if bound is _NO_BOUND else takewhile(bound.__ge__, q), take)) for q in queues]
        merged = [e for head in heads for e in head]
        merged.sort()  # runs of already ordered entries: timsort merges them in C
        if take == limit:
            return heads, merged
        cut = [head[-1] for head in heads if len(head) == take]
        if not cut or (len(merged) > limit and merged[limit - 1] <= min(cut)):
            return heads, merged
        take = limit
