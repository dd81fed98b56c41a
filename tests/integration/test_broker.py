"""The session broker behaves like real Kafka where ksow depends on it.

These checks guard against the defects of fake brokers (batch offsets, compaction,
configs) and check the embedded broker's lifecycle (`ksow broker`, no leaked JVMs).
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, OffsetSpec

from processor.testing import running

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
needs_java = pytest.mark.skipif(
    shutil.which("java") is None or shutil.which("mvn") is None,
    reason="the embedded broker needs Java 17+ and Maven",
)


def create_topic(admin: AdminClient, name: str, partitions: int, **config: str) -> None:
    fut = admin.create_topics([NewTopic(name, partitions, 1, config=config)])[name]
    fut.result(timeout=30)


def produce(bootstrap: str, topic: str, records: list[tuple[str, str]], **conf: object) -> dict:
    """Produce and return {partition: [(key, value, offset), ...]} from delivery reports."""
    delivered: dict[int, list[tuple[str, str, int]]] = defaultdict(list)
    errors: list[KafkaError] = []

    def on_delivery(err, msg) -> None:  # type: ignore[no-untyped-def]
        if err is not None:
            errors.append(err)
        else:
            delivered[msg.partition()].append(
                (msg.key().decode(), msg.value().decode(), msg.offset())
            )

    producer = Producer({"bootstrap.servers": bootstrap, **conf})
    for key, value in records:
        producer.produce(topic, key=key, value=value, on_delivery=on_delivery)
        producer.poll(0)
    assert producer.flush(30) == 0
    assert not errors, errors
    return delivered


def consume_all(bootstrap: str, topic: str, expected: int, timeout: float = 30.0) -> list:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"g_{topic}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    got = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < expected and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            got.append(msg)
    finally:
        consumer.close()
    return got


def test_keyed_messages_round_trip_in_partition_order(kafka_bootstrap, admin, unique_name):
    topic = unique_name
    create_topic(admin, topic, 3)
    records = [(f"k{i % 17}", f"v{i}") for i in range(300)]
    # Idempotence keeps a retried batch in its place (a retry after a broker's first, refused
    # request put v0 after v289 once); without it Kafka promises no order across retries.
    delivered = produce(kafka_bootstrap, topic, records, **{"linger.ms": 5, "enable.idempotence": True})
    assert len(delivered) == 3, "keys should spread over all 3 partitions"

    got = consume_all(kafka_bootstrap, topic, len(records))
    assert len(got) == len(records)
    by_partition: dict[int, list[tuple[str, str, int]]] = defaultdict(list)
    for msg in got:
        by_partition[msg.partition()].append(
            (msg.key().decode(), msg.value().decode(), msg.offset())
        )
    assert dict(by_partition) == dict(delivered)
    for rows in by_partition.values():
        assert [offset for _, _, offset in rows] == list(range(len(rows)))
    # one key lives in one partition, and keeps its produce order there
    partition_of = {}
    for part, rows in by_partition.items():
        for key, _, _ in rows:
            assert partition_of.setdefault(key, part) == part
    for key in {k for k, _ in records}:
        sent = [v for k, v in records if k == key]
        seen = [v for k, v, _ in by_partition[partition_of[key]] if k == key]
        assert seen == sent


def test_compacted_topic_is_accepted_and_described(admin, unique_name):
    topic = unique_name
    create_topic(admin, topic, 1, **{"cleanup.policy": "compact"})
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    configs = admin.describe_configs([resource])[resource].result(timeout=30)
    assert configs["cleanup.policy"].value == "compact"


def test_high_watermark_counts_every_record_of_multi_record_batches(
    kafka_bootstrap, admin, unique_name
):
    topic = unique_name
    create_topic(admin, topic, 2)
    records = [(f"key{i % 5}", "x" * 50) for i in range(1000)]
    delivered = produce(
        kafka_bootstrap,
        topic,
        records,
        **{"linger.ms": 100, "batch.num.messages": 500, "compression.type": "lz4"},
    )
    request = {TopicPartition(topic, p): OffsetSpec.latest() for p in range(2)}
    highs = {
        tp.partition: fut.result(timeout=30).offset
        for tp, fut in admin.list_offsets(request).items()
    }
    assert sum(highs.values()) == len(records)
    for part, high in highs.items():
        assert high == len(delivered.get(part, []))


def test_compaction_really_removes_superseded_values(kafka_bootstrap, admin, unique_name):
    """Proves the cleaner runs with the test broker's settings (sow topics rely on it)."""
    topic = unique_name
    create_topic(
        admin,
        topic,
        1,
        **{
            "cleanup.policy": "compact",
            "segment.ms": "100",
            "min.cleanable.dirty.ratio": "0.01",
            "delete.retention.ms": "100",
        },
    )
    produce(kafka_bootstrap, topic, [(f"k{i % 3}", f"v{i}") for i in range(30)])
    deadline = time.monotonic() + 60
    while True:
        time.sleep(0.3)
        # a later record makes the broker roll the segment, so the old one can be cleaned
        produce(kafka_bootstrap, topic, [("roll", "r")])
        low = admin.list_offsets({TopicPartition(topic, 0): OffsetSpec.earliest()})
        kept = consume_all(kafka_bootstrap, topic, 10_000, timeout=3)
        latest = {m.key().decode(): m.value().decode() for m in kept}
        if len(kept) < 10 or time.monotonic() > deadline:
            break
    assert len(kept) < 10, f"nothing compacted: {len(kept)} records kept"
    assert latest["k0"] == "v27" and latest["k1"] == "v28" and latest["k2"] == "v29"
    assert list(low.values())[0].result(timeout=10).offset == 0  # compaction, not deletion


