"""`ksow replay`: the SOW at an instant, then every change after it as the workers produced them.

The starting SOW is a Spark snapshot. The changes are inherently sequential (each diff depends on
the record before it), so the inputs after the instant are read by Spark from the first offset at
or after it (Kafka's offset-by-timestamp lookup), sorted into history order by Spark, and streamed to
the driver, where the reference fold (`history.SowFold`, i.e. the core's apply_write / removal)
turns them into the same ops and diffs the workers emit. Expirations appear at their instants.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator

import orjson

from processor.contract.types import SowRecord
from processor.core.sow import Transition
from processor.engine.topic import InputMessage
from processor.topology import SowTopic
from processor.engine.fold import SowFold
from processor.batch.snapshot import ORDER, history_columns, pin_inputs, read_inputs, snapshot

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def event(t: Transition) -> dict:
    """A change as a JSON-lines object: the fields of a delta subscription, plus `at`. `seq` is
    null: the fold numbers its own events, not the workers' sow-seq (which `subscribe --after-seq`
    takes), so printing them would invite a resume from the wrong place."""
    record = t.after if t.after is not None else t.before
    assert record is not None
    out = {"op": t.op.value, "sow_key": t.key, "seq": None, "at": t.at_ms, "expires_at": record.expires_at, "record": record.data}
    if t.changes is not None:
        out["diff"] = t.changes
    return out


def replay(spark: SparkSession, bootstrap: str, spec: SowTopic, start: int, end: int | None = None) -> Iterator[dict]:
    """Yield {"op": "sow", ...} for each record at `start`, then each change in (start, end].

    Without `end`, the changes go up to the last input, and expirations up to now.
    """
    from pyspark.sql import functions as F

    pinned = pin_inputs(bootstrap, spec)
    records: dict[str, SowRecord] = {}
    for row in snapshot(spark, bootstrap, spec, start, pinned=pinned).toLocalIterator():
        data = orjson.loads(row["record"])
        records[row["sow_key"]] = SowRecord(data, 0, row["expires_at"], row["updated_at"])
        yield {"op": "sow", "sow_key": row["sow_key"], "seq": None, "at": row["updated_at"], "expires_at": row["expires_at"], "record": data}

    fold = SowFold(spec, transitions=True, records=records)
    raw = read_inputs(spark, bootstrap, spec, pinned, starting_timestamp=start + 1)
    window = raw.select(*history_columns(spec), "sort", "value", "headers")
    window = window.where(F.col("sort") > start)  # the snapshot at `start` has the rest
    if end is not None:
        window = window.where(F.col("sort") <= end)
    for row in window.orderBy(*ORDER).toLocalIterator():
        headers = None if row["headers"] is None else [(h["key"], None if h["value"] is None else bytes(h["value"])) for h in row["headers"]]
        value = None if row["value"] is None else bytes(row["value"])
        msg = InputMessage(row["topic"], row["partition"], row["offset"], None, value, headers, row["ts"])
        for t in fold.apply(msg, row["sort"]):
            yield event(t)
    for t in fold.expire_until(end if end is not None else time.time_ns() // 1_000_000):
        yield event(t)
