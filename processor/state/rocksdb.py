"""RocksDB backend through rocksdict: bytes keys and values, atomic WriteBatch commits."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from rocksdict import Options, Rdict, ReadOptions, WriteBatch


class RocksDBBackend:
    def __init__(self, path: str | Path):
        self.path = str(path)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = self._open()

    def _open(self) -> Rdict:
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        return Rdict(self.path, options)

    def get(self, key: bytes) -> bytes | None:
        return self._db.get(key)

    def scan(self, start: bytes, stop: bytes) -> Iterator[tuple[bytes, bytes]]:
        # RocksDB stops at the bound itself: no key comparison in Python per item. The iterator
        # reads the bound from `options` without holding it, so this frame keeps it alive.
        options = ReadOptions()
        options.set_iterate_upper_bound(stop)
        yield from self._db.items(from_key=start, read_opt=options)

    def batch(self) -> WriteBatch:
        return WriteBatch(raw_mode=True)

    def write(self, batch: WriteBatch) -> None:
        self._db.write(batch)

    def clear(self) -> None:
        self._db.close()
        Rdict.destroy(self.path, Options(raw_mode=True))
        self._db = self._open()

    def close(self) -> None:
        self._db.close()
