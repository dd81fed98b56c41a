"""Helpers shared by the benchmarks: broker choice, fast publishing, counting and timing topics,
process memory, and printing figures.

Broker choice is the tests' rule: $KAFKA_BOOTSTRAP when set, else the embedded broker
(processor.broker.embedded) for the duration of the benchmark.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition  # noqa: E402
from confluent_kafka.admin import AdminClient  # noqa: E402

from processor.engine.ordering import drain_in_order  # noqa: E402
from processor.kafka.clients import end_offsets, ensure_topics, make_producer, produce  # noqa: E402


# broker ------------------------------------------------------------------------------------
@contextlib.contextmanager
def kafka_bootstrap() -> Iterator[str]:
    """$KAFKA_BOOTSTRAP, or an embedded broker started (and stopped) around the block."""
    external = os.environ.get("KAFKA_BOOTSTRAP")
    if external:
        log(f"kafka: external {external}")
        yield external
        return
    from processor.kafka.embedded import EmbeddedKafka

    log("kafka: no KAFKA_BOOTSTRAP, starting the embedded broker...")
    with EmbeddedKafka() as kafka:
        log(f"kafka: embedded at {kafka.bootstrap} ({kafka.startup_seconds:.1f}s)")
        yield kafka.bootstrap


def unique_name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def admin(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap})


def create_topics(bootstrap: str, wanted: dict[str, tuple[int, dict[str, str]]]) -> None:
    ensure_topics(admin(bootstrap), wanted)


def delete_topics(bootstrap: str, names: Iterable[str]) -> None:
    """Best effort: benchmarks write hundreds of MB, so they clean up after themselves."""
    names = list(names)
    if not names:
        return
    client = admin(bootstrap)  # held until the futures resolve: a dropped client cancels its requests
    failed = []
    for name, future in client.delete_topics(names, operation_timeout=30).items():
        try:
            future.result()
        except Exception as exc:  # noqa: BLE001 - cleanup must not hide the figures
            failed.append(f"{name} ({exc})")
    if failed:
        log(f"could not delete topics: {', '.join(failed)}")


# publishing -----------------------------------------------------------------------------------
def publisher(bootstrap: str) -> Producer:
    """The producer `publish` uses. A new one holds its first messages back until it has its
    producer ID and the topic's metadata (0.5-1 s here: librdkafka retries the ID on a 500 ms timer):
    a bench that times a stream from its first message sends one through it before the clock starts."""
    return make_producer(bootstrap, **{"linger.ms": 20})


def publish(bootstrap: str, messages: Iterable[tuple[str, bytes | None, bytes]], producer: Producer | None = None) -> tuple[int, float]:
    """Produce (topic, key, value) messages with the project's producer settings (or through
    `producer`, a `publisher`); returns (count, seconds) including the final flush. Keys route with
    the Java client's partitioner."""
    producer = producer or publisher(bootstrap)
    began = time.perf_counter()
    count = 0
    for topic, key, value in messages:
        produce(producer, topic, value, key)
        count += 1
        if count % 10000 == 0:
            producer.poll(0)
    if producer.flush(120) > 0:
        raise RuntimeError("publishing: messages not delivered in 120 s")
    return count, time.perf_counter() - began


# reading topics --------------------------------------------------------------------------------
def _consumer(bootstrap: str) -> Consumer:
    return Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": unique_name("ksow-bench-reader"),
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        "fetch.queue.backoff.ms": 20,
    })


def watermarks(bootstrap: str, topic: str, partitions: int, consumer: Consumer | None = None) -> dict[int, tuple[int, int]]:
    own = consumer is None
    consumer = consumer or _consumer(bootstrap)
    try:
        return end_offsets(consumer, topic, range(partitions))
    finally:
        if own:
            consumer.close()


def count_messages(bootstrap: str, topic: str, partitions: int, consumer: Consumer | None = None) -> int:
    return sum(high - low for low, high in watermarks(bootstrap, topic, partitions, consumer).values())


def wait_for_count(
    bootstrap: str, topic: str, partitions: int, n: int, timeout: float, poll: float = 0.05, alive=None, progress=None
) -> float:
    """Wait until `topic` holds at least n messages; returns the wall time (time.time()) it did.
    `alive()` returning False (e.g. the worker died) stops the wait with an error; `progress(count)`
    is called at every poll (e.g. to sample the CPU time of the process under test)."""
    consumer = _consumer(bootstrap)
    try:
        deadline = time.monotonic() + timeout
        while True:
            count = count_messages(bootstrap, topic, partitions, consumer)
            if progress is not None:
                progress(count)
            if count >= n:
                return time.time()
            if alive is not None and not alive():
                raise RuntimeError(f"gave up waiting for {n} messages on {topic}: the process under test exited")
            if time.monotonic() > deadline:
                have = count_messages(bootstrap, topic, partitions, consumer)
                raise TimeoutError(f"{topic} holds {have} of {n} messages after {timeout:.0f}s")
            time.sleep(poll)
    finally:
        consumer.close()


def wait_for_topic(bootstrap: str, topic: str, alive: Callable[[], bool] = lambda: True, timeout: float = 120) -> None:
    """The worker creates its topics when it starts: wait for them before counting."""
    client = admin(bootstrap)
    deadline = time.monotonic() + timeout
    while topic not in client.list_topics(timeout=10).topics:
        if not alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the worker did not create {topic}")
        time.sleep(0.2)
    time.sleep(1.0)  # leaders settle


