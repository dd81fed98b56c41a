"""Delta publish merge and the diff between two versions of a record.

Merge rules (AMPS delta publish): a field absent from the delta is unchanged; a present field
replaces the old value; nested objects are merged field by field; arrays and scalars are replaced
whole; a delta on a missing record becomes the record. A delta cannot remove a field.

Diff rules (delta subscribe): the key fields always, then every field whose value changed; nested
objects are diffed recursively; a field the new record no longer has appears as null.
"""

from __future__ import annotations

from math import copysign

import orjson

from processor.core.paths import MISSING, get_path, set_path


def merge(existing: dict | None, delta: dict) -> dict:
    """The record after a delta publish. Neither argument is modified."""
    if existing is None:
        return delta
    merged = dict(existing)
    for name, value in delta.items():
        old = merged.get(name)
        if isinstance(value, dict) and isinstance(old, dict):
            merged[name] = merge(old, value)
        else:
            merged[name] = value
    return merged


_dumps, _SORTED = orjson.dumps, orjson.OPT_SORT_KEYS  # records are JSON-able: every diff is written with orjson


def changed_fields(old: dict, new: dict) -> dict:
    """Fields of `new` that differ from `old`, nested objects diffed; removed fields as None.

    Values of different types differ even when Python calls them equal (1, 1.0 and True), and so do
    0.0 and -0.0: a JSON subscriber sees them as different values. This is the hot path of every update, hence inline.
    """
    out: dict = {}
    get = old.get
    for name, value in new.items():
        before = get(name, MISSING)
        kind = type(value)
        if type(before) is kind:
            if kind is dict or kind is list:
                # Compared as JSON: Python's == calls [0] and [False], or {"k": 1} and {"k": 1.0}, equal.
                if _dumps(before, option=_SORTED) == _dumps(value, option=_SORTED):
                    continue
                if kind is dict:
                    out[name] = changed_fields(before, value)
                    continue
            elif before == value and (kind is not float or before != 0.0 or copysign(1.0, before) == copysign(1.0, value)):
                # 0.0 and -0.0 are equal to Python, not as JSON (orjson writes the sign), as inside arrays
                continue
        out[name] = value
    for name in old:
        if name not in new:
            out[name] = None
    return out


def diff(old: dict | None, new: dict, key_paths: tuple[tuple[str, ...], ...]) -> dict:
    """The delta message for `old` -> `new`: key fields first, then the changed fields."""
    changes = new if old is None else changed_fields(old, new)
    out: dict = {}
    nested = False
    for parts in key_paths:
        if len(parts) == 1:
            value = new.get(parts[0], MISSING)
            if value is not MISSING:
                out[parts[0]] = value
            continue
        nested = True
        value = get_path(new, parts)
        if value is not MISSING:
            set_path(out, parts, value)
    if not nested:  # key values are scalars: a changed field never has to be merged into one
        out.update(changes)
        return out
    for name, value in changes.items():
        if name in out and isinstance(out[name], dict) and isinstance(value, dict):
            out[name] = merge(out[name], value)
        else:
            out[name] = value
    return out


def has_data_changes(delta: dict, key_paths: tuple[tuple[str, ...], ...]) -> bool:
    """False when a delta holds nothing but key fields (an 'empty' for no_empties)."""
    return bool(_strip_keys(delta, key_paths))


def _strip_keys(delta: dict, key_paths: tuple[tuple[str, ...], ...]) -> dict:
    if not key_paths:
        return delta
    out = dict(delta)
    for parts in key_paths:
        _remove_path(out, parts)
    return out


def _remove_path(record: dict, parts: tuple[str, ...]) -> None:
    if len(parts) == 1:
        record.pop(parts[0], None)
        return
    child = record.get(parts[0])
    if isinstance(child, dict):
        child = dict(child)
        _remove_path(child, parts[1:])
        if child:
            record[parts[0]] = child
        else:
            record.pop(parts[0])
