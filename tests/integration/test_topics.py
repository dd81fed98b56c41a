"""Topics ksow creates carry their replication settings; impossible settings fail before Kafka does."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import ConfigResource, ConfigSource

from processor.contract.errors import ConfigError
from processor.kafka.clients import ensure_topics, replication_settings

pytestmark = pytest.mark.integration


def topic_settings(admin, name: str) -> tuple[int, str, ConfigSource]:
    """(replicas of partition 0, min.insync.replicas, where that value comes from)."""
    replicas = len(admin.list_topics(name, timeout=10).topics[name].partitions[0].replicas)
    resource = ConfigResource(ConfigResource.Type.TOPIC, name)
    entry = admin.describe_configs([resource])[resource].result(timeout=30)["min.insync.replicas"]
    return replicas, entry.value, ConfigSource(entry.source)


def test_created_topics_get_replication_factor_and_min_insync_replicas(admin, unique_name):
    brokers = len(admin.list_topics(timeout=10).brokers)
    factor, min_insync = replication_settings(brokers)
    plain, compacted = f"{unique_name}.in", f"{unique_name}.sow"
    ensure_topics(admin, {plain: (2, {}), compacted: (2, {"cleanup.policy": "compact"})})
    for name in (plain, compacted):
        assert topic_settings(admin, name) == (factor, str(min_insync), ConfigSource.DYNAMIC_TOPIC_CONFIG)


def test_settings_from_the_caller_and_the_environment(admin, unique_name, monkeypatch):
    brokers = len(admin.list_topics(timeout=10).brokers)
    ensure_topics(admin, {f"{unique_name}.a": (1, {})}, replication_factor=1, min_insync_replicas=1)
    assert topic_settings(admin, f"{unique_name}.a")[:2] == (1, "1")

    monkeypatch.setenv("KSOW_REPLICATION_FACTOR", str(brokers + 1))
    with pytest.raises(ConfigError, match=f"replication factor {brokers + 1} does not fit a cluster of {brokers} broker"):
        ensure_topics(admin, {f"{unique_name}.b": (1, {})}, replication_factor=1)
    assert f"{unique_name}.b" not in admin.list_topics(timeout=10).topics
    ensure_topics(admin, {f"{unique_name}.a": (1, {})})  # nothing to create: the settings do not matter


def test_input_topics_with_publisher_stamps_refuse_stamps_far_in_the_future(admin, kafka_bootstrap, unique_name):
    """One stamp an hour ahead would put every later input of its partition after an hour of the
    other inputs (a partition sorts by its largest stamp so far): the broker refuses it."""
    import time

    from confluent_kafka import Producer

    from processor.contract.limits import MAX_FUTURE_STAMP_MS
    from processor.kafka.clients import topic_configs
    from processor.topology import parse_topology

    spec = parse_topology({"sow": [{"topic": unique_name, "key": ["/id"], "timestamps": "publisher", "partitions": 1}]}).sow[0]
    ensure_topics(admin, topic_configs(spec))
    reports: list = []
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    now = int(time.time() * 1000)
    for ts in (now - 3_600_000, now + MAX_FUTURE_STAMP_MS // 2, now + 3_600_000):
        producer.produce(spec.topic, b'{"id": 1}', timestamp=ts, on_delivery=lambda err, msg: reports.append(err and err.name()))
        producer.flush(30)  # one batch each: the broker refuses a batch whole
    assert reports == [None, None, "INVALID_TIMESTAMP"]
