"""The worker's input loop: consume, order, apply, produce and commit, exactly once.

One thread owns a confluent-kafka consumer (the worker's membership of the consumer group) and a
transactional producer. Each cycle:

1. consumes what is there and files it in one queue per input partition;
2. merges the inputs of each owned SOW partition in timestamp order (processor.engine.ordering),
   waiting, at most `max_idle_ms`, for an input that is behind;
3. applies them with the engine, sweeps expiry and releases conflated view events; every output is
   produced as the engine makes it, into the open transaction (a newly assigned partition is
   restored first, a slice a cycle, while the others go on: `_restore_some`);
4. once the transaction has been open for the commit interval (100 ms; Kafka Streams'
   commit.interval.ms), sends the input offsets to it and commits it, else leaves it open for the
   next cycles (a rebalance or a stop commits it first);
5. then commits the stores with their changelog positions.

A crash before 4 completes aborts the transaction: no output is visible to `read_committed`
readers and the inputs are read again. A crash between 4 and 5 leaves the stores behind their
changelog, and restoring replays it. An input that removes many records (a delete by filter)
commits 4 and 5 every KSOW_DELETE_CHUNK removals with the offsets of the inputs before it
(`_checkpoint`): a crash then applies it again, and it finds only what is left. A worker that lost
its partitions (a long stall) cannot commit: its offsets carry an old group generation, so the
coordinator refuses them and the transaction aborts.

With `at_least_once` there is no transaction: outputs are delivered, the stores committed, then the
offsets; a crash repeats the outputs of the inputs read again.

The loop never runs on Faust's event loop: a long scan or a large batch cannot starve the group
heartbeat (librdkafka heartbeats from its own thread) or the HTTP server.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from pathlib import Path
from typing import Generator, Iterable, Iterator

from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME as _LOG_APPEND_TIME, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from processor.contract import headers as H
from processor.contract.errors import BatchAborted, ConfigError
from processor.contract.limits import MAX_FUTURE_STAMP_MS, positive_env
from processor.contract.types import InputMessage, Output
from processor.engine.ordering import drain_in_order
from processor.engine.topic import SowTopicEngine
from processor.engine.views import ViewProcessor, views_to_seed
from processor.kafka.clients import (
    check_compaction, check_partitions, delete_retention_ms, described_configs, end_offsets, ensure_topics, message_headers, make_admin, make_consumer,
    make_producer, read_batches, read_until, topic_incarnation, topology_topic_configs)
from processor.kafka.registry import REGISTRY_TOPICS
from processor.runners.faust import metrics
from processor.runners.faust.stores import open_store
from processor.state.base import PartitionStore, open_partition_store
from processor.state.keyformat import check_encoding, check_key_format
from processor.topology import Persistence, Topology

log = logging.getLogger("ksow.loop")


class Guarantee(str, Enum):
    """As Kafka Streams' `processing.guarantee`."""

    EXACTLY_ONCE = "exactly_once"
    AT_LEAST_ONCE = "at_least_once"


@dataclass
class LoopSettings:
    guarantee: Guarantee = Guarantee.EXACTLY_ONCE
    # Messages taken from the consumer, and inputs a SOW topic applies, per cycle (one transaction):
    # larger cycles mean fewer commits to wait for, but no expiry sweep runs during a commit, which
    # grows with the cycle. Inputs queued past it wait for the next cycle (processor.engine.ordering).
    # None: 50,000, or 20,000 when a topic has expiry or conflated views (measured in bench/expiry.py:
    # p99 lateness under a backlog 343 ms with 50,000, 169 ms with 20,000).
    batch_max: int | None = None
    chunk: int = 250  # inputs merged and applied between two looks at the expiry clock (~10 ms of work here: the sweeps' gap)
    max_idle_ms: int = 10_000  # how long a merge waits for an input that is behind (data on the broker not fetched yet)
    # How long after a message was fetched, or after its timestamp, any message appended to a
    # caught-up input before it has surely been fetched too (more than a fetch round trip): until
    # then the merge does not take it past what that input may still deliver. 0: it does not wait.
    order_grace_ms: int = 20
    expiry_tick_ms: int = 25  # between expiry sweeps
    # How long a transaction may stay open across cycles (Kafka Streams' commit.interval.ms, 100 ms
    # under exactly-once): a cycle that only swept a few expiries, or applied a few inputs, leaves it
    # open for the next ones instead of paying a commit's round trips each time (measured: a
    # commit every 25 ms sweep took half the loop's time while records came due). Outputs become
    # visible to read_committed readers when it commits. 0: every cycle commits.
    commit_interval_ms: int = 100
    # While records expire: how long a cycle applies inputs before it commits (the inputs left go
    # with the next cycle). The gap between two sweeps is about the commit of such a cycle and one chunk.
    timed_cycle_ms: int = 200
    expire_batch: int = 2000  # records one partition expires per sweep, so a backlog never stalls inputs
    # How long a cycle restores newly assigned partitions (from `<topic>.sow`) before the partitions
    # already served get their turn: inputs, expiry sweeps (also between the restore's batches).
    restore_slice_ms: int = 100
    queue_high: int = 20000  # an input partition with this many queued messages is paused
    # The producer's message.max.bytes: under the broker's default (1,048,588, compressed batches), so
    # that the producer refuses, at once and for that message, what the broker would refuse for the
    # whole transaction; over a record's own limit (processor.contract.limits) with its key and headers.
    max_message_bytes: int = 1_048_000
    # How long a cycle applies inputs before it leaves the rest queued for the next one (each SOW
    # topic applies at least one input a cycle): between two consume() calls the loop must stay under
    # the consumer's max.poll.interval.ms, or librdkafka takes it out of its group mid-cycle, and an
    # input may take a delete's filter budget (KSOW_DELETE_FILTER_SECONDS): 20 slow deletes in one
    # batch outlasted the 600 s. A cycle of ordinary inputs takes a second or two.
    max_cycle_ms: int = 30_000
    session_timeout_ms: int = 10_000  # a worker silent this long leaves the group (its partitions move)
    transaction_timeout_ms: int = 10_000  # the coordinator aborts a transaction open this long (a stalled worker's)
    # Static group membership (KIP-345): the worker joins as its stable identity (group, host, data
    # folder), so a restart within the session timeout gets its partitions back with no rebalance.
    static_membership: bool = False

    @classmethod
    def from_env(cls, **overrides) -> "LoopSettings":
        env = os.environ.get
        raw_guarantee = env("KSOW_PROCESSING_GUARANTEE") or Guarantee.EXACTLY_ONCE.value
        try:
            guarantee = Guarantee(raw_guarantee)
        except ValueError:
            raise ConfigError(f"KSOW_PROCESSING_GUARANTEE must be exactly_once or at_least_once, got {raw_guarantee!r}") from None
        settings = cls(
            guarantee=guarantee,
            batch_max=positive_env("KSOW_BATCH_MAX"),
            max_idle_ms=positive_env("KSOW_MAX_TASK_IDLE_MS", int, cls.max_idle_ms),
            order_grace_ms=positive_env("KSOW_ORDER_GRACE_MS", int, cls.order_grace_ms, zero=True),
            commit_interval_ms=positive_env("KSOW_COMMIT_INTERVAL_MS", int, cls.commit_interval_ms, zero=True),
            timed_cycle_ms=positive_env("KSOW_TIMED_CYCLE_MS", int, cls.timed_cycle_ms),
            expiry_tick_ms=positive_env("KSOW_EXPIRY_TICK_MS", int, cls.expiry_tick_ms),
            restore_slice_ms=positive_env("KSOW_RESTORE_SLICE_MS", int, cls.restore_slice_ms),
            queue_high=positive_env("KSOW_QUEUE_HIGH", int, cls.queue_high),
            max_message_bytes=positive_env("KSOW_MAX_MESSAGE_BYTES", int, cls.max_message_bytes),
            session_timeout_ms=positive_env("KSOW_SESSION_TIMEOUT_MS", int, cls.session_timeout_ms),
            transaction_timeout_ms=positive_env("KSOW_TRANSACTION_TIMEOUT_MS", int, cls.transaction_timeout_ms),
            static_membership=env("KSOW_STATIC_MEMBERSHIP", "").lower() in ("1", "true", "yes"),
        )
        for name, value in overrides.items():
            if value is not None:
                setattr(settings, name, value)
        return settings


class _TestSwitch:
    """Test-only: `KSOW_TEST_KILL_AT=step:n` SIGKILLs the worker the n-th time it reaches a step of
    the batch cycle (consumed, apply, produce, commit, store, sweep), and `KSOW_TEST_STOP_AT=step:n` SIGSTOPs
    it there (a zombie to be), so tests can prove that no crash or stall loses or repeats anything.
    Unset, a step costs one test of a module constant."""

    def __init__(self, spec: str | None, sig: int):
        self.step, _, n = (spec or "").partition(":")
        self.left = int(n or 1)
        self.sig = sig

    def __call__(self, step: str) -> None:
        if step == self.step:
            self.left -= 1
            if self.left == 0:
                log.warning("test switch: signal %d at %s", self.sig, step)
                # At this thread: a signal sent to the process is taken by another thread, and this
                # one would go on for a moment (far enough to commit the transaction it should hold).
                signal.pthread_kill(threading.get_ident(), self.sig)


_SWITCHES = [s for s in (_TestSwitch(os.environ.get("KSOW_TEST_KILL_AT"), signal.SIGKILL), _TestSwitch(os.environ.get("KSOW_TEST_STOP_AT"), signal.SIGSTOP)) if s.step]
_KILLS = bool(_SWITCHES)


def _put_back(tasks: list["Task"], entries: list) -> None:
    """Return merged entries that were not applied to the front of their queues, each in its order."""
    queues = {(rank, t.p): q for t in tasks for rank, q in enumerate(t.queues)}
    for entry in reversed(entries):
        queues[(entry[1], entry[2])].appendleft(entry)


def _stop_restore(task: "Task") -> bool:
    """End the task's restore if one is running (its changelog consumer closes); whether one was."""
    if task.replay is None:
        return False
    task.replay.close()
    task.replay = None
    return True


def _kill(step: str) -> None:
    for switch in _SWITCHES:
        switch(step)


# Tie-break ranks of the three inputs of a SOW partition (processor.engine.ordering).
_RANK_TOPIC, _RANK_DELTA, _RANK_REPARTITION = 0, 1, 2
# Consumer errors that no retry mends: the worker would stay up with no partitions, so it stops.
_REFUSED_SETTINGS = frozenset((KafkaError.INVALID_SESSION_TIMEOUT,))
# What a batch fails with when a topic it writes to is gone (deleted under the running worker), as
# seen here: the coordinator's refusal, a produce's or a watermark's, the transaction left in error by
# either, and a commit whose deliveries failed or timed out (their cause unsaid).
_TOPIC_GONE = frozenset((KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION, KafkaError._STATE,
                         KafkaError._INCONSISTENT, KafkaError._TIMED_OUT, KafkaError._MSG_TIMED_OUT))
# A batch the broker refused as larger than a topic takes (its max.message.bytes).
_TOO_LARGE = frozenset((KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE))
_NO_STAMP_LIMIT = 2**63 - 1  # Kafka's default message.timestamp.before.max.ms: any age
_STAMP_MARGIN_MS = 60_000  # an output timestamp's margin over the oldest its topic takes (clocks, the batch's time), at most half of it
# A batch refused for what an output topic's settings allow (its size, a timestamp's age, a message
# without a key on a compacted topic): read again.
_REFUSED_BY_CONFIG = _TOO_LARGE | {KafkaError.INVALID_TIMESTAMP, KafkaError.INVALID_RECORD}
_BATCH_FRAMING = 512  # bytes a record batch adds to its one message; the broker counts them in max.message.bytes
_HEADERS_ROOM = 1024  # bytes a record's key and headers may add to it in its message
# A batch aborted again right after it was redone meets a failure that outlasts a retry (an ACL
# taken away, a broker that refuses what it holds): each further redo waits twice as long as the
# last, from _ABORT_PAUSE_S up to _ABORT_PAUSE_MAX_S, until a batch commits (it spun at about 5 a second).
_ABORT_PAUSE_S = 0.2
_ABORT_PAUSE_MAX_S = 5.0
_TOPICS_CHECK_S = 30.0  # at most one look for gone topics in this many seconds (a broker away blocks one for 10 s)
STALL_SECONDS = 1.0  # a gap in the loop after which what its inputs' ends said is not trusted (_check_awake)
_AFTER_ALL = float("inf")  # in a bound (time, ..., _AFTER_ALL): after every entry of that time (and rank, partition)


