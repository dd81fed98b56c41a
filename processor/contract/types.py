"""The vocabulary of ksow: commands that come in, records that are kept, events that go out."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

class Command(str, Enum):
    """`sow-command` values."""

    PUBLISH = "publish"
    DELTA_PUBLISH = "delta_publish"
    SOW_DELETE = "sow_delete"

class Op(str, Enum):
    """`sow-op` values on the output topics."""

    INSERT = "insert"
    UPDATE = "update"
    DELETE = "delete"
    EXPIRE = "expire"
    EVICT = "evict"
    OOF = "oof"

    @property
    def removes(self) -> bool:
        return self in (Op.DELETE, Op.EXPIRE, Op.EVICT)

@dataclass(slots=True)
class SowRecord:
    """One record of the SOW: the merged data and what is stored beside it."""

    data: dict
    seq: int  # sow-seq of the event that produced this version
    expires_at: int | None = None  # epoch ms, None = never
    updated_at: int = 0  # epoch ms of the last publish/delta (capacity evicts the oldest)
    # `data` as JSON bytes once someone has encoded it (the renderer, for a JSON topic): the store
    # keeps these bytes instead of encoding the record a second time. Not part of its value.
    json: bytes | None = field(default=None, compare=False, repr=False)

@dataclass(slots=True)
class SowCommand:
    """A parsed input message: what to do to which record."""

    command: Command
    sow_key: str | None = None  # None for deletes by filter or by keys
    data: dict | None = None
    expiration_ms: int | None = None  # from the sow-expiration header
    keys: tuple[str, ...] = ()  # sow-keys of a delete by keys
    filter: str | None = None  # sow-filter of a delete by filter
    whole: dict | None = None  # an Avro delta as read, nulls for the fields not sent: what it stores when no record is there (as `.sow` carries it)

class UnreadableHeaders(list):
    """The headers of a consumed message that the Kafka client could not read (a header name that is
    not UTF-8 text: confluent-kafka fails decoding it). None of them is known, so the message is
    refused with `REASON` (an input goes to `.errors`, a `.sow` record is skipped), never applied
    as if it had none. Empty, but true, so that every reader looks at it."""

    REASON = "a header name is not UTF-8 text: the message's headers cannot be read"

    def __bool__(self) -> bool:
        return True


@dataclass(slots=True)
class InputMessage:
    """One message of an input topic, whichever engine read it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] | None
    timestamp: int  # the Kafka timestamp, epoch ms
    # Its place in its SOW partition's order, when a runner ordered it: its input partition's
    # largest timestamp so far (processor.engine.ordering). What expired before that is gone for
    # it. 0: the timestamp.
    sort: int = 0

@dataclass(slots=True)
class Output:
    """One message to produce, the single output shape of every engine (SOW streams, views, errors,
    rerouted inputs). `changelog` marks `<topic>.sow` records, whose offsets the store remembers."""

    topic: str
    partition: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    changelog: bool = False
    timestamp: int = 0  # 0: now; a rerouted input keeps its original timestamp
