"""In-memory backend: a sorted dict, for the `memory` and `simple` persistence modes and tests."""

from __future__ import annotations

from typing import Iterator

from sortedcontainers import SortedDict


class MemoryBackend:
    def __init__(self) -> None:
        self._data: SortedDict = SortedDict()

    def get(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    def scan(self, start: bytes, stop: bytes) -> Iterator[tuple[bytes, bytes]]:
        # Materialise the keys first: callers may stage writes while iterating.
        for key in list(self._data.irange(start, stop, inclusive=(True, False))):
            yield key, self._data[key]

    def commit(self, writes: dict[bytes, bytes | None]) -> None:
        for key, value in writes.items():
            if value is None:
                self._data.pop(key, None)
            else:
                self._data[key] = value

    def clear(self) -> None:
        self._data.clear()

    def close(self) -> None:
        pass