@dataclass
class Task:
    """One SOW partition this worker owns: its inputs' queues, its store, its progress."""

    engine: SowTopicEngine
    p: int
    inputs: tuple[tuple[str, int], ...]  # (topic, partition) of <topic>, <topic>.delta, <topic>.repartition
    queues: tuple[deque, deque, deque] = field(default_factory=lambda: (deque(), deque(), deque()))
    at_end: list[bool] = field(default_factory=lambda: [False, False, False])  # caught up (end-of-partition seen)
    tops: list[int] = field(default_factory=lambda: [0, 0, 0])  # largest timestamp filed per input (its sort time)
    fetched: list[int] = field(default_factory=lambda: [-1, -1, -1])  # the offset after the last message filed per input (-1: none since the assignment or a rollback)
    filed_at: float = field(default_factory=time.monotonic)  # when a message of its inputs was last filed (monotonic)
    ends: list[int] = field(default_factory=lambda: [-1, -1, -1])  # the offset its last end-of-partition event gave per input
    unseen_since: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # when an input caught up was first found to have more, or not confirmed to have nothing more (monotonic; 0: neither)
    store: PartitionStore | None = None
    restored: bool = False
    replay: Generator[None, None, tuple[bool, bool]] | None = None  # its restore while it runs (SowLoop._restore_some), a `.sow` batch a step
    lateness: metrics.Histogram = field(init=False, repr=False)  # its topic's ksow_expiry_lateness_seconds, labelled once

    def __post_init__(self) -> None:
        self.lateness = metrics.EXPIRY_LATENESS.labels(self.engine.spec.topic)

    @property
    def name(self) -> tuple[str, int]:
        return (self.engine.spec.topic, self.p)


_RESTORE_BATCH = 1000  # `.sow` records a restore reads, parses and stages at once
_RESTORE_COMMIT = 20_000  # records a restore reads between two commits of the store (with its position)
_RESEED_STEP = 5_000  # records a re-seed writes back to `.sow` a step (about 70 ms)

_KEPT_HEADERS, _KEPT_HEADER_BYTES, _KEPT_KEY_BYTES = 64, 256, 1024  # what a cut message keeps besides half its value


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    """`items` in lists of `size` (the last one shorter)."""
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _message_bytes(key: bytes | None, value: bytes | None, headers: list | None) -> int:
    return len(value or b"") + len(key or b"") + sum(len(k) + len(v or b"") for k, v in headers or ())


def _place_key(headers: list) -> bytes:
    """The Kafka key of a message that has none, for a compacted topic: the place of the input it
    carries, `topic:partition:offset` (an `.errors` record's headers, or a rerouted copy's `ksow-source`)."""
    found = dict(headers)
    if H.ERROR_OFFSET in found:
        return b"%s:%s:%s" % (found[H.ERROR_TOPIC], found[H.ERROR_PARTITION], found[H.ERROR_OFFSET])
    return found.get(H.SOURCE) or b"-"


