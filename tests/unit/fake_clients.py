"""Scripted stand-ins for the loop's confluent-kafka clients, for unit tests of the loop's own
decisions (what it merges when, what it pauses and resumes, what it re-does after an abort) at
chosen interleavings a real broker would give only by chance. The real broker is in
tests/integration; this never stands in for it there.

The consumer returns the message lists of `script`, one a consume() call, and keeps a partition's
pause through revocation and a new assignment, as librdkafka does (confluentinc/librdkafka#1849).
The producer delivers a transaction's messages when it commits, numbering them per partition."""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import Future
from types import SimpleNamespace

from confluent_kafka import KafkaError, KafkaException, TopicPartition

import processor.runners.faust.loop as loop_module
from processor.runners.faust.loop import LoopSettings, SowLoop
from processor.topology import parse_topology

INPUTS = ("orders", "orders.delta", "orders.repartition")


class Message:
    """What a consumer's reader asks of a confluent_kafka.Message (whose constructor is not public
    before confluent-kafka 2.13, which the bench extra's Quix Streams rules out)."""

    def __init__(self, topic: str, partition: int, offset: int = -1, value: bytes | None = None, ts: int = 0,
                 error: KafkaError | None = None, key: bytes | None = b"k", headers: list | None = None):
        self._fields = (topic, partition, offset, value, ts, error, key, headers)

    def topic(self) -> str:
        return self._fields[0]

    def partition(self) -> int:
        return self._fields[1]

    def offset(self) -> int:
        return self._fields[2]

    def value(self) -> bytes | None:
        return self._fields[3]

    def timestamp(self) -> tuple[int, int]:
        return (2, self._fields[4])  # LogAppendTime

    def error(self) -> KafkaError | None:
        return self._fields[5]

    def key(self) -> bytes | None:
        return self._fields[6]

    def headers(self) -> list | None:
        return self._fields[7]


def end_of(topic: str, partition: int, offset: int) -> Message:
    """The end-of-partition event librdkafka hands out at `offset`."""
    return Message(topic, partition, offset, error=KafkaError(KafkaError._PARTITION_EOF))


class ScriptedConsumer:
    def __init__(self) -> None:
        self.script: list[list[Message]] = []
        self.paused: set[tuple[str, int]] = set()
        self.assigned: list[tuple[str, int]] = []
        self.offsets: dict[tuple[str, int], int] = {}
        self.highs: dict[tuple[str, int], int] = {}  # the broker's end offsets (get_watermark_offsets)
        self.subscriptions: list[list[str]] = []  # what each subscribe() asked for

    def get_watermark_offsets(self, tp, timeout=None, cached=False) -> tuple[int, int]:
        return 0, self.highs.get((tp.topic, tp.partition), 0)

    def subscribe(self, topics, **callbacks) -> None:
        self.subscriptions.append(list(topics))

    def list_topics(self, topic=None, timeout=None) -> SimpleNamespace:
        """Metadata: every topic asked for exists, its partition led by broker 1."""
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions={0: SimpleNamespace(leader=1)})})

    def consume(self, n: int, timeout: float) -> list[Message]:
        return self.script.pop(0) if self.script else []

    def pause(self, partitions) -> None:
        self.paused.update((tp.topic, tp.partition) for tp in partitions)

    def resume(self, partitions) -> None:
        self.paused.difference_update((tp.topic, tp.partition) for tp in partitions)

    def seek(self, tp) -> None:
        pass

    def assign(self, partitions) -> None:
        self.assigned = [(tp.topic, tp.partition) for tp in partitions]

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition(t, p) for t, p in self.assigned]

    def committed(self, partitions, timeout=None) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.offsets.get((tp.topic, tp.partition), -1001)) for tp in partitions]

    def commit(self, offsets=None, asynchronous=True) -> None:
        self.offsets.update(((tp.topic, tp.partition), tp.offset) for tp in offsets or ())

    def consumer_group_metadata(self) -> object:
        return object()

    def close(self) -> None:
        pass


class ScriptedProducer:
    def __init__(self) -> None:
        self.pending: list[tuple] = []
        self.delivered: list[tuple[str, int, int, bytes | None]] = []  # (topic, partition, offset, value) of committed messages
        self.next_offset: dict[tuple[str, int], int] = defaultdict(int)
        self.fail_next_commit: KafkaError | None = None
        self.aborted = 0
        self.config: dict = {}  # what the loop made it with
        self.headers: list[tuple[str, list | None]] = []  # (topic, headers) of every message produced
        self.stamps: list[tuple[str, int]] = []  # (topic, timestamp) of every message produced
        self.keys: list[tuple[str, bytes | None]] = []  # (topic, key) of every message produced

    def init_transactions(self, timeout=None) -> None:
        pass

    def begin_transaction(self) -> None:
        pass

    def produce(self, topic, value=None, key=None, partition=-1, on_delivery=None, callback=None, timestamp=0, headers=None) -> None:
        self.pending.append((topic, partition, value, on_delivery))
        self.headers.append((topic, headers))
        self.stamps.append((topic, timestamp))
        self.keys.append((topic, key))

    def send_offsets_to_transaction(self, offsets, metadata, timeout=None) -> None:
        pass

    def commit_transaction(self, timeout=None) -> None:
        if self.fail_next_commit is not None:
            err, self.fail_next_commit = self.fail_next_commit, None
            raise KafkaException(err)
        self.flush()

    def abort_transaction(self, timeout=None) -> None:
        self.pending.clear()
        self.aborted += 1

    def flush(self, timeout=None) -> int:
        for topic, partition, value, report in self.pending:
            offset = self.next_offset[(topic, partition)]
            self.next_offset[(topic, partition)] += 1
            self.delivered.append((topic, partition, offset, value))
            if report is not None:
                report(None, Message(topic, partition, offset))
        self.pending.clear()
        return 0

    def poll(self, timeout=None) -> int:
        return 0


