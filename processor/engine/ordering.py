"""The order in which the inputs of one SOW partition are applied.

A SOW partition p has three input partitions: `<topic>` p, `<topic>.delta` p and `<topic>.repartition`
p. Each is applied in offset order; between them, inputs are merged by Kafka timestamp, so a delta
sent 1 ms after a full publish is applied after it, whichever topic each used. Ties go to
`<topic>`, then `<topic>.delta`, then `<topic>.repartition` (a rerouted input keeps its original
timestamp), then the lower offset.

A merge may only take the smallest head when no input that is still behind (it has data on the broker
not yet fetched) could hold a smaller one: like Kafka Streams' stream-time synchronisation, the merge
stops at an empty input that is not known to be at its end, and the runner waits (bounded by its
max idle time) for that input to be fetched.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any, Sequence

# An entry is (timestamp, rank, offset, item): tuples compare by timestamp, then rank, then offset.
Entry = tuple[int, int, int, Any]


def drain_in_order(queues: Sequence[deque], behind: Sequence[bool], limit: int, force: bool = False) -> list:
    """Pop and return up to `limit` items from FIFO queues of entries, in merged order.

    `behind[i]` says queue i may receive more entries that are not fetched yet: the merge stops as
    soon as such a queue is empty (unless `force`, when the runner has waited long enough). Within a
    queue the FIFO order always holds, even if its timestamps go backwards.
    """
    live = [i for i, q in enumerate(queues) if q]
    if not live:
        return []
    waiting = not force and any(b and not q for q, b in zip(queues, behind))
    if waiting:
        return []
    if len(live) == 1 and (force or not any(behind[i] for i in range(len(queues)) if i != live[0])):
        q = queues[live[0]]  # the common case: one input has data, the others are at their end
        n = min(limit, len(q))
        return [q.popleft()[3] for _ in range(n)]
    out: list = []
    heap = [(q[0], i) for i, q in enumerate(queues) if q]
    heapq.heapify(heap)
    while heap and len(out) < limit:
        entry, i = heapq.heappop(heap)
        q = queues[i]
        q.popleft()
        out.append(entry[3])
        if q:
            heapq.heappush(heap, (q[0], i))
        elif behind[i] and not force:
            break  # this input may still hold something older than the other heads
    return out