def _too_large(o: Output, limit: int) -> Output:
    """What goes out instead of a message the producer refuses as too large: its start, on the same
    topic, with the reason (this is the `.errors` record of an input over the broker's limit). It
    always fits: half the limit of its value, and its key and headers cut short too (a message
    whose headers alone were too large would otherwise be refused again, and stall the batch)."""
    headers = o.headers or []
    size = _message_bytes(o.key, o.value, headers)
    kept = [(k[:_KEPT_HEADER_BYTES], (v or b"")[:_KEPT_HEADER_BYTES]) for k, v in headers[:_KEPT_HEADERS]]
    reason = (f"message of {size} bytes exceeds message.max.bytes {limit}: value cut to {limit // 2} bytes, key to "
              f"{_KEPT_KEY_BYTES}, headers to the first {_KEPT_HEADERS} of {_KEPT_HEADER_BYTES} bytes").encode()
    return Output(o.topic, o.partition, (o.key or b"")[:_KEPT_KEY_BYTES] if o.key is not None else None,
                  (o.value or b"")[: limit // 2], [*kept, (H.ERROR, reason)])


class _Batch:
    """The outputs and input offsets of one transaction (one cycle, or several within the commit
    interval), produced as the engine gives them (begun with its first output): librdkafka sends
    while the engine goes on applying, so the
    commit waits only for the tail, and a delete or a sweep that removes many records never holds
    its outputs in memory. Never raises: a failure is kept and fails the commit (an input must not
    be blamed for it).

    Where the stores' `.sow` records end (_Positions) is learnt from the reports of the first `.sow`
    record of each partition in the cycle and one in `_SAMPLE` after that. Under exactly-once a
    failed delivery fails the commit, so no other report is asked for (a Python callback per message
    cost ~1 us of the loop's ~20 per input); at-least-once needs one per message to catch failures."""

    __slots__ = ("loop", "produce", "positions", "failures", "sent", "topics", "error", "changelog", "reported", "offsets", "applied", "began",
                 "oldest")

    def __init__(self, loop: "SowLoop") -> None:
        self.loop = loop
        self.offsets: dict[tuple[str, int], int] = {}  # input partition -> offset after the last input applied
        self.applied: Counter = Counter()  # inputs applied per SOW topic (the metrics)
        self.began = time.monotonic()
        self.produce = loop.producer.produce
        self.positions = _Positions()
        self.failures = None if loop.eos else _Failures()
        self.sent = 0
        self.topics: dict[str, int] = {}  # outputs per topic but `.sow` records (`changelog`), for the metrics
        self.error: KafkaException | None = None  # the first produce failure: the commit raises it
        self.changelog: dict[tuple[str, int], int] = {}  # `.sow` records produced per partition
        self.reported: dict[tuple[str, int], int] = {}  # of which the metrics were told (take_counts)
        self.oldest = loop._oldest_stamps()  # per output topic that bounds timestamps' age: the oldest it takes

    def append(self, o: Output) -> None:
        self.send(o.topic, o.partition, o.key, o.value, o.headers, o.changelog, o.timestamp)

    def send(self, topic: str, partition: int, key: bytes | None, value: bytes | None, headers: list,
             changelog: bool = False, timestamp: int = 0) -> None:
        """Produce one message into the cycle's transaction (processor.engine.outputs.Sink)."""
        if self.error is not None:
            return
        if self.oldest and timestamp:
            timestamp = self._within_age(topic, timestamp)
        if changelog:
            callback = self._changelog_callback(topic, partition)
        else:
            callback = self.failures
            topics = self.topics
            topics[topic] = topics.get(topic, 0) + 1
        loop = self.loop
        if not loop._in_txn and loop.eos and not self._begin():
            return
        if key is None and loop._compacted and topic in loop._compacted:  # else refused by the broker
            key = _place_key(headers)
        small = loop._small_topics
        if small and topic in small and _message_bytes(key, value, headers) > small[topic]:  # else refused by the broker
            cut = _too_large(Output(topic, partition, key, value, headers, changelog, timestamp), small[topic])
            key, value, headers = cut.key, cut.value, cut.headers
        try:
            # Positional (topic, value, key, partition, on_delivery, callback, timestamp, headers):
            # keyword arguments cost ~0.5 us more a message, measured.
            self.produce(topic, value, key, partition, callback, None, timestamp, headers)
        except (BufferError, KafkaException):
            if not self._produce_refused(Output(topic, partition, key, value, headers, changelog, timestamp), callback):
                return
        self.sent += 1
        if _KILLS:
            self._maybe_kill(1)

    def change(self, sow: str, diff: str, partition: int, key: bytes, value: bytes | None, told: bytes, headers: list,
               timestamp: int = 0, side: str | None = None, side_headers: list | None = None) -> None:
        """Produce one transition's messages into the cycle's transaction (Sink.change): `send`'s
        work, done once for the two or three (every input and every expiry comes through here)."""
        if self.error is not None:
            return
        if self.oldest and timestamp:
            timestamp = self._within_age(sow, timestamp)
        callback = self._changelog_callback(sow, partition)
        failures = self.failures
        topics = self.topics
        topics[diff] = topics.get(diff, 0) + 1
        loop = self.loop
        if not loop._in_txn and loop.eos and not self._begin():
            return
        produce, done = self.produce, 0
        try:
            produce(sow, value, key, partition, callback, None, timestamp, headers)
            done = 1
            produce(diff, told, key, partition, failures, None, 0, headers)
            if side is not None:
                done = 2
                produce(side, told, key, partition, failures, None, 0, side_headers)
        except (BufferError, KafkaException):  # the one refused and those after it, one at a time
            rest = [(Output(sow, partition, key, value, headers, True, timestamp), callback), (Output(diff, partition, key, told, headers), failures)]
            if side is not None:
                rest.append((Output(side, partition, key, told, side_headers), failures))
            for o, cb in rest[done:]:
                if not self._produce_refused(o, cb):
                    return
        if side is None:
            self.sent += 2
        else:
            topics[side] = topics.get(side, 0) + 1
            self.sent += 3
        if _KILLS:
            self._maybe_kill(2 if side is None else 3)

    def _within_age(self, topic: str, timestamp: int) -> int:
        """`timestamp`, or the oldest `topic` takes when it is older (an operator's, or a cluster's,
        message.timestamp.before.max.ms): a record's `.sow` message carries its last-change instant,
        which may be a publisher's stamp or an input read long after it arrived (a re-seed, a worker
        far behind). The broker would refuse it, and the batch each time it is redone."""
        oldest = self.oldest.get(topic, 0)
        if timestamp >= oldest:
            return timestamp
        self.loop._note_stamp_raised(topic)
        return oldest

    def _changelog_callback(self, topic: str, partition: int):
        """The delivery callback of a `.sow` record, counted per partition: the position report of
        the partition's first one in the batch and of one in `_SAMPLE` after it, else the failures
        callback (None under exactly-once: a failed delivery fails the commit)."""
        tp = (topic, partition)
        counts = self.changelog
        n = counts[tp] = counts.get(tp, 0) + 1
        if n > 1 and n % _SAMPLE:
            return self.failures
        return partial(self.positions.report, n)

    def _begin(self) -> bool:
        """Begin the loop's transaction, with the batch's first output; False when it cannot (the
        error is kept: the commit raises it)."""
        loop = self.loop
        try:
            loop.producer.begin_transaction()
        except KafkaException as exc:
            self.error = exc
            return False
        loop._in_txn = True
        return True

    def _produce_refused(self, o: Output, callback) -> bool:
        """Produce a message the producer refused on the hot path: once its queue has room, or cut
        short when it is too large (`_too_large`). False on any other failure (the error is kept)."""
        loop = self.loop
        try:
            try:
                self.produce(o.topic, o.value, o.key, o.partition, callback, None, o.timestamp, o.headers)
            except BufferError:
                loop._produce_when_room(o, callback)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                    raise
                loop._produce_when_room(_too_large(o, loop.settings.max_message_bytes), callback)
        except KafkaException as exc:
            self.error = exc
            return False
        return True

    def _maybe_kill(self, produced: int) -> None:
        """Tests: a crash with part of the outputs on the broker, after every 50th message."""
        for sent in range(self.sent - produced + 1, self.sent + 1):
            if sent % 50 == 25:
                self.loop.producer.flush()
                _kill("produce")

    def take_counts(self) -> dict[str, int]:
        """Outputs per topic since the last call (the metrics of a commit; a checkpoint is one)."""
        counts, self.topics = self.topics, {}
        reported = self.reported
        for tp, n in self.changelog.items():
            if n > (before := reported.get(tp, 0)):
                counts[tp[0]] = counts.get(tp[0], 0) + n - before
        self.reported = dict(self.changelog)
        return counts

    def checkpoint(self) -> None:
        self.loop._checkpoint(self)


# The loop's steps (metrics.LOOP_SECONDS), labelled once: a labels() look-up costs a lock and a dict.
_CONSUME_SECONDS, _FILE_SECONDS, _APPLY_SECONDS, _SWEEP_SECONDS, _PREPARE_SECONDS, _COMMIT_WAIT_SECONDS, _STORE_COMMIT_SECONDS = (
    metrics.LOOP_SECONDS.labels(step) for step in metrics.LOOP_STEPS)

_CHANGELOG_AT = "changelog_at"  # when (ms) the store last was where its changelog position says: read to there, or owned
_CHANGELOG_AT_REFRESH_MS = 60_000  # how stale an owned store lets that get (and the margin taken off delete.retention.ms)
_DIFF_TAIL = 16  # `.diff` offsets a transient partition's new owner reads back for the last event ID handed out
_SAMPLE = 1024  # a `.sow` delivery report in this many of a partition's records (and its first of a cycle)


class _Positions:
    """Where the `.sow` records of one batch end in each partition: the offset of a reported record
    plus the number of records produced after it there. One producer's records of a partition get
    increasing offsets in the order produced; other records between them (a commit marker, a fenced
    zombie's aborted writes) only push the real end further, so the result is a lower bound of it,
    exact in the common case. A lower bound is all a store needs: a restore replays from there, and
    a record the store already has is written again unchanged."""

    __slots__ = ("base", "failed")

    def __init__(self) -> None:
        self.base: dict[tuple[str, int], int] = {}  # offset of a reported record minus its number in the batch
        self.failed: list = []

    def report(self, n: int, err, msg) -> None:
        """The delivery report of a partition's n-th `.sow` record of the batch (from 1)."""
        if err is not None:
            self.failed.append(err)
            return
        tp = (msg.topic(), msg.partition())
        base = msg.offset() - n
        if base > self.base.get(tp, -(1 << 62)):
            self.base[tp] = base

    def ends(self, produced: dict) -> dict[tuple[str, int], int]:
        """The position after the last `.sow` record of each partition, given the records produced."""
        return {tp: base + produced[tp] + 1 for tp, base in self.base.items()}


class _Failures:
    """Delivery errors of the messages whose report tells no position (at-least-once only)."""

    __slots__ = ("errors",)

    def __init__(self) -> None:
        self.errors: list = []

    def __call__(self, err, msg) -> None:
        if err is not None:
            self.errors.append(err)


class SowLoop:
    """The input loop of one worker (see the module docstring). `run()` blocks; `stop()` ends it."""

    def __init__(self, topology: Topology, bootstrap: str, group: str, data_dir: Path, topology_dir: Path | None = None,
                 settings: LoopSettings | None = None, instance: str = "0"):
        self.topology = topology
        self.bootstrap = bootstrap
        self.group = group
        self.data_dir = data_dir  # its `sow/` tree holds the stores, shared with the host's other workers on it
        self.instance = instance
        self.settings = settings or LoopSettings.from_env()
        self.eos = self.settings.guarantee is Guarantee.EXACTLY_ONCE
        self.engines = {s.topic: SowTopicEngine(s, topology_dir, topology.views_of(s.topic)) for s in topology.sow}
        if self.eos:  # a delete that outlasts a transaction cannot commit: read again, it is refused
            for engine in self.engines.values():
                engine.slow_delete_seconds = self.settings.transaction_timeout_ms / 1000
        self._by_input: dict[str, tuple[SowTopicEngine, int]] = {}
        for engine in self.engines.values():
            spec = engine.spec
            self._by_input[spec.topic] = (engine, _RANK_TOPIC)
            self._by_input[spec.delta_topic] = (engine, _RANK_DELTA)
            self._by_input[spec.repartition_topic] = (engine, _RANK_REPARTITION)
        self.tasks: dict[tuple[str, int], Task] = {}
        self._task_of_input: dict[tuple[str, int], tuple[Task, int]] = {}
        # Owned input partition -> the offset committed for it (by the last commit, or found at
        # assignment). A transaction without offsets of its own carries one of them: `_fencing_offsets`.
        self._committed: dict[tuple[str, int], int] = {}
        self._marks: dict[tuple[str, int], str | None] = {}  # input partition -> the metadata of its committed offset (views_mark)
        # Stores of revoked partitions, open in case the next assignment gives them back (then they
        # need no replay at all); closed when it does not, for their next owner on this host.
        self._parked: dict[tuple[str, int], PartitionStore] = {}
        self._paused: set[tuple[str, int]] = set()
        self._replace_producer = False  # the transactional producer failed and is not replaced yet
        self._admin: AdminClient | None = None  # made when first needed (`admin`)
        self._topics_checked_at = 0.0  # monotonic time of the last look for gone topics (_abort)
        self._inputs_gone = False  # the consumer said a subscribed input topic is gone (`cycle` creates it again)
        self._inputs_created: list[str] = []  # input topics created again, the group not joined anew yet (`cycle`)
        # The topics the loop writes to, and what the smallest of them take (`_limit_outputs`): the
        # producer's largest batch, and the topics that take less than its largest message.
        inputs = {name for spec in topology.sow for name in (spec.topic, spec.delta_topic)}
        self._outputs = [name for name in topology_topic_configs(topology) if name not in inputs]
        self._unrecorded = {name for spec in topology.sow for name in (spec.errors_topic, spec.repartition_topic)}  # carry inputs, not records
        self._batch_bytes = 1_000_000
        self._small_topics: dict[str, int] = {}  # topic -> the largest message it takes, when less than message.max.bytes
        self._stamp_ages: dict[str, int] = {}  # topic -> the oldest timestamp it takes, in ms before now (`_limit_stamps`)
        self._stamp_settings: dict[str, str] = {}  # topic -> the setting that bounds it, for the warning
        self._stamps_raised: set[str] = set()  # topics an older timestamp was raised for (logged once)
        self._compacted: frozenset[str] = frozenset()  # `.errors` and `.repartition` topics found compacted (`_limit_keys`)
        # While consume() returns full batches its own queue holds more, and librdkafka fetches no
        # partition until that queue shrinks: an input's last end event may be seconds old. The
        # broker is then asked where the inputs of expiring partitions end (ListOffsets, in the
        # background): `_ends_seen` holds, per input, (its end, the wall-clock ms the question was
        # asked), `_ends_wanted` the inputs to ask about next, and `_ends_asked` the question in
        # flight (its futures and the wall-clock ms it was asked).
        self._backlogged = False
        self._ends_seen: dict[tuple[str, int], tuple[int, int]] = {}
        self._ends_wanted: set[tuple[str, int]] = set()
        self._ends_asked: tuple[dict, int] | None = None
        self._stop = threading.Event()
        self._next_sweep = 0.0
        self._awake_at = 0.0  # when the loop last looked at the clock (a longer gap: it was stopped, _check_awake)
        self._timed = any(e.spec.expiry.active or e.conflates for e in self.engines.values())  # sweeps to run on time
        self.batch_max = self.settings.batch_max or (20_000 if self._timed else 50_000)
        self._more = False  # a merge left inputs it could have applied (it took a cycle's worth): no waiting
        self._cycle_began = 0.0
        self._cycle_expired = 0  # records the cycle's sweeps expired so far
        self._worked = 0.0  # time.monotonic() of the last cycle that consumed, applied or expired something
        self._working = False  # the cycle running now consumed inputs (busy())
        self._in_txn = False
        self._aborts_in_a_row = 0  # since the last commit (_recover's pause)
        self._noted_at = 0  # when (ms) the owned stores last noted they are current (_note_current)
        self._lag: Counter = Counter()  # input lag by SOW topic, as last measured (_measure_lag)
        self._lag_at = 0.0
        self._open: _Batch | None = None  # a batch left open by the last cycle (commit interval)
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="ksow-commit")  # SowLoop._commit
        self._applying: tuple[SowTopicEngine, list[InputMessage], dict] | None = None  # the chunk being applied (checkpoints)
        self._waiting_since: dict[str, float] = {}  # SOW topic -> when its merge first had to wait for an input behind
        # Order grace: per SOW topic, (when, largest sort time filed by then) for each consume, and the
        # largest sort time filed at least the grace ago (what a caught-up input's next message follows).
        self._filings: dict[str, deque] = {}
        self._settled: dict[str, int] = {}
        # SOW topics an input message of which carried its publisher's timestamp (CreateTime): for
        # them the clock says nothing of what a caught-up input may still hold (_caught_up_bounds).
        self._publisher_stamped: set[str] = set()
        self._release_at = 0.0  # monotonic instant the grace frees an entry the merge held (0: none held)
        self.transactional_id = f"ksow-{group}-{instance}"
        membership = {"group.instance.id": self.transactional_id} if self.settings.static_membership else {}
        self.consumer = make_consumer(
            bootstrap, group,
            **{
                "isolation.level": "read_committed",
                "partition.assignment.strategy": "range",  # co-partitions <topic>, .delta and .repartition
                "session.timeout.ms": self.settings.session_timeout_ms,
                "heartbeat.interval.ms": 2000,
                "max.poll.interval.ms": 600000,
                "enable.partition.eof": True,
                "queued.max.messages.kbytes": 65536,
                **membership,
            },
        )
        self.producer = self._new_producer()

    # topics ----------------------------------------------------------------------------------
    @property
    def admin(self) -> AdminClient:
        if self._admin is None:
            self._admin = make_admin(self.bootstrap)
        return self._admin

    def ensure_topics(self, timeout: float = 30.0) -> list[str]:
        """Create the topology's topics that are missing (with its settings) and check those that
        exist: their partition counts, the compaction of the changelogs, what the outputs take. At
        start, and when a batch fails on a topic deleted under the running worker. Returns the names
        created; a topic that cannot serve (too few partitions, a changelog that is not compacted)
        is a ConfigError."""
        replication = {"replication_factor": self.topology.replication_factor, "min_insync_replicas": self.topology.min_insync_replicas}
        wanted = topology_topic_configs(self.topology)
        created = ensure_topics(self.admin, {**wanted, **REGISTRY_TOPICS}, timeout, **replication)
        check_partitions(self.admin, [engine.spec for engine in self.engines.values()], timeout)
        configs = described_configs(self.admin, self._outputs, timeout)  # the changelogs among them
        check_compaction(wanted, configs)
        self._fit_outputs(configs)
        return created

    def _fit_outputs(self, configs: dict[str, dict[str, str]], renew: bool = False) -> None:
        """Fit what the loop writes to its output topics' `configs`: the timestamps' age
        (`_limit_stamps`), keys where a compacted topic needs one (`_limit_keys`) and the sizes of
        messages and batches (`_limit_outputs`; the producer is
        made anew when its batch size changed, or when `renew`). At start, and when the broker
        refuses a batch on one."""
        self._limit_stamps(configs)
        self._limit_keys(configs)
        if self._limit_outputs(configs) or renew:
            self._renew_producer()

    def _limit_stamps(self, configs: dict[str, dict[str, str]]) -> None:
        """How old a timestamp each output topic takes, from its `configs` (an operator's, or a
        cluster's, message.timestamp.before.max.ms; under LogAppendTime the broker stamps messages
        itself): `_Batch` writes an older one as the oldest it takes."""
        ages, settings = {}, {}
        for name in self._outputs:
            found = configs.get(name, {})
            if found.get("message.timestamp.type", "CreateTime") != "CreateTime":
                continue
            # message.timestamp.difference.max.ms: the one setting for both ways before Kafka 3.6 (KIP-937)
            age, setting = min(((int(v), k) for k in ("message.timestamp.before.max.ms", "message.timestamp.difference.max.ms")
                                if (v := found.get(k, "")).isdigit()), default=(_NO_STAMP_LIMIT, ""))
            if age < _NO_STAMP_LIMIT:
                ages[name], settings[name] = age, setting
        self._stamp_ages, self._stamp_settings = ages, settings

    def _limit_keys(self, configs: dict[str, dict[str, str]]) -> None:
        """The output topics found compacted though ksow creates them with `delete` (made by hand, or
        before ksow set the policy, on a cluster whose default is compact): the broker refuses a
        message without a key there, and the batch each time it is redone. `.errors` copies an
        input's own key, and `.repartition` a delete's fanned out to other partitions: none when
        its publisher gave none. `_Batch.send` gives such a message its input's place instead."""
        compacted = frozenset(name for name in self._unrecorded if "compact" in configs.get(name, {}).get("cleanup.policy", ""))
        if compacted - self._compacted:
            log.warning("output topics are compacted: %s; a message without a key is written there with its input's place as key (topic:partition:offset)",
                        ", ".join(sorted(compacted - self._compacted)))
        self._compacted = compacted

    def _oldest_stamps(self) -> dict[str, int]:
        """The oldest timestamp each output topic that bounds their age takes, from now on, with a
        margin (a minute, at most half its window) for the clocks and the batch's own time."""
        if not self._stamp_ages:
            return {}
        now = time.time_ns() // 1_000_000
        return {name: now - age + min(_STAMP_MARGIN_MS, age // 2) for name, age in self._stamp_ages.items()}

    def _note_stamp_raised(self, topic: str) -> None:
        """Say once per topic that its timestamps are being raised (the records keep their own)."""
        if topic not in self._stamps_raised:
            self._stamps_raised.add(topic)
            log.warning("%s takes no timestamp older than %d ms (%s): older ones are written to it as the oldest it takes",
                        topic, self._stamp_ages[topic], self._stamp_settings[topic])

    def _limit_outputs(self, configs: dict[str, dict[str, str]]) -> bool:
        """Fit what the loop writes to its output topics' `max.message.bytes`, from their `configs`
        (Kafka's default takes ksow's own limits; an operator may set less): the broker refuses a
        larger message or batch, and the batch that holds it again each time it is redone, for
        ever. Records and diffs larger than the smallest record topic takes are refused onto
        `.errors` (the engines' limit), other messages cut short (`send`), and the producer's
        batches stay under the smallest. True when the producer's batch size changed (it is made
        anew to take it)."""
        limits = {name: max(1, int(configs[name]["max.message.bytes"]) - _BATCH_FRAMING)
                  for name in self._outputs if configs.get(name, {}).get("max.message.bytes", "").isdigit()}
        if not limits:
            return False
        most = self.settings.max_message_bytes
        records = min((limit for name, limit in limits.items() if name not in self._unrecorded), default=most)
        for engine in self.engines.values():
            engine.limit_record_bytes(max(1, min(most, records) - _HEADERS_ROOM))
        small = {name: limit for name, limit in limits.items() if limit < most}
        if small and small != self._small_topics:
            log.warning("output topics take smaller messages than ksow's limits (max.message.bytes): %s; larger records are refused onto .errors",
                        ", ".join(f"{name} {limit + _BATCH_FRAMING} bytes" for name, limit in sorted(small.items())))
        self._small_topics = small
        batch = min(1_000_000, most, *limits.values())
        if batch == self._batch_bytes:
            return False
        self._batch_bytes = batch
        return True

    def _renew_producer(self) -> None:
        """A new transactional producer (fencing the old one's open transaction) for one that
        failed or must take new settings; until one is ready (init_transactions can time out while
        the broker is away), every abort tries again."""
        self._replace_producer = True
        self.producer = self._new_producer()
        self._replace_producer = False

    def _recreate_gone_topics(self) -> None:
        """A topic the loop writes to was deleted under it (an operator, a clean-up script): every
        batch would abort on it, forever. Create it again, as at start, so that the batch is redone
        into it; its readers start over from its first offset. The producer (its transaction aborted)
        is replaced: a new one asks for the new topic's metadata at once. An input topic deleted
        (the consumer says so) is created again too, its publishers' sends failing meanwhile, and
        the group joined anew, so that it assigns the new topic at once."""
        now = time.monotonic()
        if now - self._topics_checked_at < _TOPICS_CHECK_S:
            return
        self._topics_checked_at = now
        producer = self.producer
        try:
            created = self.ensure_topics(timeout=10)
        except (KafkaException, TimeoutError) as exc:  # the broker is away: the next failed batch looks again
            log.warning("could not look for deleted topics: %s", exc)
            return
        if created:
            log.warning("topics deleted under the running worker, created again: %s (their readers start over from their first offset)", ", ".join(created))
            metrics.TOPICS_RECREATED.inc(len(created))
            if self.producer is producer and not set(created).isdisjoint(self._outputs):  # it holds them as gone; not made anew already
                self._renew_producer()
            # The group is joined anew for input topics (`cycle`, outside a rebalance callback, which
            # may have come here): it assigns them now, not after the consumer's next metadata refresh (up to 30 s, `_COMMON` in processor.kafka.clients).
            self._inputs_created += sorted(set(created) & self._by_input.keys())

    # producer --------------------------------------------------------------------------------
    def _size_limits(self) -> dict[str, int]:
        """The largest message, and batch of a partition's messages, the producer sends."""
        return {"message.max.bytes": self.settings.max_message_bytes, "batch.size": self._batch_bytes}

    def _new_producer(self):
        if not self.eos:  # the commit flushes: as below, a longer linger makes fewer, larger requests
            return make_producer(self.bootstrap, **{"linger.ms": 50, **self._size_limits()})
        producer = make_producer(
            self.bootstrap,
            **{
                "transactional.id": self.transactional_id,
                "transaction.timeout.ms": self.settings.transaction_timeout_ms,
                "retry.backoff.ms": 10,  # send_offsets_to_transaction retries CONCURRENT_TRANSACTIONS quickly
                # read_committed readers see nothing before the commit, and the commit flushes: a
                # longer linger only makes fewer, larger produce requests (less CPU here and on the broker).
                "linger.ms": 50,
                **self._size_limits(),
            },
        )
        producer.init_transactions(60)  # fences an earlier incarnation with the same transactional.id
        return producer

    # lifecycle ------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def _await_leaders(self, topics: list[str]) -> None:
        """Wait, at most 10 s, until the consumer's metadata gives each of `topics` (just created)
        its partitions with leaders: a group joined again before then assigns it no partition."""
        deadline = time.monotonic() + 10
        for topic in topics:
            while time.monotonic() < deadline:
                try:
                    found = self.consumer.list_topics(topic, timeout=2).topics.get(topic)
                except KafkaException:
                    found = None
                if found is not None and found.error is None and found.partitions and all(p.leader >= 0 for p in found.partitions.values()):
                    break
                time.sleep(0.2)

    def _subscribe(self) -> list[str]:
        """Join the group for every input topic (again: a rebalance that takes in an input topic
        created anew at once, where the consumer would otherwise notice it at its next metadata
        refresh). Returns the topics."""
        inputs = [t for engine in self.engines.values() for t in engine.inputs]
        self.consumer.subscribe(inputs, on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost)
        return inputs

    def run(self) -> None:
        # Every input allocates a few short-lived objects and hardly any reference cycles: with the
        # default thresholds the collector runs every 700 allocations over everything young (a batch
        # is thousands of objects), a third of the loop's CPU. The collector is off while a cycle
        # runs (reference counting frees its objects when it ends; measured: 7% of the CPU even with
        # a high threshold), runs rarely in between, and never scans what start-up left (gc.freeze).
        gc.freeze()
        gc.set_threshold(100_000, 50, 1000)
        inputs = self._subscribe()
        log.info("loop: %s, transactional.id %s, inputs %s", self.settings.guarantee.value, self.transactional_id if self.eos else "-", ", ".join(inputs))
        try:
            while not self._stop.is_set():
                gc.disable()
                try:
                    self.cycle()
                except BatchAborted:  # a checkpoint could not commit: already rolled back
                    self._applying = None
                except KafkaException as exc:  # a broker hiccup (no leader yet, a timeout): start the batch over
                    err = exc.args[0] if exc.args else None
                    if err is not None and hasattr(err, "fatal") and err.fatal():
                        raise
                    self._recover(exc)
                    time.sleep(0.5)
                finally:
                    gc.enable()
            self._commit_open()  # stopping: what the last cycles applied is committed, not redone
        finally:
            self._close()

    def _close(self) -> None:
        try:
            self.consumer.close()  # leaves the group: the partitions move at once
        except Exception:  # noqa: BLE001 - closing is best effort
            log.debug("consumer close", exc_info=True)
        self.producer.flush(10)
        self._committer.shutdown()
        for task in self.tasks.values():
            _stop_restore(task)
            if task.store is not None:
                task.store.close()
        for store in self._parked.values():
            store.close()
        self.tasks.clear()
        self._parked.clear()

    # rebalances (called by librdkafka inside consume(), on this thread) ----------------------
    def _on_assign(self, consumer, partitions) -> None:
        """Take the partitions from their committed offsets, once their previous owner is done: its
        last transaction may still be open (a stalled worker), and then the offsets it is committing
        are not known yet. Waiting for it to end (committed, or aborted by the coordinator after its
        transaction timeout) keeps a late commit from being applied twice."""
        self._check_partitions(partitions)
        new_tasks = []
        for tp in partitions:
            owner = self._by_input.get(tp.topic)
            if owner is None:
                continue
            engine, rank = owner
            name = (engine.spec.topic, tp.partition)
            task = self.tasks.get(name)
            if task is None:
                spec = engine.spec
                task = self.tasks[name] = Task(engine, tp.partition, ((spec.topic, tp.partition), (spec.delta_topic, tp.partition), (spec.repartition_topic, tp.partition)))
                new_tasks.append(task)
            self._task_of_input[(tp.topic, tp.partition)] = (task, rank)
        for name in [name for name in self._parked if name not in self.tasks]:
            self._parked.pop(name).close()  # another worker of this host may be waiting to open it
        self._await_previous_owner(new_tasks)
        committed = consumer.committed(partitions, 60) if partitions else []
        self._remember_committed(committed)
        consumer.assign(committed)
        # librdkafka keeps a partition paused through a revocation and a new assignment of it
        # (confluentinc/librdkafka#1849): one flow control paused before a rebalance would never be
        # fetched again, its merge waiting on it forever. What is assigned starts fetching.
        if committed:
            consumer.resume(committed)
        # A merge's wait for an input behind started before this assignment: the time the assignment
        # took (up to a transaction timeout, waiting on a previous owner) is not the inputs' to count.
        for task in self.tasks.values():
            self._waiting_since.pop(task.engine.spec.topic, None)
        log.info("assigned %s", ", ".join(f"{tp.topic}[{tp.partition}]@{tp.offset}" for tp in committed))

    def _check_partitions(self, partitions: list[TopicPartition]) -> None:
        """Partitions added to an input topic under running workers (a worker refuses to start on
        them): the group assigns them, no SOW partition owns what lands there, and the range
        assignor no longer gives `<topic>`, `.delta` and `.repartition` of one partition to one
        worker (two workers would write one SOW partition). Stop before any of it is applied:
        ConfigError, one line, exit status 1 (as at start)."""
        engines = {self._by_input[tp.topic][0] for tp in partitions if tp.topic in self._by_input}
        if not engines:
            return
        try:
            check_partitions(self.admin, [engine.spec for engine in engines])
        except KafkaException as exc:  # a slow broker must not fail the assignment: the check is a safety net
            log.warning("could not check the input topics' partition counts: %s", exc)

    def _remember_committed(self, committed: list[TopicPartition]) -> None:
        self._committed.update(((tp.topic, tp.partition), tp.offset) for tp in committed if tp.offset >= 0)
        self._marks.update(((tp.topic, tp.partition), tp.metadata) for tp in committed)

    def _offsets(self, offsets: dict[tuple[str, int], int]) -> list[TopicPartition]:
        """Offsets to commit, each with its partition's views mark as metadata: the views its
        `<view>.sow` topics follow, the engine's own once the partition is served (it was seeded at
        its restore's end), else the one it was committed with."""
        out = []
        for (t, p), o in offsets.items():
            found = self._task_of_input.get((t, p))
            mark = found[0].engine.views_mark if found is not None and found[0].restored else self._marks.get((t, p))
            out.append(TopicPartition(t, p, o, metadata=mark or ""))
        return out

    def _await_previous_owner(self, tasks: list[Task]) -> None:
        """Wait until no transaction is open on the outputs of these SOW partitions that a new owner
        reads back (`.sow`, `.diff`, and `.holds` of a topic with conflated views)."""
        if not tasks or not self.eos:
            return
        self._await_settled([(topic, task.p) for task in tasks for topic in (
            task.engine.spec.sow_topic, task.engine.spec.diff_topic, *((task.engine.spec.holds_topic,) if task.engine.conflates else ()))])

    def _await_settled(self, partitions: list[tuple[str, int]]) -> int:
        """Wait until no transaction is open on these partitions (a read_committed end offset below the
        log end means one is, or that its commit markers are not written yet: the coordinator answers
        a commit before it writes them), at most a transaction timeout and 30 s. Returns the
        read_committed end offset of the last partition."""
        committed = make_consumer(self.bootstrap, **{"isolation.level": "read_committed"})
        uncommitted = make_consumer(self.bootstrap, **{"isolation.level": "read_uncommitted"})
        deadline = time.monotonic() + self.settings.transaction_timeout_ms / 1000 + 30
        end = 0
        try:
            for topic, p in partitions:
                # end_offsets retries what a freshly created topic answers at first (no leader yet).
                while (end := end_offsets(committed, topic, [p])[p][1]) < end_offsets(uncommitted, topic, [p])[p][1]:
                    if time.monotonic() > deadline:
                        log.warning("%s[%d] still has an open transaction: going on", topic, p)
                        break
                    time.sleep(0.2)
        finally:
            committed.close()
            uncommitted.close()
        return end

    def _on_revoke(self, consumer, partitions) -> None:
        """Commit the transaction left open (this worker still owns the partitions until it returns;
        Kafka Streams commits here too), then forget the partitions. Their stores stay open, parked,
        in case they come back (then they need no full restore)."""
        self._commit_open(rewind=False)  # a failure aborts it: the next owner reads those inputs again
        self._forget(partitions)

    def _on_lost(self, consumer, partitions) -> None:
        """The partitions are someone else's already (the session timed out): what is open cannot
        commit, so it is aborted."""
        if self._open is not None or self._in_txn:
            self._abort("partitions lost")
        self._forget(partitions)

    def _forget(self, partitions) -> None:
        for tp in partitions:
            found = self._task_of_input.pop((tp.topic, tp.partition), None)
            self._committed.pop((tp.topic, tp.partition), None)
            self._marks.pop((tp.topic, tp.partition), None)
            self._paused.discard((tp.topic, tp.partition))
            if found is None:
                continue
            task = found[0]
            if self.tasks.pop(task.name, None) is not None:
                task.engine.detach(task.p)
                if _stop_restore(task) and task.store is not None:  # None: its restore had not begun (a slice ended first)
                    task.store.rollback()  # back to the restore's last commit, and the position it read to
                if task.store is not None:
                    self._parked[task.name] = task.store
        log.info("revoked %s", ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions))

    # the cycle ------------------------------------------------------------------------------
    def cycle(self) -> None:
        # consume() waits its whole timeout to fill a batch (it returns early only with a full one):
        # at most 50 ms, less when the next expiry sweep or the end of an order grace comes first, not
        # at all when the last merge left inputs it could apply (it takes at most `batch_max`).
        # Inputs sent together may still be split across cycles: the order grace keeps them in order.
        wait = 0.05
        self._check_awake()
        if (self._inputs_gone or self._inputs_created) and not self._in_txn:
            if self._inputs_gone:
                self._inputs_gone = False
                self._recreate_gone_topics()
            if self._inputs_created:
                created, self._inputs_created = self._inputs_created, []
                self._await_leaders(created)
                self._subscribe()
        mono = time.monotonic()
        self._cycle_began = mono
        self._cycle_expired = 0
        if self._timed and mono >= self._next_sweep:
            # A sweep due now runs before the consume, not after the inputs it returns are filed and
            # merged (~0.1 s with a full batch): the last cycle's commit already held it back.
            out = self._open or _Batch(self)
            self._open = None
            self._sweep_if_due(out)
            if out.sent or out.offsets or self._in_txn:
                self._open = out
            mono = time.monotonic()
        if self._more:
            wait, self._more = 0.0, False
        elif self._timed:
            wait = min(wait, max(0.001, self._next_sweep - mono))
        if self._release_at:
            wait = min(wait, max(0.001, self._release_at - mono))
            self._release_at = 0.0
        out = self._open
        interval = self.settings.commit_interval_ms / 1000
        if out is not None:  # an open transaction commits on time, inputs or not
            wait = min(wait, max(0.001, out.began + interval - mono))
        began = time.perf_counter()
        messages = self.consumer.consume(self.batch_max, wait)
        self._working = bool(messages)  # a long cycle of inputs is busy all along (busy()), not only at its end
        self._backlogged = len(messages) >= self.batch_max
        consumed = time.perf_counter()
        _CONSUME_SECONDS.inc(consumed - began)
        if _KILLS:
            _kill("consumed")
        if messages:
            self._file(messages)
            _FILE_SECONDS.inc(time.perf_counter() - consumed)
        out = self._open or _Batch(self)
        self._open = None  # while the cycle runs, `out` is the only batch (a failure forgets it)
        if any(not t.restored for t in self.tasks.values()):
            self._restore_some(out)
        worked = bool(messages)
        for engine in self.engines.values():
            n = self._apply(engine, out, out.offsets)
            if n:
                out.applied[engine.spec.topic] += n
                worked = True
        self._sweep_if_due(out)
        if worked or self._cycle_expired:
            self._worked = time.monotonic()
        if out.sent or out.offsets or self._in_txn:
            if time.monotonic() - out.began >= interval or self._stop.is_set():
                self._commit(out, out.offsets, out.applied)
            else:
                self._open = out
        self._flow_control()
        self._note_current()
        self._measure_lag()
        self._working = False

    def _file(self, messages) -> None:
        """Put consumed messages in the queue of their input partition (end-of-partition events mark
        an input as caught up)."""
        task_of = self._task_of_input
        mono = time.monotonic()
        ceiling = time.time_ns() // 1_000_000 + MAX_FUTURE_STAMP_MS  # a publisher's stamp past it counts as it
        run_topic, run_p, skip = None, -1, True
        for msg in messages:
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    found = task_of.get((msg.topic(), msg.partition()))
                    if found is not None:
                        found[0].at_end[found[1]] = True
                        found[0].ends[found[1]] = msg.offset()
                        found[0].unseen_since[found[1]] = 0.0
                elif err.fatal():
                    raise KafkaException(err)
                elif err.code() in _REFUSED_SETTINGS:
                    raise ConfigError(f"the group coordinator refuses this worker's settings: {err.str()}"
                                      " (KSOW_SESSION_TIMEOUT_MS must be within the broker's group.min/max.session.timeout.ms)")
                else:
                    log.warning("consumer: %s", err)
                    if err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:  # an input topic deleted: `cycle` creates it again
                        self._inputs_gone = True
                run_p = -1  # an end event between two messages of a partition: the second starts a run
                continue
            topic, p = msg.topic(), msg.partition()
            if p != run_p or topic != run_topic:  # consume() returns each partition's messages in runs
                run_topic, run_p = topic, p
                found = task_of.get((topic, p))
                if found is None:
                    skip = True  # a partition revoked meanwhile
                    continue
                skip = False
                task, rank = found
                queue, tops, fetched = task.queues[rank], task.tops, task.fetched
                filed = False
            elif skip:
                continue
            offset = msg.offset()
            if offset < fetched[rank]:
                # Filed already: a fetch served again (librdkafka resumes a paused partition from
                # the position its application last saw). Applied twice, it would repeat outputs.
                continue
            kind, ts = msg.timestamp()
            if not filed:  # the run's first message not filed before
                filed = True
                task.filed_at = mono
                task.at_end[rank] = False
                if kind != _LOG_APPEND_TIME and rank < 2:  # `.repartition` (rank 2) carries its input's own stamp
                    self._publisher_stamped.add(task.engine.spec.topic)
            if ts > ceiling and kind != _LOG_APPEND_TIME:
                # A stamp past the clock (a topic without the broker's bound on them, such as one
                # created outside ksow, or anything written to `.repartition`) counts as the clock
                # plus the bound: for the order, a lifetime and what a later delete may remove.
                ts = ceiling
            top = tops[rank]
            if ts > top:
                tops[rank] = top = ts
            fetched[rank] = offset + 1
            # An input is judged at its sort time (what expired before it is gone for it), but a
            # rerouted one at its own timestamp: `.repartition` interleaves the inputs of several
            # source partitions, so its partition time says nothing of when this one came.
            queue.append((top, rank, p, offset, InputMessage(topic, p, offset, msg.key(), msg.value(), message_headers(msg), ts, top if rank < 2 else 0)))
        if self.settings.order_grace_ms:
            tops: dict[str, int] = {}
            for task in self.tasks.values():
                topic = task.engine.spec.topic
                tops[topic] = max(tops.get(topic, 0), *task.tops)
            for topic, top in tops.items():
                marks = self._filings.setdefault(topic, deque())
                if not marks or top > marks[-1][1]:
                    marks.append((mono, top))

    def _apply(self, engine: SowTopicEngine, out: list, offsets: dict) -> int:
        """Apply, in timestamp order, what can be applied of the inputs of one SOW topic."""
        tasks = [t for t in self.tasks.values() if t.engine is engine and t.restored]  # a partition restoring is detached
        if not tasks:
            return 0
        queues = [q for t in tasks for q in t.queues]
        topic = engine.spec.topic
        if not any(queues):
            self._waiting_since.pop(topic, None)
            return 0
        limit, step = self.batch_max, self.settings.chunk
        applied, blocked = 0, False
        deadline = self._cycle_began + self.settings.max_cycle_ms / 1000
        bounds = None  # what may go (nothing is filed while this runs): found for the first merge
        while applied < limit:
            # The expiry clock is looked at before every merge: the first one comes after a commit,
            # a store commit and a consume, long enough for due records.
            self._sweep_if_due(out)
            if applied and self._cycle_full():
                break
            # While records may come due a merge takes a chunk, so a sweep runs between two (and a
            # cycle can end there); else a cycle's worth at once, applied a chunk at a time (a merge
            # of a chunk at a time cost ~3 us an input: producers stamp their messages in bursts of
            # equal timestamps, and a chunk's merge then sorted every input's share of it).
            want = min(step, limit - applied) if self._timed else limit - applied
            if bounds is None:
                bounds = self._merge_bounds(topic, tasks)
            taken = drain_in_order(queues, *bounds, want)
            if taken:
                # Progress resets the wait: it bounds how long the merge is stuck, not how long some
                # input has been empty (during a long backlog the bounding input is emptied by every drain).
                self._waiting_since.pop(topic, None)
                cut = None
                for at in range(0, len(taken), step):
                    if (applied or at) and time.monotonic() >= deadline:
                        cut = at
                        break
                    began = time.perf_counter()
                    chunk = [entry[4] for entry in taken[at:at + step]]
                    self._applying = (engine, chunk, offsets)
                    done = engine.handle(chunk, time.time_ns() // 1_000_000, out, deadline)
                    for m in chunk[:done]:
                        offsets[(m.topic, m.partition)] = m.offset + 1
                    self._applying = None
                    _APPLY_SECONDS.inc(time.perf_counter() - began)
                    if done < len(chunk):
                        cut = at + done
                        break
                if cut is not None:  # the cycle ran its time: the rest go back, in order, for the next
                    _put_back(tasks, taken[cut:])
                    applied += cut
                    break
                applied += len(taken)
            if len(taken) < want:  # nothing more may go now
                blocked = True
                break
        if not blocked:  # the cycle is full, or took its limit
            if any(queues):
                self._more = True
        else:
            if not applied:  # an input that is behind may still hold older entries: the wait starts now
                self._waiting_since.setdefault(topic, time.monotonic())
            if self.settings.order_grace_ms and any(queues):
                self._hold(topic, queues)
        if _KILLS and applied:
            _kill("apply")
        return applied

    def _merge_bounds(self, topic: str, tasks: list[Task]) -> tuple:
        """(behind, force, caught_up) of drain_in_order for the topic's inputs: what may go now."""
        # A paused input is not fetched: it may be behind whatever its end-of-partition said.
        paused = self._paused
        # An input the group does not assign (its topic was deleted) has nothing to wait for.
        assigned = self._task_of_input
        behind = [(not e or tp in paused) and tp in assigned for t in tasks for e, tp in zip(t.at_end, t.inputs)]
        since = self._waiting_since.get(topic)
        force = since is not None and (time.monotonic() - since) * 1000 >= self.settings.max_idle_ms
        if force:  # waited long enough for an input that is behind: apply what is here
            metrics.ENFORCED.inc()
        caught_up = self._caught_up_bounds(topic, tasks) if self.settings.order_grace_ms else None
        return behind, force, caught_up

    def _cycle_full(self) -> bool:
        """Whether the cycle has run for `timed_cycle_ms` and expired records meanwhile: no sweep runs
        while a cycle commits, and the commit grows with the cycle, so while records come due under
        a backlog of inputs, cycles stay short and expiries on time. With nothing coming due, cycles
        stay long (a commit costs the loop a round trip to the broker)."""
        return self._cycle_expired > 0 and time.monotonic() - self._cycle_began >= self.settings.timed_cycle_ms / 1000

    def _caught_up_bounds(self, topic: str, tasks: list[Task]) -> list[tuple]:
        """For each input of a SOW topic, a sort key its messages not fetched yet will follow, were it
        caught up (drain_in_order uses it for the inputs that are): its last entry, and past the grace
        the largest sort time filed that long ago and, when the broker stamps the inputs (`timestamps:
        arrival`, LogAppendTime), the clock minus the grace (a message appended since has a later
        timestamp). Publishers' stamps can be any distance behind the worker's clock."""
        grace = self.settings.order_grace_ms
        marks = self._filings.get(topic)
        settled = self._settled.get(topic, 0)
        if marks:
            cutoff = time.monotonic() - grace / 1000
            while marks and marks[0][0] <= cutoff:
                settled = marks.popleft()[1]
            self._settled[topic] = settled
        clock = 0 if topic in self._publisher_stamped else time.time_ns() // 1_000_000 - grace - 1
        floor = (max(settled, clock), _AFTER_ALL)
        bounds = []
        for t in tasks:
            for rank, q in enumerate(t.queues):
                own = q[-1] if q else (t.tops[rank], rank, t.p, _AFTER_ALL)
                bounds.append(own if own > floor else floor)
        return bounds

    def _hold(self, topic: str, queues: list[deque]) -> None:
        """Entries stay queued: have the next consume return when the grace frees the oldest."""
        head = min(q[0][0] for q in queues if q)
        marks = self._filings.get(topic)
        grace = self.settings.order_grace_ms / 1000
        # By the clock only when the broker stamps the inputs (see _caught_up_bounds).
        release = float("inf") if topic in self._publisher_stamped else time.monotonic() + (head + 1 - time.time_ns() / 1_000_000) / 1000 + grace
        if marks:
            release = min(release, marks[0][0] + grace)
        if time.monotonic() < release < float("inf") and (not self._release_at or release < self._release_at):
            self._release_at = release

    def _commit_open(self, rewind: bool = True) -> bool:
        """Commit the batch the last cycle left open, if any (before a restore, a rebalance, a stop)."""
        out, self._open = self._open, None
        return out is None or self._commit(out, out.offsets, out.applied, rewind)

    def _checkpoint(self, out: "_Batch") -> None:
        """Commit, in the middle of an input that removes many records, what is done so far: its
        outputs and store changes, with the offsets of the inputs applied before it (not its own, so
        a crash applies it again, and it then finds only what it had not removed yet). Raises
        BatchAborted when the commit fails: the batch was rolled back and is read again."""
        if self._applying is None:
            return
        engine, chunk, offsets = self._applying
        done = dict(offsets)
        current = engine.current
        for m in chunk:
            if m is current:
                break
            done[(m.topic, m.partition)] = m.offset + 1
        if not self._commit(out, done, Counter()):
            raise BatchAborted("the batch could not commit")
        metrics.CHECKPOINTS.inc()
        if _KILLS:
            _kill("checkpoint")
        if self._stop.is_set():
            # Stopping (SIGTERM) while one input removes millions of records: what it did is
            # committed, nothing is staged, and the partition's next owner applies it again (finding
            # only what is left), as after a crash here; the worker does not wait for it to end.
            raise BatchAborted("stopping in the middle of an input")

    def _sweep_if_due(self, out: list) -> None:
        """Expire what is due and release conflated view events whose interval ended, every
        `expiry_tick_ms` (in the batch's transaction: a record expires exactly once)."""
        self._check_awake()
        mono = time.monotonic()
        if mono < self._next_sweep:
            return
        self._next_sweep = mono + self.settings.expiry_tick_ms / 1000
        began = time.perf_counter()
        if self._ends_asked is not None:
            self._collect_ends()  # before the clocks are worked out: the freshest answer bounds them
        now = time.time_ns() // 1_000_000
        limit = self.settings.expire_batch
        for task in self.tasks.values():
            if not task.restored:
                continue
            engine = task.engine
            if engine.spec.expiry.active:
                expired, oldest = engine.expire_due(task.p, now, out, limit, self._expiry_clock(task, now))
                if expired:
                    self._cycle_expired += expired
                    task.lateness.observe((now - oldest) / 1000)
                    if _KILLS:
                        _kill("sweep")
            if engine.conflates:
                engine.release_views(task.p, now, out)
        if self._ends_wanted:
            self._ask_ends()
        _SWEEP_SECONDS.inc(time.perf_counter() - began)

    def _check_awake(self) -> None:
        """After a gap in the loop (the process stopped, a slow commit or restore), what the inputs'
        ends said is stale: data may have come meanwhile, and a sweep by the clock would expire
        records an input sent in time still finds (and the merge could pass over an older input).
        Each input is caught up again only if its end has not moved since its last end event (asked
        of the broker); else it is behind until fetched, and the wait for it counts from now."""
        mono = time.monotonic()
        gap = mono - self._awake_at if self._awake_at else 0.0
        self._awake_at = mono
        if gap <= STALL_SECONDS:
            return
        log.info("the loop stood still %.1f s: asking where its inputs end", gap)
        for task in self.tasks.values():
            task.filed_at = mono
            for rank, (topic, p) in enumerate(task.inputs):
                if task.at_end[rank]:
                    try:
                        high = self.consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=2.0, cached=False)[1]
                    except KafkaException:
                        high = None
                    task.at_end[rank] = high == task.ends[rank]
        self._awake_at = time.monotonic()

    def _expiry_clock(self, task: Task, now: int) -> int:
        """The instant up to which a partition's records may expire now: `now` when its inputs are
        caught up, else the time of the next input to apply (the first queued of each input; for
        one behind with none queued, the last it filed: a later message has a later timestamp), so
        an update or a delete that reached Kafka before a record's instant finds it there however
        far behind the worker is (as `ksow snapshot`'s fold has it). An input that has more on the
        broker than its last end-of-partition event said is behind too: its new messages may be
        fetched and waiting behind other topics' backlog in the consumer. An input that stays
        behind with nothing filed for `max_idle_ms` (as the order merge) no longer holds expiry back."""
        clock = now
        paused = self._paused
        idle_ms = self.settings.max_idle_ms
        assigned = self._task_of_input
        for rank, q in enumerate(task.queues):
            if q:
                bound = q[0][0]
            elif task.inputs[rank] not in assigned:  # its topic was deleted: nothing to wait for
                continue
            elif not task.at_end[rank] or task.inputs[rank] in paused:
                if (time.monotonic() - task.filed_at) * 1000 >= idle_ms:
                    continue  # behind, but nothing came for that long: not a backlog being worked off
                bound = task.tops[rank]
            elif self._has_unseen(task, rank, idle_ms):
                bound = task.tops[rank]
            elif self._backlogged:
                bound = self._caught_up_as_of(task, rank, idle_ms)
                if bound is None:
                    continue
            else:
                continue
            if bound < clock:
                clock = bound
        return clock

    def _caught_up_as_of(self, task: Task, rank: int, idle_ms: int) -> int | None:
        """For an input caught up by its last end event while the consumer is backlogged: the time
        up to which the broker confirmed it had nothing more (less the grace, as the broker's and
        this host's clocks may differ), else its last input (held back, `idle_ms` at most, as
        `_has_unseen`); None when it need not hold expiry back."""
        tp = task.inputs[rank]
        self._ends_wanted.add(tp)
        seen = self._ends_seen.get(tp)
        if seen is not None and seen[0] == task.ends[rank]:
            return seen[1] - self.settings.order_grace_ms
        return task.tops[rank] if self._still_holds(task, rank, idle_ms) else None

    def _collect_ends(self) -> None:
        """Take the broker's answer to the question in flight on where inputs end, if it came."""
        futures, at = self._ends_asked
        if not all(f.done() for f in futures.values()):
            return
        self._ends_asked = None
        for tp, future in futures.items():
            try:
                self._ends_seen[(tp.topic, tp.partition)] = (future.result().offset, at)
            except KafkaException as exc:
                log.debug("end of %s[%d]: %s", tp.topic, tp.partition, exc)

    def _ask_ends(self) -> None:
        """Ask where the inputs wanted since the last question end, unless one is still in flight
        (never waits). A sweep collects the answer first and asks again last, so the clocks it
        works out go by an answer asked one sweep before, at most every `expiry_tick_ms`."""
        if self._ends_asked is not None:
            return
        wanted, self._ends_wanted = self._ends_wanted, set()
        at = time.time_ns() // 1_000_000
        try:
            futures = self.admin.list_offsets({TopicPartition(t, p): OffsetSpec.latest() for t, p in wanted})
        except KafkaException as exc:
            log.debug("asking where inputs end: %s", exc)
            return
        self._ends_asked = (futures, at)

    def _has_unseen(self, task: Task, rank: int, idle_ms: int) -> bool:
        """Whether an input caught up has messages past its last end-of-partition event (the end the
        consumer learnt from its last fetch: no request). An open transaction of its producer counts
        (its messages may be older than the ones after it) for `idle_ms` at most: one left open by a
        producer that died must not hold the partition's expiry back until the broker aborts it."""
        topic, p = task.inputs[rank]
        high = self.consumer.get_watermark_offsets(TopicPartition(topic, p), cached=True)[1]
        return high > task.ends[rank] and self._still_holds(task, rank, idle_ms)

    @staticmethod
    def _still_holds(task: Task, rank: int, idle_ms: int) -> bool:
        """Whether an input caught up by its last end event but not known to have nothing more still
        holds expiry back: for `idle_ms` from when it was first found so (until its next end event)."""
        mono = time.monotonic()
        since = task.unseen_since[rank]
        if not since:
            task.unseen_since[rank] = mono
            return True
        return (mono - since) * 1000 < idle_ms

    # commit ---------------------------------------------------------------------------------
    def _commit(self, out: _Batch, offsets: dict[tuple[str, int], int], applied: Counter, rewind: bool = True) -> bool:
        """Commit the transaction (outputs and input offsets), then the stores. False when it could
        not: the batch was aborted and rolled back, and with `rewind` the inputs sought back to the
        committed offsets (`_recover`; a rebalance callback has its partitions taken from it anyway).

        The broker's part (the tail of the outputs, the offsets, the commit: round trips that release
        the GIL) runs on the committer thread while this one builds the stores' write batches, which
        are applied only once the transaction committed."""
        positions, failures = out.positions, out.failures
        committing = offsets  # under exactly-once, with the offsets that fence a zombie
        started = time.perf_counter()
        try:
            if out.error is not None:
                raise out.error
            if self.eos:
                if not self._in_txn:
                    self.producer.begin_transaction()
                    self._in_txn = True
                committing = self._fencing_offsets(offsets, out.sent)
                metadata = self.consumer.consumer_group_metadata() if committing else None
                ending = self._committer.submit(self._end_transaction, self._offsets(committing), metadata)
            else:
                ending = self._committer.submit(self.producer.flush)
            preparing = time.perf_counter()
            try:
                prepared = {name: task.store.prepare() for name, task in self.tasks.items() if task.restored and task.store is not None and task.store.dirty}
            finally:
                waiting = time.perf_counter()
                _PREPARE_SECONDS.inc(waiting - preparing)
                ending.result()
                _COMMIT_WAIT_SECONDS.inc(time.perf_counter() - waiting)
            self._in_txn = False
            if positions.failed or (failures and failures.errors):
                raise KafkaException((positions.failed or failures.errors)[0])
        except KafkaException as exc:
            if rewind:
                self._recover(exc)
            else:
                self._abort(exc.args[0] if exc.args else exc)
            return False
        self._aborts_in_a_row = 0
        self._committed.update(committing)
        if _KILLS:
            _kill("store")
        ends = positions.ends(out.changelog)
        writing = time.perf_counter()
        now_ms = time.time_ns() // 1_000_000
        for name, task in self.tasks.items():
            store = task.store
            if store is None or not task.restored:  # a restore commits its own store, with the position it read to
                continue
            position = ends.get((task.engine.spec.sow_topic, task.p))
            if position is not None and position > store.meta("changelog"):
                store.set_meta("changelog", position)
                store.set_meta(_CHANGELOG_AT, now_ms)
            if store.dirty:
                store.commit(prepared.get(name))
        _STORE_COMMIT_SECONDS.inc(time.perf_counter() - writing)
        if not self.eos and offsets:
            self.consumer.commit(offsets=self._offsets(offsets), asynchronous=True)
        metrics.BATCH_SECONDS.observe(time.perf_counter() - started)
        for topic, n in applied.items():
            metrics.INPUTS.labels(topic).inc(n)
        for topic, n in out.take_counts().items():
            metrics.OUTPUTS.labels(topic).inc(n)
        return True

    def _end_transaction(self, committing: list[TopicPartition], metadata) -> None:
        """The broker's part of a commit (on the committer thread): the input offsets, then the commit,
        which waits for every output to be delivered."""
        producer = self.producer
        if committing:
            producer.send_offsets_to_transaction(committing, metadata, 30)
        if _KILLS:
            producer.flush()
            _kill("commit")
        producer.commit_transaction(60)

    def _fencing_offsets(self, offsets: dict[tuple[str, int], int], sent: int) -> dict[tuple[str, int], int]:
        """The input offsets a transaction commits: this batch's, or when it has none (a cycle that
        only expired records, restored a partition or released view events) one offset already
        committed, committed again. A transaction's offsets commit only while its consumer's group
        generation is current (the coordinator checks the request's generation, whatever partitions
        it names), so a stalled worker that wakes up and expires records, or restores a partition,
        before it learns that its partitions moved, cannot commit: a transaction without offsets would
        not be checked at all. One offset is enough for the check (every owned partition's committed
        offset, sent again with each transaction, made the broker spend about 1.4 times the CPU an
        expiry it spends now: docs/benchmarks.md). With no offset known yet (nothing committed nor
        applied since the assignment) an input's low watermark stands in: the consumer starts there
        anyway (once committed, it is remembered like any other)."""
        if offsets:
            return offsets
        if self._committed:
            tp, offset = next(iter(self._committed.items()))
            return {tp: offset}
        if not sent or not self.tasks:
            return {}
        topic, p = next(iter(self.tasks.values())).inputs[0]
        return {(topic, p): end_offsets(self.consumer, topic, [p])[p][0]}

    def _produce_when_room(self, o: Output, callback) -> None:
        while True:
            self.producer.poll(0.05)
            try:
                self.producer.produce(o.topic, o.value, o.key, -1 if o.partition is None else o.partition, on_delivery=callback, timestamp=o.timestamp, headers=o.headers)
                return
            except BufferError:
                continue

    def _recover(self, exc: KafkaException) -> None:
        """A batch that could not commit (fenced, a rebalance took the partitions, a broker error):
        abort it, forget everything it changed and read its inputs again from the committed offsets."""
        self._abort(exc.args[0] if exc.args else exc)
        assigned = self.consumer.assignment()
        self._committed.clear()
        if assigned:
            committed = self.consumer.committed(assigned, 30)
            self._remember_committed(committed)
            for tp in committed:
                tp.offset = tp.offset if tp.offset >= 0 else -2  # OFFSET_BEGINNING when nothing was committed
                self.consumer.seek(tp)
        if self._aborts_in_a_row > 1:
            self._stop.wait(min(_ABORT_PAUSE_MAX_S, _ABORT_PAUSE_S * 2 ** (self._aborts_in_a_row - 2)))

    def _abort(self, err: object) -> None:
        """Abort the open transaction and forget everything it changed: the stores' staged writes, the
        queued inputs, the views' holds (restored before going on). Where the consumer reads from
        next is the caller's: `_recover` seeks back to the committed offsets; in a rebalance callback
        every partition goes (eager rebalancing) and the next assignment starts from them."""
        log.warning("batch not committed, aborting it: %s", err)
        metrics.ABORTED.inc()
        self._aborts_in_a_row += 1
        self._applying = None
        self._open = None
        self._waiting_since.clear()  # the inputs are read again: no merge is waiting on one yet
        if self.eos and (self._in_txn or self._replace_producer):
            self._in_txn = False
            try:
                if self._replace_producer or (err is not None and getattr(err, "fatal", lambda: False)()):
                    raise KafkaException(err)
                self.producer.abort_transaction(30)
            except KafkaException:
                log.warning("transactional producer is fenced or failed: starting a new one")
                self._renew_producer()  # the old one cannot begin a transaction any more
        code = err.code() if isinstance(err, KafkaError) else None
        if code in _TOPIC_GONE:
            self._recreate_gone_topics()
        elif code in _REFUSED_BY_CONFIG:
            # The producer made of the refused messages' sequence numbers a gap that the aborted
            # transaction leaves: its next batch failed on "skipped sequence numbers", a second
            # abort. A new producer starts afresh.
            try:
                self._fit_outputs(described_configs(self.admin, self._outputs, 10), renew=True)
            except KafkaException as exc:  # the next refused batch looks again
                log.warning("could not read the output topics' settings: %s", exc)
        for task in list(self.tasks.values()):
            _stop_restore(task)
            if task.store is not None:
                task.store.rollback()
            for q in task.queues:
                q.clear()
            task.at_end = [False, False, False]
            task.tops = [0, 0, 0]
            task.fetched = [-1, -1, -1]  # the consumer is sought back (see above)
            task.restored = False  # views' holds and the store are read back before going on

    # restore --------------------------------------------------------------------------------
    def _restore_some(self, out: "_Batch") -> None:
        """Bring newly assigned SOW partitions up to date, for at most `restore_slice_ms` a cycle, a
        `.sow` batch at a time with expiry sweeps between: the partitions this worker serves already
        go on applying inputs, expiring and releasing view events between slices (as Kafka Streams
        restores between its running tasks' processing), where a restore that ran to its end first
        held them all up (about 13 s a million changelog records) and kept the consumer from polling.

        Until its store reached the end of `<topic>.sow` a partition is detached from its engine, and
        nothing reads or writes its store but the restore. Its own inputs wait in their queues
        (paused when long); so does, with the inputs of its topic after it, one of a served partition
        that would touch it (a SowKey it owns, sent to another partition; a delete by filter), so
        that the topic's inputs keep their order: applied directly it would meet a half-built store,
        and through `.repartition` it could come after inputs sent later."""
        pending = [t for t in self.tasks.values() if not t.restored]
        for task in pending:  # all of them before anything is applied
            if task.replay is None:
                task.engine.detach(task.p, restoring=True)  # forgets views' holds of an earlier, aborted attempt
                task.replay = self._restoring(task)
        deadline = time.monotonic() + self.settings.restore_slice_ms / 1000
        for task in pending:
            try:
                while True:
                    for o in next(task.replay) or ():  # a re-seed's step: into this batch's transaction
                        out.append(o)
                    self._sweep_if_due(out)
                    if time.monotonic() >= deadline:
                        break
            except StopIteration as done:
                task.replay = None
                self._serve(task, *done.value, out)
            except BaseException:
                task.replay = None  # a restore that raised is over: the next one starts again (from the store rolled back)
                raise
            if time.monotonic() >= deadline:
                break
        if any(not t.restored for t in self.tasks.values()):
            self._more = True  # the next consume does not wait: the restore goes on

    def _restoring(self, task: Task) -> Generator[list[Output] | None, None, tuple[bool, bool]]:
        """The restore of one partition, a step a `.sow` batch (`_restore_some`), then the re-seed of
        its changelog if it needs one and the seed of its views that need one (a step yields its
        messages); returns whether the partition must then purge its records, and whether it seeded
        views."""
        spec = task.engine.spec
        store = task.store or self._parked.pop(task.name, None)
        # A store this process still holds (an eager rebalance gave the partition back, or an abort
        # restores it again) never changed hands: what another owner did meanwhile, its purge
        # included, is on the changelog the replay reads.
        changed_hands = store is None
        if store is None:
            if spec.persistence is Persistence.PERSISTENT:
                store = open_store(self.data_dir, spec.topic, task.p, task.engine.indexes, self.instance)
            else:
                store = open_partition_store("memory", None, task.engine.indexes)
        task.store = store
        if spec.persistence is Persistence.TRANSIENT:
            self._resume_events(task, store)
            return False, False
        count, reseed = yield from self._replaying(task, store)
        yield from check_key_format(store, spec, task.p, self.group)  # a store of an older SowKey rule or key: stop, say how to rebuild
        # A recreated changelog's replay stays staged until its re-seed commits: no step commits meanwhile.
        if (yield from check_encoding(store, spec, task.engine.codec, task.p, project=not reseed)) and not reseed:
            log.warning("%s partition %d: the topic's encoding changed since its records were written to %s: writing its %d "
                        "records there again in the new one", spec.topic, task.p, spec.sow_topic, store.count())
            metrics.RESEEDS.inc()
            reseed = True
        if reseed:
            yield from self._reseeding(task, store)
        else:  # the stamps, now: a store that stopped before its next commit would be taken for an earlier release's
            store.commit()
        seeds = self._views_to_seed(task) if store.size() else []
        if seeds:
            yield from self._seeding_views(task, store, seeds)
        log.info("restored %s partition %d: %d changelog records, %d in SOW", spec.topic, task.p, count, store.count())
        return spec.persistence is Persistence.SIMPLE and changed_hands, bool(seeds)

    def _reseeding(self, task: Task, store: PartitionStore) -> Generator[list[Output], None, None]:
        """Write the store's records back to `<topic>.sow`, `_RESEED_STEP` a step: each step's
        messages go into the batch the restore runs in, so a large SOW takes many transactions, not
        one that outlasts the transaction timeout and aborts each time it is redone (a million
        records took 7 s here). The partition is not served meanwhile: its inputs wait and its store
        does not change. What says the re-seed is done (the recreated log's incarnation and position,
        the encoding's stamp) stays staged until the store commits, after the transaction of the
        last step; an abort or a crash before then re-seeds again from the start. Each record goes
        out as the store has it now: after a recreated changelog's replay, the version that log gave."""
        for records in _chunks(store.latest(), _RESEED_STEP):
            yield task.engine.reseed(task.p, records)

    def _views_to_seed(self, task: Task) -> list[tuple[ViewProcessor, bool]]:
        """The views the partition must seed (`views_to_seed`), each with whether the records it does
        not match get tombstones: those its `<view>.sow` partition may hold. When no input of the
        partition carries a views mark, a view is seeded only if that partition of its topic is
        empty: what it holds was written by a release that kept no mark (it kept the view up to date),
        or through inputs of other partitions (another partition's input of a record this partition
        owns, applied here directly: only that input's offset was committed)."""
        seeding, marked = views_to_seed(task.engine.views, [self._marks.get(tp) for tp in task.inputs])
        seeds = []
        for view in seeding:
            holds = self._holds_messages(view.sow_topic, task.p)
            if marked or not holds:
                seeds.append((view, holds))
        return seeds

    def _seeding_views(self, task: Task, store: PartitionStore, seeds: list[tuple[ViewProcessor, bool]]) -> Generator[list[Output], None, None]:
        """Write the partition's records to the `<view>.sow` of each view that must seed them
        (`_views_to_seed`: a view new to the topic, or whose definition changed), with tombstones
        for the records a view does not match when asked, `_RESEED_STEP` records a step, each step's
        messages into the batch the restore runs in, as `_reseeding`. That the partition follows the
        views as they are now goes with its inputs' offsets into the transaction that serves it
        (`_serve`): a crash before then seeds again, writing the same records again."""
        log.info("%s partition %d: writing its %d records to the views new or changed since it was last committed: %s",
                 task.engine.spec.topic, task.p, store.size(), ", ".join(view.view.name for view, _ in seeds))
        for records in _chunks(store.latest(), _RESEED_STEP):
            yield [o for view, tombstones in seeds for o in view.seed(task.p, records, tombstones)]

    def _holds_messages(self, topic: str, p: int) -> bool:
        """Whether partition p of `topic` holds messages (True when the broker cannot tell)."""
        try:
            low, high = end_offsets(self.consumer, topic, [p])[p]
        except KafkaException as exc:
            log.warning("could not ask where %s[%d] ends: %s", topic, p, exc)
            return True
        return high > low

    def _serve(self, task: Task, purge: bool, seeded: bool, out: "_Batch") -> None:
        """A partition whose restore is done: attached to its engine, and served from now on. What it
        tells (a purge) goes in the batch's transaction; the store commits after it. After a seed of
        its views, the offsets committed for its inputs go again in the transaction, now with the
        views' mark (`_offsets`); an input not committed yet has none to carry it."""
        if seeded:
            for tp in task.inputs:
                if tp in self._committed and tp not in out.offsets:
                    out.offsets[tp] = self._committed[tp]
        partition = task.engine.attach(task.p, task.store)
        if purge:  # a `simple` SOW does not survive its owner: `.sow` is told
            partition.purge(task.store.records(), time.time_ns() // 1_000_000, out)
        if task.engine.conflates:
            self._read_holds(task)
        task.restored = True

    def _replay_changelog(self, task: Task, store: PartitionStore) -> tuple[int, bool]:
        """`_replaying` run to its end at once (what bench/restore.py times)."""
        steps = self._replaying(task, store)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def _replaying(self, task: Task, store: PartitionStore) -> Generator[None, None, tuple[int, bool]]:
        """Replay `<topic>.sow` from the store's position to its end, a step a batch. Returns (records
        read, whether the store must re-seed the changelog: the log was deleted and created again
        since the store read it, and the store keeps the SOW rather than lose it). Closed before its
        end (the partition revoked, the batch aborted), it leaves the store with its staged writes:
        rolled back, the store is at its last commit, with the position it had read to.

        A recreated log is told by its topic ID (`topic_incarnation`, kept in the store's metadata),
        not by its offsets: they may have grown past the store's position already (records of an
        aborted re-seed, or of a worker that started on the new log without this store). Whatever
        the new log holds was written after the store's records, so it is read from its start over
        them before they are written back. The new incarnation and position are only staged: they
        become durable with the store commit after the re-seed's transaction, so an abort or a
        crash before that finds the log recreated again, and re-seeds again. A store of an earlier
        release, which kept no incarnation, or on a cluster that gives no topic IDs, is taken as
        recreated when it is ahead of the log's settled end."""
        topic = task.engine.spec.sow_topic
        consumer = make_consumer(self.bootstrap, **{"isolation.level": "read_committed"})
        try:
            ((low, high),) = end_offsets(consumer, topic, [task.p]).values()
            position = store.meta("changelog")
            incarnation, known = topic_incarnation(self.admin, topic), store.meta("changelog_incarnation")
            if known and incarnation:
                recreated = known != incarnation
            else:
                if position > high and self.eos:  # let the markers of a commit land first (this worker's own, after an abort)
                    high = self._await_settled([(topic, task.p)])
                recreated = position > high
            if recreated:
                log.warning("%s[%d] was deleted and created again since the store read it (to offset %d; the new log ends at %d): "
                            "keeping the store and re-seeding the changelog", topic, task.p, position, high)
                metrics.RESEEDS.inc()
                position = low
            elif position < low or self._tombstones_cleaned(store, topic, task.p):  # rebuild from the start of the log
                store.clear()
                position = low
            count = 0
            if position < high:
                consumer.assign([TopicPartition(topic, task.p, position)])
                restore, p, headers_of = task.engine.restore_many, task.p, message_headers
                uncommitted = 0
                # A batch of what one consume hands out at a time: parsed, and its records' committed
                # versions read, together (the records of a SOW written in order are mostly new).
                for batch in read_batches(consumer, {(topic, p): high}, size=_RESTORE_BATCH):
                    skipped = restore(p, store, [(m.key(), m.value(), headers_of(m), m.timestamp()[1]) for m in batch])
                    for n, exc in skipped:  # written by anything else: it must not stop restore
                        log.warning("skipped %s[%d]@%d: not a SOW record (%s)", topic, p, batch[n].offset(), exc)
                        metrics.CHANGELOG_SKIPPED.inc()
                    count += len(batch)
                    uncommitted += len(batch)
                    if uncommitted >= _RESTORE_COMMIT:
                        store.set_meta("changelog", batch[-1].offset() + 1)
                        store.commit()
                        uncommitted = 0
                    yield
            store.set_meta("changelog", high)
            store.set_meta(_CHANGELOG_AT, time.time_ns() // 1_000_000)
            if incarnation:
                store.set_meta("changelog_incarnation", incarnation)
            if not recreated:
                store.commit()
            return count, recreated and store.count() > 0
        finally:
            consumer.close()

    def _note_current(self) -> None:
        """Every minute, between transactions, note in each owned store that it is where its position
        says now (`_CHANGELOG_AT`): no other worker writes its partition's changelog while this one
        owns it. A store of a partition that had no commit for a day (a quiet topic) is then not
        taken for one left behind, and rebuilt, at its next rebalance or restart."""
        now_ms = time.time_ns() // 1_000_000
        if self._open is not None or self._in_txn or now_ms - self._noted_at < _CHANGELOG_AT_REFRESH_MS:
            return
        self._noted_at = now_ms
        for task in self.tasks.values():
            if task.restored and task.store is not None and task.engine.spec.persistence is not Persistence.TRANSIENT:
                task.store.set_meta(_CHANGELOG_AT, now_ms)
                task.store.commit()  # its metadata alone: nothing is staged between transactions

    def _tombstones_cleaned(self, store: PartitionStore, topic: str, p: int) -> bool:
        """Whether the log cleaner may have removed tombstones past the store's position: it read
        the changelog up to there longer ago than the topic's delete.retention.ms (a store parked
        on disk, or in a worker, while other workers owned its partition). Replayed from its
        position it would keep the records those tombstones removed; rebuilt from the start of the
        log it does not. A store that never noted when it read (an earlier release) is kept."""
        at = store.meta(_CHANGELOG_AT)
        if not at or store.meta("changelog") == 0:
            return False
        age, retention = time.time_ns() // 1_000_000 - at, delete_retention_ms(self.admin, topic)
        if age < retention - _CHANGELOG_AT_REFRESH_MS:
            return False
        log.warning("%s[%d]: the store read it %d s ago, more than its delete.retention.ms (%d s) less a minute allows: "
                    "rebuilding it from the start of the log", topic, p, age // 1000, retention // 1000)
        return True

    def _resume_events(self, task: Task, store: PartitionStore) -> None:
        """A transient topic keeps no SOW, so no changelog says how far its event IDs went: its counter
        would start from this worker's clock alone, and an owner before it whose clock ran ahead may
        have handed out higher ones (`sow-seq` is never reused). The last committed events of its
        `.diff` partition say (a transaction's marker follows its events: a few offsets back hold one)."""
        for msg in self._read_committed(task.engine.spec.diff_topic, task.p, last=_DIFF_TAIL):
            task.engine.resume_events(store, message_headers(msg))
        if store.dirty:  # now, not with the first batch: an abort of that batch would forget it
            store.commit()

    def _read_holds(self, task: Task) -> None:
        for msg in self._read_committed(task.engine.spec.holds_topic, task.p):
            for view in task.engine.views:
                view.restore_hold(task.p, msg.key(), msg.value())

    def _read_committed(self, topic: str, p: int, last: int | None = None) -> Iterator:
        """The committed messages of one partition up to its end as of now: all of them, or those of
        its `last` offsets."""
        consumer = make_consumer(self.bootstrap, **{"isolation.level": "read_committed"})
        try:
            ((low, high),) = end_offsets(consumer, topic, [p]).values()
            if high > low:
                consumer.assign([TopicPartition(topic, p, low if last is None else max(low, high - last))])
                yield from read_until(consumer, {(topic, p): high})
        finally:
            consumer.close()

    # flow control -----------------------------------------------------------------------------
    def _flow_control(self) -> None:
        """Pause input partitions whose queue is long (another input of their SOW partition is behind,
        or a backlog larger than a cycle), resume them when it has drained.

        A resumed partition is first sought to the message after the last one filed: librdkafka
        (2.12, 2.13) counts an end-of-partition event it hands out as a message, so a partition
        paused after reaching its end would resume one past the end of the log, find that offset out
        of range and start again from the beginning (auto.offset.reset), applying everything again."""
        high = self.settings.queue_high
        pause, resume = [], []
        for task in self.tasks.values():
            for rank, ((topic, p), q) in enumerate(zip(task.inputs, task.queues)):
                tp = (topic, p)
                if len(q) >= high and tp not in self._paused:
                    pause.append(TopicPartition(topic, p))
                    self._paused.add(tp)
                elif len(q) < high // 2 and tp in self._paused:
                    resume.append(TopicPartition(topic, p))
                    self._paused.discard(tp)
                    # Its end-of-partition came before the pause: messages appended since are not
                    # fetched yet, so it is behind until the next fetch says otherwise.
                    task.at_end[rank] = False
                    if task.fetched[rank] >= 0:
                        self.consumer.seek(TopicPartition(topic, p, task.fetched[rank]))
        if pause:
            self.consumer.pause(pause)
        if resume:
            self.consumer.resume(resume)

    # read-only views for the HTTP side ----------------------------------------------------------
    BUSY_S = 0.25  # a loop that did something this recently counts as busy (its cycles are at most 50 ms apart)

    def input_lag(self) -> Counter:
        """Inputs on the broker not applied and committed yet, by SOW topic, over the input partitions
        this worker owns, as the loop last measured them (`_measure_lag`, at most a second ago).
        Read by /metrics and /status, on another thread."""
        return self._lag

    def _measure_lag(self) -> None:
        """Each owned input partition's end as of its last fetch (librdkafka's cached watermark, the
        last stable offset under read_committed) less its committed offset, summed by SOW topic,
        once a second. On the loop thread: with confluent-kafka 2.16 a call on the consumer from
        another thread waits for the loop's `consume` to let go of it, which it may not do for
        seconds (/metrics timed out after 10 s)."""
        mono = time.monotonic()
        if mono < self._lag_at + 1.0:
            return
        self._lag_at = mono
        committed, watermarks = self._committed, self.consumer.get_watermark_offsets
        lag: Counter = Counter()
        for task in self.tasks.values():
            for topic, p in task.inputs:
                done = committed.get((topic, p))
                if done is None:
                    continue
                _, high = watermarks(TopicPartition(topic, p), cached=True)
                if high > done:
                    lag[task.engine.spec.topic] += high - done
        self._lag = lag  # replaced whole: a reader never sees it half made

    def busy(self) -> bool:
        """Whether the loop is applying inputs, or had inputs or expiries within the last BUSY_S:
        queries then give way (processor.query.engine.QueryPacer)."""
        return self._working or time.monotonic() - self._worked < self.BUSY_S

    # (A copy of the task list is taken in one step under the GIL: no lock, so a query never waits
    # for a restore or a commit, and never makes the loop wait.)
    def served(self, topic: str) -> list[int]:
        return sorted(t.p for t in list(self.tasks.values()) if t.restored and t.engine.spec.topic == topic)

    def stores(self, topic: str) -> list[PartitionStore]:
        tasks = sorted(list(self.tasks.values()), key=lambda t: t.p)
        return [t.store for t in tasks if t.restored and t.engine.spec.topic == topic and t.store is not None]