def first_last_timestamps(bootstrap: str, topic: str, partitions: int) -> tuple[float, float]:
    """(earliest, latest) Kafka timestamps in seconds over the first and last message of each
    partition: the producer's clock (CreateTime), so the span a producer took to write the topic.
    Transactional topics end with commit markers, which take offsets but are no messages: the last
    message of a partition is the last one read before its end."""
    consumer = _consumer(bootstrap)
    try:
        marks = watermarks(bootstrap, topic, partitions, consumer)
        stamps = []
        for p, (low, high) in marks.items():
            if high <= low:
                continue
            for start, last in ((low, False), (max(low, high - 8), True)):
                consumer.assign([TopicPartition(topic, p, start)])
                seen = None
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    msg = consumer.poll(0.5)
                    if msg is None:
                        continue
                    if msg.error():
                        if msg.error().code() == KafkaError._PARTITION_EOF:
                            break
                        raise KafkaException(msg.error())
                    seen = msg.timestamp()[1] / 1000
                    if not last:
                        break
                if seen is not None:
                    stamps.append(seen)
        if not stamps:
            raise RuntimeError(f"{topic} is empty")
        return min(stamps), max(stamps)
    finally:
        consumer.close()


# ordered inputs ----------------------------------------------------------------------------------
class OrderedInputs:
    """The inputs of each SOW partition merged in the order a ksow worker applies them.

    That order (processor.engine.ordering) is by Kafka timestamp, ties to the earlier topic of
    `topics` (`<topic>` before `<topic>.delta`), each input in offset order; an input not read to its
    end yet may hold an older message, so the merge waits for it. A peer of the worker that does not
    merge this way leaves a different SOW on this workload, whose inputs share broker timestamps
    (LogAppendTime) across the two topics. Its consumer must have `enable.partition.eof` on: the
    end-of-partition events say an input has nothing more to wait for.
    """

    def __init__(self, topics: Sequence[str], partitions: Iterable[int]) -> None:
        self._rank = {topic: rank for rank, topic in enumerate(topics)}
        self._queues = {p: tuple(deque() for _ in topics) for p in partitions}
        self._at_end = {p: [False] * len(topics) for p in self._queues}
        self._ready: deque = deque()  # merged already, not handed out yet
        self._tops = {(p, rank): 0 for p in self._queues for rank in range(len(topics))}  # sort time per input

    def add(self, messages: Iterable[Message]) -> None:
        """File consumed messages (end-of-partition events included) under their partition."""
        for msg in messages:
            rank = self._rank[msg.topic()]
            p = msg.partition()
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    raise KafkaException(err)
                self._at_end[p][rank] = True
                continue
            self._at_end[p][rank] = False
            top = self._tops[(p, rank)] = max(self._tops[(p, rank)], msg.timestamp()[1])  # the largest so far: the worker's rule
            self._queues[p][rank].append((top, rank, p, msg.offset(), msg))

    def drain(self, limit: int) -> list[Message]:
        """Up to `limit` messages that can be applied now, in order within each partition."""
        if len(self._ready) < limit:
            for p, queues in self._queues.items():
                self._ready.extend(entry[4] for entry in drain_in_order(queues, [not end for end in self._at_end[p]]))
        ready = self._ready
        return [ready.popleft() for _ in range(min(limit, len(ready)))]


# processes ---------------------------------------------------------------------------------
def proc_status_kb(pid: int, field: str) -> int | None:
    """A field of /proc/<pid>/status in kB (VmHWM: peak RSS, VmRSS: current RSS); None if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_seconds(pid: int | None = None) -> float | None:
    """User + system CPU time of a process (all its threads) from /proc/<pid>/stat; None if gone."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants (from the parent ids in /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += children.get(current, [])
    return tree


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU time of a process tree: each live process's user + system time, with that of its
    children already reaped (cutime, cstime); None if `pid` is gone."""
    total = None
    for member in process_tree(pid):
        try:
            with open(f"/proc/{member}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total = (total or 0.0) + sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def local_broker_cpu_seconds() -> float | None:
    """CPU time of the Kafka brokers running on this machine (JVMs whose main class is kafka.Kafka:
    the embedded broker, or one started from a Kafka distribution); None when there is none."""
    total = None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"kafka.Kafka" in args:
            cpu = cpu_seconds(int(entry))
            if cpu is not None:
                total = (total or 0.0) + cpu
    return total


def tree_peak_rss_mb(pid: int) -> float | None:
    """Sum of the peak RSS (VmHWM) of a process tree's live members; None if `pid` is gone."""
    peaks = [kb for kb in (proc_status_kb(member, "VmHWM") for member in process_tree(pid)) if kb is not None]
    return sum(peaks) / 1024 if peaks else None


def peak_rss_mb(pid: int | None = None) -> float | None:
    kb = proc_status_kb(pid or os.getpid(), "VmHWM")
    return None if kb is None else kb / 1024


# figures ------------------------------------------------------------------------------------
def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def fmt(value: float | None, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}{unit}"


def print_table(title: str, rows: list[tuple[str, list[float | None], str, int]]) -> None:
    """rows: (label, one value per run, unit, digits). Prints every run and the median."""
    print(title)
    for label, values, unit, digits in rows:
        runs = ", ".join(fmt(v, "", digits) for v in values)
        print(f"  {label:<38} {fmt(median(values), unit, digits):>14}   (runs: {runs})")
    sys.stdout.flush()


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or not b:
        return None
    return a / b


def add_workload_arguments(parser) -> None:
    """The options every workload bench shares (bench/ingest.py, bench/peers.py)."""
    parser.add_argument("-n", type=int, default=200_000, help="inputs (default 200000)")
    parser.add_argument("-k", type=int, default=20_000, help="distinct keys (default 20000)")
    parser.add_argument("--deltas", type=float, default=0.3, help="share of delta publishes (default 0.3)")
    parser.add_argument("--runs", type=int, default=1, help="repeat with fresh topics; figures are medians")
