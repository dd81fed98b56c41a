"""Where a subscriber is in a SOW topic's changes, so that it can resume there: a bookmark.

An event ID (sow-seq) is `counter << SEQ_PARTITION_BITS | partition`. It increases within a
partition, but a subscriber gets the partitions' changes interleaved, and one partition's change
can reach it after a higher-numbered change of another (another worker, a later commit, a fetch
that read one partition ahead). One event ID therefore says how far a subscriber got in its own
partition only. A bookmark holds one event ID per partition (as an AMPS client keeps one bookmark
per publisher): the last change of that partition the subscriber was given or went past.
Resuming after it gives every record whose last change is above the bookmark in its partition.
"""

from __future__ import annotations

from typing import Iterable

SEQ_PARTITION_BITS = 10  # sow-seq = counter << 10 | partition: unique in the topic, up to 1024 partitions
_PARTITION_MASK = (1 << SEQ_PARTITION_BITS) - 1


class BookmarkError(ValueError):
    """A bookmark that is not one for this topic."""


def partition_of(seq: int) -> int:
    return seq & _PARTITION_MASK


def before(seq: int) -> int:
    """The highest event ID of the same partition below `seq` (a bound that `seq` is after)."""
    return seq - (1 << SEQ_PARTITION_BITS)


class Bookmark:
    """One position per partition: the event ID after which that partition's changes are new.
    A partition at its start (counter 0) has had nothing given yet."""

    __slots__ = ("positions", "_text")

    def __init__(self, positions: list[int]):
        self.positions = positions
        self._text: str | None = None

    @classmethod
    def start(cls, partitions: int) -> "Bookmark":
        return cls(list(range(partitions)))

    @classmethod
    def parse(cls, value: int | str | Iterable[int], partitions: int) -> tuple["Bookmark", list[int]]:
        """The bookmark an event carried (its event IDs, comma-separated), or event IDs given
        otherwise; with the partitions it does not name, which start over. Raises BookmarkError."""
        if isinstance(value, int):
            seqs: list[int] = [value]
        elif isinstance(value, str):
            try:
                seqs = [int(part) for part in value.split(",")]
            except ValueError:
                raise BookmarkError(f"a bookmark is event IDs (sow-seq) separated by commas; got {value!r}") from None
        else:
            seqs = [int(v) for v in value]
        if not seqs:
            raise BookmarkError("a bookmark names at least one event ID")
        bookmark = cls.start(partitions)
        named = set()
        for seq in seqs:
            if seq < 0:
                raise BookmarkError(f"an event ID (sow-seq) is never negative; got {seq}")
            p = partition_of(seq)
            if p >= partitions:
                raise BookmarkError(f"event ID {seq} is of partition {p}, and the topic has {partitions} partitions")
            named.add(p)
            if seq > bookmark.positions[p]:
                bookmark.positions[p] = seq
        return bookmark, [p for p in range(partitions) if p not in named]

    def is_new(self, seq: int) -> bool:
        """Whether a change with this event ID comes after the bookmark."""
        return seq > self.positions[seq & _PARTITION_MASK]

    def advance(self, seq: int) -> None:
        """The subscriber was given, or went past, the change with this event ID."""
        p = seq & _PARTITION_MASK
        if seq > self.positions[p]:
            self.positions[p] = seq
            self._text = None

    def copy(self) -> "Bookmark":
        return Bookmark(list(self.positions))

    def short_of(self, seqs: Iterable[int | None]) -> "Bookmark":
        """This position, stopped short of the changes with these event IDs (ones a subscriber was
        not given yet, such as events a conflation interval still holds): itself when it already is."""
        at = self
        for seq in seqs:
            if seq is None:
                continue
            p = seq & _PARTITION_MASK
            bound = before(seq)
            if bound < at.positions[p]:
                if at is self:
                    at = self.copy()
                at.positions[p] = bound
        return at

    def __str__(self) -> str:
        text = self._text
        if text is None:
            text = self._text = ",".join(map(str, self.positions))
        return text

    def __repr__(self) -> str:
        return f"Bookmark({self})"


def join_topics(parts: dict[str, str]) -> str:
    """The bookmark of a subscription to several SOW topics (a topic pattern's): each topic's own
    bookmark after its name, `orders=1024,2049;trades=3072,3073`."""
    return ";".join(f"{topic}={part}" for topic, part in parts.items())


def split_topics(value: int | str | Iterable[int]) -> dict[str, str]:
    """Each topic's part of a bookmark that join_topics wrote, by topic. Raises BookmarkError for
    anything else (an event ID, one topic's bookmark), which says nothing of the other topics."""
    said = "a pattern subscription resumes after the bookmark of one of its events: TOPIC=EVENT IDS for each topic, separated by ';'"
    if not isinstance(value, str) or "=" not in value:
        raise BookmarkError(f"{said}; got {value!r}")
    parts: dict[str, str] = {}
    for piece in value.split(";"):
        topic, sign, part = piece.strip().partition("=")
        if not sign or not topic or not part:
            raise BookmarkError(f"{said}; got {piece!r} in it")
        if topic in parts:
            raise BookmarkError(f"the bookmark names {topic} twice")
        parts[topic] = part
    return parts
