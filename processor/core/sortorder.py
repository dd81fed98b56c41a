"""The order of a SOW query's results: one total order, whichever path answers the query.

A worker's query engine, the client's merge of several workers' answers, the client's own read of
`<topic>.sow` and the merge of a topic pattern's topics all order and cut with `order_rows`, so
`top` keeps the same records whichever of them answered and however many workers there were.

With `order_by`, records sort by the value at its path, ranked across types by `order_value`:
numbers (and strings that spell one, as that number, exactly), then the other strings (by code
point), then false and true, then lists, then objects (each by its JSON text, keys sorted).
Records whose field is missing or JSON null come after every value, in either direction. Records
that tie (equal values, such as 3, 3.0 and "3.0", and those without the field) come in the order
of their tie key: the SowKey (and the topic, for a pattern's rows), ascending in either direction.
Without `order_by`, records come in the order of their tie key.
"""

from __future__ import annotations

import heapq
import json
from decimal import Decimal
from typing import Any, Callable

from processor.core.filters import spelled_number
from processor.core.paths import MISSING, get_path

NUMBER, STRING, BOOLEAN, LIST, OBJECT, OTHER = range(6)


def order_value(value: Any) -> tuple[int, Any] | None:
    """The rank of an `order_by` value: (type rank, comparable value), or None for a missing field
    or JSON null (sorted last). Values of one rank compare among themselves only, so mixed types
    never fail to sort; equal ranks are a tie."""
    if value is None or value is MISSING:
        return None
    if isinstance(value, bool):
        return (BOOLEAN, value)
    if isinstance(value, (int, float, Decimal)):
        return (NUMBER, value)
    if isinstance(value, str):
        number = spelled_number(value)
        return (STRING, value) if number is None else (NUMBER, number)
    if isinstance(value, list):
        return (LIST, _text(value))
    if isinstance(value, dict):
        return (OBJECT, _text(value))
    return (OTHER, repr(value))  # no decoded record holds another type


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def order_rows(rows: list, ordering: tuple[tuple[str, ...], bool] | None, top: int | None,
               data_of: Callable[[Any], Any], tie_of: Callable[[Any], Any]) -> list:
    """`rows` in the query's order, cut to `top`. `ordering` is (split path, descending) or None;
    `data_of(row)` is the record the path is read from; `tie_of(row)` is the row's tie key (its
    SowKey, or (SowKey, topic) for a pattern's rows), unique among the rows."""
    if ordering is None:
        return _smallest(rows, top, tie_of)
    parts, descending = ordering
    present, absent = [], []  # the rank is computed once a row: it reads the field and may parse a number
    for row in rows:
        rank = order_value(get_path(data_of(row), parts))
        if rank is None:
            absent.append(row)
        else:
            present.append((rank, tie_of(row), row))
    if top is not None and top < len(present) and not descending:
        present = heapq.nsmallest(top, present, key=_rank_tie)
    else:
        # By tie key, then a stable sort by rank alone, which keeps the ties ascending either way
        # (and takes two thirds of the time of one sort by (rank, tie) tuples).
        present.sort(key=_tie)
        present.sort(key=_rank, reverse=descending)
        present = present[:top] if top is not None else present
    ordered = [row for _, _, row in present]
    if top is not None and len(ordered) >= top:
        return ordered
    return ordered + _smallest(absent, None if top is None else top - len(ordered), tie_of)


def _smallest(rows: list, top: int | None, key: Callable[[Any], Any]) -> list:
    if top is not None and top < len(rows):
        return heapq.nsmallest(top, rows, key=key)
    return sorted(rows, key=key)


def _rank(item: tuple) -> Any:
    return item[0]


def _tie(item: tuple) -> Any:
    return item[1]


def _rank_tie(item: tuple) -> Any:
    return item[0], item[1]