class ScriptedAdmin:
    """Answers ListOffsets at once from `ends`: where the broker says each partition ends (which the
    consumer's cached `highs` may not know yet)."""

    def __init__(self) -> None:
        self.ends: dict[tuple[str, int], int] = {}
        self.asked: list[list[tuple[str, int]]] = []
        self.gone: set[str] = set()  # topics deleted: the next ensure_topics creates them again
        self.ensured = 0  # times ensure_topics looked
        self.max_message_bytes: dict[str, int] = {}  # the output topics' max.message.bytes that are known
        self.configs: dict[str, dict[str, str]] = {}  # other settings of the output topics

    def ensure_topics(self, wanted) -> list[str]:
        self.ensured += 1
        created, self.gone = sorted(self.gone & set(wanted)), self.gone - set(wanted)
        return created

    def list_offsets(self, request, **kwargs) -> dict:
        self.asked.append(sorted((tp.topic, tp.partition) for tp in request))
        answers = {}
        for tp in request:
            answers[tp] = Future()
            answers[tp].set_result(SimpleNamespace(offset=self.ends.get((tp.topic, tp.partition), 0)))
        return answers


def scripted_loop(monkeypatch, tmp_path, topic: dict | None = None, **settings) -> tuple[SowLoop, ScriptedConsumer, list[ScriptedProducer]]:
    """A loop for one SOW topic `orders` of one partition over scripted clients; the consumers it
    makes to read its own topics find them empty, they are never deleted and created again (unless
    a test names them in its admin's `gone`), and they have the partitions the topology says."""
    consumer = ScriptedConsumer()
    producers: list[ScriptedProducer] = []

    def make_producer(*args, **config) -> ScriptedProducer:
        producers.append(ScriptedProducer())
        producers[-1].config = config
        return producers[-1]

    monkeypatch.setattr(loop_module, "make_consumer", lambda bootstrap, group=None, **config: consumer if group else ScriptedConsumer())
    monkeypatch.setattr(loop_module, "make_producer", make_producer)
    monkeypatch.setattr(loop_module, "end_offsets", lambda c, topic, partitions, timeout=30.0: {p: (0, 0) for p in partitions})
    admin = ScriptedAdmin()
    monkeypatch.setattr(loop_module, "make_admin", lambda bootstrap, **config: admin)
    monkeypatch.setattr(loop_module, "topic_incarnation", lambda admin, topic: 7)  # never recreated
    monkeypatch.setattr(loop_module, "check_partitions", lambda admin, specs, timeout=30.0: None)  # the topology's partition counts
    monkeypatch.setattr(loop_module, "ensure_topics", lambda admin, wanted, timeout=30.0, **replication: admin.ensure_topics(wanted))
    monkeypatch.setattr(loop_module, "described_configs",
                        lambda admin, topics, timeout=30.0: {t: {**admin.configs.get(t, {}), **({"max.message.bytes": str(admin.max_message_bytes[t])}
                                                                                  if t in admin.max_message_bytes else {})}
                                                              for t in topics if t in admin.max_message_bytes or t in admin.configs})
    monkeypatch.setattr(loop_module, "delete_retention_ms", lambda admin, topic: 86_400_000)  # Kafka's default
    topology = parse_topology({"sow": [{"topic": "orders", "key": ["/id"], "partitions": 1, "persistence": "memory", **(topic or {})}]})
    loop = SowLoop(topology, "scripted:9092", "g", tmp_path, None, LoopSettings(**settings), "t")
    return loop, consumer, producers


def assign(loop: SowLoop, consumer: ScriptedConsumer) -> None:
    """The group gives the loop partition 0 of its three inputs (librdkafka calls this in consume())."""
    loop._on_assign(consumer, [TopicPartition(t, 0) for t in INPUTS])


def revoke(loop: SowLoop, consumer: ScriptedConsumer) -> None:
    loop._on_revoke(consumer, [TopicPartition(t, 0) for t in INPUTS])


def applied_inputs(loop: SowLoop) -> list[tuple[str, int]]:
    """(topic, offset) of every input the loop's engine applies from now on, in order."""
    applied: list[tuple[str, int]] = []
    engine = loop.engines["orders"]
    handle = engine.handle

    def recording(messages, now, out, until=None):
        done = len(messages)  # all of them when the chunk fails part way (as a list of them is handed in)
        try:
            done = handle(messages, now, out, until)
            return done
        finally:
            applied.extend((m.topic, m.offset) for m in messages[:done])

    engine.handle = recording
    return applied


def now_ms() -> int:
    return time.time_ns() // 1_000_000
