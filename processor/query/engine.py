"""SOW queries against a worker's stores: point reads or hash-index lookups where the filter
allows, else a scan.

A filter that is a conjunction holding `path = literal` or `path IN (...)` terms on every key field
of the topic is answered by reading the records of the SowKeys those values make (`choose_keys`);
one with such terms on exactly the fields of a hash index, from the index. Only the candidate
records are read, and still checked against the whole filter. Anything else scans the partition.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from processor.contract.errors import KsowError
from processor.contract.limits import query_max_rows, query_max_seconds
from processor.contract.types import SowRecord
from processor.core.expiry import ExpiryPolicy
from processor.core.filters import MAX_FILTER_CHARS, Filter, compile_filter, format_filter
from processor.core.keyplan import choose_keys
from processor.core.keys import KeyError_, KeySpec, validate_user_keys
from processor.core.paths import PathError, project, split_path, within
from processor.core.sortorder import order_rows
from processor.core.rawfilter import raw_prefilter
from processor.state.base import RECORD_HEADER_SIZE, PartitionStore, choose_index
from processor.topology import Topology


@dataclass
class SowQuery:
    filter: str | None = None
    keys: tuple[str, ...] = ()
    select: tuple[str, ...] = ()
    top: int | None = None
    order_by: str | None = None  # "/path", "/path ASC" or "/path DESC"

    PARAMS = ("filter", "keys", "select", "top", "order_by")  # the names of a request's parameters

    def __post_init__(self) -> None:
        """A bad top, select path or order_by is the caller's error, before any worker is asked.
        Keys are a set: one named twice is kept once (in the order first named), else its record
        came back twice and took two of `top`'s places."""
        if len(set(self.keys)) != len(self.keys):
            self.keys = tuple(dict.fromkeys(self.keys))
        if self.top is not None and self.top < 0:
            raise QueryError(f"top must not be negative, got {self.top}")
        for path in self.select:
            try:
                split_path(path)
            except PathError as exc:
                raise QueryError(f"select: {exc}") from None
        self.ordering  # noqa: B018 - parses order_by

    @classmethod
    def from_params(cls, params: dict[str, str]) -> "SowQuery":
        """The query a request's parameters ask for; a QueryError names a parameter it does not
        know (a misspelt `filter` would otherwise return the whole SOW) or a `top` that is not a
        whole number."""
        if unknown := sorted(set(params) - set(cls.PARAMS)):
            raise QueryError(f"unknown query parameter(s) {', '.join(unknown)} (known: {', '.join(cls.PARAMS)})")
        split = lambda name: tuple(x.strip() for x in params.get(name, "").split(",") if x.strip())  # noqa: E731
        try:
            top = int(params["top"]) if params.get("top") else None
        except ValueError:
            raise QueryError(f"top must be a whole number, got {params['top']!r}") from None
        keys = split("keys")
        if "keys" in params and not keys:  # not a key filter: it would answer with every record
            raise QueryError("keys names no SowKey: give at least one, or leave keys out")
        try:
            validate_user_keys(keys)
        except KeyError_ as exc:
            raise QueryError(str(exc)) from None
        return cls(params.get("filter") or None, keys, split("select"), top, params.get("order_by") or None)

    def to_params(self) -> dict[str, str]:
        out = {}
        if self.filter:
            out["filter"] = self.filter
        if self.keys:
            out["keys"] = ",".join(self.keys)
        if self.select:
            out["select"] = ",".join(self.select)
        if self.top is not None:
            out["top"] = str(self.top)
        if self.order_by:
            out["order_by"] = self.order_by
        return out

    @property
    def ordering(self) -> tuple[tuple[str, ...], bool] | None:
        """(path, descending) from order_by, or None; a QueryError when it is neither a path nor a
        path followed by ASC or DESC."""
        if not self.order_by:
            return None
        parts = self.order_by.split()
        if len(parts) > 2 or (len(parts) == 2 and parts[1].upper() not in ("ASC", "DESC")):
            raise QueryError(f"order_by must be a field path, optionally followed by ASC or DESC; got {self.order_by!r}")
        try:
            return split_path(parts[0]), len(parts) == 2 and parts[1].upper() == "DESC"
        except PathError as exc:
            raise QueryError(f"order_by: {exc}") from None


