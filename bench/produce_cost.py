"""What producing an expiry's messages costs the worker's loop thread, whatever the engine does.

    python bench/produce_cost.py [-n 100000] [--rate 16667]

An expiry sends three messages (`.sow` tombstone, `.diff`, `EXP.`), each with the five headers
the contract gives a removal, as the engine renders them (`outputs.render_removal`). This produces `-n` such messages into one open transaction with the
worker's producer settings, then the same messages without headers, and prints the calling
thread's CPU time per message, and what the whole process (librdkafka's threads too, until the
messages are delivered) and the local broker (a `kafka.Kafka` JVM on this machine, if any) spent.
At `--rate` expiries a second (bench/expiry.py: 1,000,000 instants over 60 s) the three produces
alone take a share of one core, which no stream applied by the same process can use: the
throughput ratio of bench/expiry.py with one worker process cannot exceed 1 minus that share.
Last line: `produce: X us a message with headers, Y us without, an expiry's three Z us, S of a
core at R expiries/s; all threads P / Q us a message, broker B / C us`.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import create_topics, kafka_bootstrap, local_broker_cpu_seconds, log, unique_name  # noqa: E402
from processor.contract.types import Op, SowRecord  # noqa: E402
from processor.core.codec import JsonCodec  # noqa: E402
from processor.engine.outputs import Streams, render_removal, sink  # noqa: E402
from processor.kafka.clients import make_producer  # noqa: E402

PARTITIONS = 4


def expiry_messages() -> list[tuple]:
    """The (key, value, headers) of the three messages the engine renders for one expiry."""
    streams = Streams("x.sow", "x.diff", "EXP.x", "x.dead", "x.errors", "x.repartition", ("sow-topic", b"x"))
    record = SowRecord({"id": 1, "px": 0.5, "side": "B", "desk": "d1"}, 1795000000000 << 10, 1795000000000, 1794999940000)
    sent: list = []
    render_removal(Op.EXPIRE, b'["exp",1]', record, (1795000000021 << 10) | 1, 1795000000021, 0, JsonCodec(), streams, sink(sent))
    return [(o.key, o.value, o.headers) for o in sent]


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process
    return usage.ru_utime + usage.ru_stime


def per_message(producer, topic: str, n: int, messages: list[tuple], headers: bool = True) -> tuple[float, float, float | None]:
    """CPU microseconds a message costs: the produce() call's thread (the worker's positional call),
    the whole process until delivered, and the local broker (None without one)."""
    process, broker = _process_cpu(), local_broker_cpu_seconds()
    began = time.thread_time()
    for i in range(n):
        key, value, with_headers = messages[i % 3]
        producer.produce(topic, value, key, i % PARTITIONS, None, None, 0, with_headers if headers else None)
    spent = time.thread_time() - began
    producer.flush(60)
    process = _process_cpu() - process
    broker = None if broker is None else local_broker_cpu_seconds() - broker
    return spent / n * 1e6, process / n * 1e6, None if broker is None else broker / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=100_000, help="messages per measurement")
    parser.add_argument("--rate", type=float, default=1_000_000 / 60, help="expiries a second")
    args = parser.parse_args()
    messages = expiry_messages()
    with kafka_bootstrap() as bootstrap:
        topic = unique_name("produce_cost")
        create_topics(bootstrap, {topic: (PARTITIONS, {})})
        producer = make_producer(bootstrap, **{"transactional.id": unique_name("produce_cost"), "linger.ms": 20})
        producer.init_transactions(60)
        producer.begin_transaction()
        per_message(producer, topic, min(args.n, 10_000), messages)  # warm-up: connections, buffers
        with_headers, process_with, broker_with = per_message(producer, topic, args.n, messages)
        without, process_without, broker_without = per_message(producer, topic, args.n, messages, headers=False)
        producer.commit_transaction(60)
    expiry = 3 * with_headers
    shown = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    share = expiry * args.rate / 1e6
    log(f"{args.n:,} messages each, one transaction, calling thread CPU")
    print(f"  with the five headers of a removal: {with_headers:.2f} us a message")
    print(f"  without headers:                    {without:.2f} us a message")
    print(f"  all threads of this process, until delivered: {process_with:.2f} us a message with headers, {process_without:.2f} without")
    print(f"  the local broker: {shown(broker_with)} us a message with headers, {shown(broker_without)} without")
    print(f"  an expiry's three messages: {expiry:.1f} us; at {args.rate:,.0f} expiries/s {share:.0%} of one core "
          f"(a one-process throughput ratio of at most {max(0.0, 1 - share):.2f} in bench/expiry.py)")
    print(f"produce: {with_headers:.2f} us a message with headers, {without:.2f} us without, "
          f"an expiry's three {expiry:.1f} us, {share:.2f} of a core at {args.rate:,.0f} expiries/s; "
          f"all threads {process_with:.2f} / {process_without:.2f} us a message, broker {shown(broker_with)} / {shown(broker_without)} us")


if __name__ == "__main__":
    main()