def test_embedded_pom_copy_matches_repo_pom():
    from processor.kafka.embedded import POM_XML

    assert (REPO / "ops" / "kafka-pom.xml").read_text() == POM_XML


def _read_line(stream, timeout: float) -> str:  # type: ignore[no-untyped-def]
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, f"no output within {timeout}s"
    return stream.readline().decode().strip()


@needs_java
def test_run_foreground_prints_address_first_and_stops_on_sigterm():
    proc = subprocess.Popen(
        [sys.executable, "-c", "from processor.kafka.embedded import run_foreground; "
         "run_foreground(None)"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        first = _read_line(proc.stdout, 120)
        assert re.fullmatch(r"127\.0\.0\.1:\d+", first), first
        client = AdminClient({"bootstrap.servers": first})
        assert 1 in client.list_topics(timeout=10).brokers
        del client  # close it before the broker goes away
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@needs_java
def test_a_port_in_use_is_a_clear_error_not_another_broker_taken_for_this_one():
    from click.testing import CliRunner

    from processor.cli.commands import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["broker", "--port", str(port)])
    assert result.exit_code == 1 and f"port {port} is in use" in result.output, result.output
    assert f"127.0.0.1:{port}" not in result.output  # no address of a broker that is not this one


@needs_java
@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux-only")
def test_broker_jvm_dies_with_a_killed_parent():
    script = (
        "import sys, time\n"
        "from processor.kafka.embedded import EmbeddedKafka\n"
        "k = EmbeddedKafka().start()\n"
        "print(k.process.pid, k.data_dir, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE)
    jvm_pid = None
    try:
        jvm_pid_text, data_dir = _read_line(proc.stdout, 120).split(" ", 1)
        jvm_pid = int(jvm_pid_text)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 60
        while running(jvm_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(jvm_pid), "broker JVM outlived its SIGKILLed parent"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if jvm_pid is not None and running(jvm_pid):
            os.kill(jvm_pid, signal.SIGKILL)
    # the next embedded start sweeps the orphaned temp dir; do it here to be tidy
    from processor.kafka.embedded import _sweep_stale_temp_dirs

    _sweep_stale_temp_dirs()
    assert not Path(data_dir).exists()