class QueryError(KsowError, ValueError):
    """A query whose options cannot be used (order_by, top)."""


class QueryLimitError(KsowError):
    """A query that went over its row or time limit; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class QueryLimits:
    """What one query may cost a worker: records matched (before top) and seconds of work.

    Defaults come from KSOW_QUERY_MAX_ROWS and KSOW_QUERY_MAX_SECONDS (see contract.limits)."""

    max_rows: int = field(default_factory=query_max_rows)
    max_seconds: float = field(default_factory=query_max_seconds)

    CHECK_EVERY = 1024  # records read between two checks: the clock is not read per record

    def start(self, clock=time.monotonic, pacer: "QueryPacer | None" = None, cpu=time.thread_time):
        """A check(matched) for one query, starting its clock now; raises QueryLimitError. With a
        pacer, each check first waits for the queries' next turn (`QueryPacer.pause`, given the CPU
        this thread used since the last check): those waits do not count against the time limit,
        up to the limit again (so a query ends within twice its limit)."""
        started = clock()
        max_rows, max_seconds = self.max_rows, self.max_seconds
        waited = 0.0
        last_cpu = cpu() if pacer is not None else 0.0

        def check(matched: int) -> None:
            nonlocal waited, last_cpu
            if matched > max_rows:
                raise QueryLimitError(
                    f"query matched more than {max_rows} records (KSOW_QUERY_MAX_ROWS); narrow the filter", 413)
            if pacer is not None:
                now_cpu = cpu()
                if now_cpu - last_cpu >= pacer.QUANTUM:
                    waited += pacer.pause(now_cpu - last_cpu)
                    last_cpu = now_cpu
            if clock() - min(waited, max_seconds) - started > max_seconds:
                raise QueryLimitError(f"query took longer than {max_seconds:g}s (KSOW_QUERY_MAX_SECONDS); narrow the filter", 503)

        return check


class QueryPacer:
    """Keeps a worker's queries from starving its input loop.

    Query threads share the GIL with the loop: callers scanning without a pause cut a worker's
    ingest to a third of its rate or less (docs/benchmarks.md, Queries).
    While `busy()` says the loop has work, the worker's queries together run at most `share` of the
    time: after each chunk of records (a QueryLimits check) a query waits in proportion to the CPU
    the chunk took, on one schedule for every query thread. An idle loop does not slow them."""

    # CPU a query runs between two waits at least: after each wait it asks for the GIL again, which
    # a busy loop hands over only at its switch interval (5 ms), so short turns would mostly wait.
    QUANTUM = 0.005

    def __init__(self, share: float, busy: Callable[[], bool], clock=time.monotonic, sleep=time.sleep):
        self.rest = 1 / share - 1  # seconds of waiting owed for each second of a query's CPU
        self.busy = busy
        self.clock = clock
        self.sleep = sleep
        self._turn = 0.0  # when the queries may run again
        self._lock = threading.Lock()

    def pause(self, used: float) -> float:
        """After a chunk that used `used` seconds of its thread's CPU: wait until the queries' turn
        comes again. Returns the seconds waited."""
        if used <= 0 or self.rest <= 0 or not self.busy():
            return 0.0
        with self._lock:
            now = self.clock()
            self._turn = max(self._turn, now) + used * self.rest
            wait = self._turn - now
        self.sleep(wait)
        return wait


@dataclass
class QueryPlan:
    index: int | None  # hash index number used, or None for a scan
    candidates: int = 0  # records read
    by_key: int = 0  # partitions answered from the SowKeys the filter names (`choose_keys`)
    extra: dict[str, Any] = field(default_factory=dict)


def _candidates(store: PartitionStore, keys: Iterable[str] | None, choice: tuple[int, list[tuple]] | None, plan: QueryPlan) -> Iterator[tuple[str, SowRecord]]:
    """A store's records of the given SowKeys, else those its index plan (`choose_index`) finds,
    else all of them."""
    if keys is not None:
        for key in keys:
            record = store.committed(key)
            if record is not None:
                yield key, record
        return
    if choice is None:
        yield from store.records()
        return
    plan.index = choice[0]
    seen: set[str] = set()
    for values in choice[1]:
        for key in store.lookup(choice[0], values):
            if key not in seen:
                seen.add(key)
                record = store.committed(key)
                if record is not None:
                    yield key, record


def _named_keys(stores: list[PartitionStore], query: SowQuery, predicate: Filter | None, key_spec: KeySpec | None,
                plan: QueryPlan) -> tuple[list[tuple[PartitionStore, Iterable[str] | None]], list[PartitionStore]]:
    """(store, the SowKeys to read there) for the stores a query answers by SowKey (its keys, or
    those its filter names: `choose_keys`), and the other stores. Which SowKeys a number literal
    names depends on the store's key spellings: a store that may hold odd ones ('05') takes the
    strict plan, or none."""
    if query.keys:
        return [(store, query.keys) for store in stores], []
    if predicate is None or (loose := choose_keys(predicate, key_spec, True)) is None:
        return [], stores
    strict = choose_keys(predicate, key_spec, False)
    chosen = [(store, loose if store.plain_key_spelling() else strict) for store in stores]
    named = [(store, keys) for store, keys in chosen if keys is not None]
    plan.by_key = len(named)
    return named, [store for store, keys in chosen if keys is None]


PREFILTER = True  # derive raw-bytes prefilters for scans (off only to measure what they save)


def _scan(stores: list[PartitionStore], predicate: Filter, plan: QueryPlan, check) -> list[tuple[str, SowRecord]]:
    """Every record of the stores through the filter; a raw-bytes prefilter derived from the filter
    (when it has one) spares decoding the records that cannot match."""
    rows: list[tuple[str, SowRecord]] = []
    raw_check = raw_prefilter(predicate, RECORD_HEADER_SIZE) if PREFILTER else None
    plan.extra["prefilter"] = raw_check is not None
    for store in stores:
        # Matches of earlier stores count towards the row limit too.
        matched, read = store.select(predicate.matches, raw_check, QueryLimits.CHECK_EVERY, lambda n: check(len(rows) + n))
        rows += matched
        plan.candidates += read
    return rows


def run_query(
    stores: Iterable[PartitionStore],
    query: SowQuery,
    indexes: tuple[tuple[str, ...], ...],
    key_paths: tuple[tuple[str, ...], ...] = (),
    limits: QueryLimits | None = None,
    policy: ExpiryPolicy = ExpiryPolicy(),
    now_ms: int | None = None,
    pacer: QueryPacer | None = None,
    key_spec: KeySpec | None = None,
) -> tuple[list[dict], QueryPlan]:
    """The matching records of the given partitions as result dicts, ordered and cut to `top`.

    Raises QueryLimitError as soon as more than `limits.max_rows` records matched or the query
    ran past `limits.max_seconds` (checked every QueryLimits.CHECK_EVERY records read).
    Records past their instant (by `policy.is_live` at `now_ms`, default now) are left out even
    when the expiry sweep has not removed them yet; the check costs one comparison per match.
    A worker passes its `pacer`, which makes the query wait at its checks while the loop has work.
    With the topic's `key_spec`, a filter that names every key field reads only those SowKeys.
    """
    check = (limits or QueryLimits()).start(pacer=pacer)
    now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    predicate = compile_filter(query.filter) if query.filter else None
    plan = QueryPlan(None)
    select = selection(query, key_paths)
    rows: list[tuple[str, SowRecord]] = []
    named, rest = _named_keys(list(stores), query, predicate, key_spec, plan)
    # The index plan is worked out once for the other stores (up to MAX_INDEX_LOOKUPS value tuples).
    choice = choose_index(predicate, indexes) if predicate is not None and rest else None
    if predicate is not None and rest and choice is None:
        rows = _scan(rest, predicate, plan, check)
    else:
        named += [(store, None) for store in rest]
    mask = QueryLimits.CHECK_EVERY - 1
    for store, keys in named:
        for key, record in _candidates(store, keys, choice, plan):
            plan.candidates += 1
            if plan.candidates & mask == 0:
                check(len(rows))
            if predicate is None or predicate.matches(record.data):
                rows.append((key, record))
    check(len(rows))
    if policy.active:
        rows = [row for row in rows if policy.is_live(row[1].expires_at, now)]
    rows = order_and_cut(rows, query, lambda row: row[1].data, lambda row: row[0])
    return [result(key, rec, select) for key, rec in rows], plan


def order_and_cut(rows: list, query: SowQuery, data_of, tie_of) -> list:
    """Sort by `order_by` and keep `top` (processor.core.sortorder: ties in the order of `tie_of`,
    the SowKey); the worker's engine, the client's merge, its read of `.sow` and a pattern's merge
    all order with it."""
    return order_rows(rows, query.ordering, query.top, data_of, tie_of)


def order_results(rows: list[dict], query: SowQuery) -> list[dict]:
    """Result dicts (as `result` makes them) ordered and cut by `order_and_cut`."""
    return order_and_cut(rows, query, _record_of, _sow_key_of)


def _record_of(row: dict) -> Any:
    return row["record"]


def _sow_key_of(row: dict) -> str:
    return row["sow_key"]


def selection(query: SowQuery, key_paths: tuple[tuple[str, ...], ...]) -> list[tuple[str, ...]]:
    """Paths a select list returns: the key fields first (as subscriptions send them), then the rest."""
    if not query.select:
        return []
    return list(key_paths) + [split_path(p) for p in query.select]


def result(key: str, record: SowRecord, select: list[tuple[str, ...]] | None = None) -> dict:
    data = project(record.data, select) if select else record.data
    return {"sow_key": key, "seq": record.seq, "expires_at": record.expires_at, "record": data}


def through_view(topology: Topology, name: str, filter: str | None, select: list[str] | None,
                 order_by: str | None = None) -> tuple[str, str | None, list[str] | None]:
    """A query of a view reads its SOW topic through the view's filter and select list, as the view's
    own topics show it (not conflated): (SOW topic, filter, select list); a name that is no view
    comes back as it was. The caller's filter must parse on its own (errors point into it) and reads
    the view's records: a field the view's select list leaves out is NULL to it, and ordering by one
    is refused (QueryError). The client and a worker's HTTP endpoint both answer a view this way."""
    view = topology.view(name)
    if view is None:
        return name, filter, select
    spec = topology.topic(view.topic)
    shown = [*view.select, *spec.key_spec.paths] if view.select else []  # a view's records always carry the key fields
    if shown:
        selected = [split_path(path) for path in shown]
        outside = [path for path in select or () if not within(split_path(path), selected)]
        if order_by and not within(SowQuery(order_by=order_by).ordering[0], selected):
            outside.append(order_by.split()[0])
        if outside:
            raise QueryError(f"{', '.join(outside)} not in the select list of view {name} ({', '.join(view.select)})")
    if not filter or not filter.strip():
        return view.topic, view.filter, select or view.select or None
    yours = compile_filter(filter)
    both = f"({view.filter}) AND ({format_filter(yours.seen_through(shown) if shown else yours)})"
    if len(both) > MAX_FILTER_CHARS:
        raise QueryError(f"the filter and the filter of view {name} make {len(both):,} characters together, "
                         f"over the {MAX_FILTER_CHARS:,} a filter may have")
    return view.topic, both, select or view.select or None
