"""In-memory backend: a sorted dict, for the `memory` and `simple` persistence modes and tests."""

from __future__ import annotations

from typing import Iterator

from sortedcontainers import SortedDict


class MemoryBackend:
    def __init__(self) -> None:
        self._data: SortedDict = SortedDict()

    def get(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        get = self._data.get
        return [get(key) for key in keys]

    def scan(self, start: bytes, stop: bytes) -> Iterator[tuple[bytes, bytes]]:
        # Materialise the keys first: callers may stage writes while iterating, and a reader in
        # another thread (an HTTP query) may see a commit remove a key meanwhile.
        data = self._data
        for key in list(data.irange(start, stop, inclusive=(True, False))):
            value = data.get(key)
            if value is not None:
                yield key, value

    def batch(self) -> "_Writes":
        return _Writes()

    def write(self, batch: "_Writes") -> None:
        data = self._data
        for op in batch:
            if op[1] is None:
                data.pop(op[0], None)
            else:
                data[op[0]] = op[1]

    def clear(self) -> None:
        self._data.clear()

    def close(self) -> None:
        pass


class _Writes(list):
    """A write batch: operations applied in order (`MemoryBackend.write`)."""

    def put(self, key: bytes, value: bytes) -> None:
        self.append((key, value))

    def delete(self, key: bytes) -> None:
        self.append((key, None))
