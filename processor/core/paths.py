"""AMPS-style field paths (`/a/b`) over parsed records (nested dicts)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

MISSING: Any = object()


class PathError(ValueError):
    """A field path that is not of the form /a/b."""


@lru_cache(maxsize=4096)
def split_path(path: str) -> tuple[str, ...]:
    """`/a/b` -> ('a', 'b'). Paths must start with a slash and name at least one field."""
    if not isinstance(path, str) or not path.startswith("/") or path == "/":
        raise PathError(f"field path must look like /field or /a/b, got {path!r}")
    parts = tuple(path[1:].split("/"))
    if any(part == "" for part in parts):
        raise PathError(f"empty segment in field path {path!r}")
    return parts


def get_path(record: Any, parts: tuple[str, ...]) -> Any:
    """The value at a split path, or MISSING when any step is absent or not an object."""
    value = record
    for part in parts:
        if not isinstance(value, dict):
            return MISSING
        value = value.get(part, MISSING)
        if value is MISSING:
            return MISSING
    return value


def set_path(record: dict, parts: tuple[str, ...], value: Any) -> None:
    """Set a value at a split path, creating intermediate objects."""
    target = record
    for part in parts[:-1]:
        nxt = target.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            target[part] = nxt
        target = nxt
    target[parts[-1]] = value


def within(parts: tuple[str, ...], selected: list[tuple[str, ...]]) -> bool:
    """Whether a split path is one of the selected paths or inside one: whether project() keeps it."""
    return any(parts[: len(s)] == s for s in selected)


def project(record: dict, paths: list[tuple[str, ...]]) -> dict:
    """A new record holding only the given paths (a select list), nesting kept."""
    out: dict = {}
    for parts in paths:
        value = get_path(record, parts)
        if value is not MISSING:
            set_path(out, parts, value)
    return out


def project_changes(changes: dict, before: dict, paths: list[tuple[str, ...]]) -> dict:
    """The select list's part of a diff (`project` of it), where a selected field the change took
    away is null: a diff tells a removed field as null, and one whose parent became null, a number,
    a string or an array (so that the selected field is gone) is told the same way, if it was there."""
    out: dict = {}
    for parts in paths:
        value = get_path(changes, parts)
        if value is not MISSING:
            set_path(out, parts, value)
            continue
        node: Any = changes
        for part in parts[:-1]:
            node = node.get(part, MISSING)
            if type(node) is not dict:
                if node is not MISSING and get_path(before, parts) is not MISSING:
                    set_path(out, parts, None)
                break
    return out
