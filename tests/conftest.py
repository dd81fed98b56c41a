"""Shared fixtures: one real Kafka broker per test session, and per-test topic names.

Broker choice, first that applies:
  1. $KAFKA_BOOTSTRAP (an already running cluster),
  2. a testcontainers KafkaContainer when a Docker engine answers,
  3. the embedded broker (processor.broker.embedded: a KRaft JVM, needs Java 17 + Maven).
$KSOW_TEST_BROKER=embedded|docker forces 2 or 3.
"""

from __future__ import annotations

import os
import re
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(_REPO))

DOCKER_KAFKA_IMAGE = os.environ.get("KSOW_KAFKA_IMAGE", "confluentinc/cp-kafka:7.9.0")


def _docker_engine_answers() -> bool:
    """Quick, silent probe: no engine here must cost well under a second."""
    try:
        import docker

        client = docker.from_env(timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - any failure means "no usable engine"
        return False


def _announce(request: pytest.FixtureRequest, text: str) -> None:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(text)


@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest) -> Iterator[str]:
    """Bootstrap address of the session's Kafka broker (see module docstring)."""
    external = os.environ.get("KAFKA_BOOTSTRAP")
    if external:
        _announce(request, f"kafka: external {external}")
        yield external
        return
    forced = os.environ.get("KSOW_TEST_BROKER", "").lower()
    if forced == "docker" or (forced != "embedded" and _docker_engine_answers()):
        from testcontainers.kafka import KafkaContainer

        began = time.monotonic()
        container = (
            KafkaContainer(DOCKER_KAFKA_IMAGE)
            .with_kraft()
            .with_env("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false")
            .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
            .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
            .with_env("KAFKA_LOG_CLEANER_BACKOFF_MS", "500")
        )
        with container:
            bootstrap = container.get_bootstrap_server()
            _announce(
                request,
                f"kafka: container {DOCKER_KAFKA_IMAGE} at {bootstrap} "
                f"({time.monotonic() - began:.1f}s)",
            )
            yield bootstrap
        return
    from processor.kafka.embedded import EmbeddedKafka

    with EmbeddedKafka() as kafka:
        _announce(
            request,
            f"kafka: embedded at {kafka.bootstrap} ({kafka.startup_seconds:.1f}s), "
            f"log {kafka.log_path}",
        )
        yield kafka.bootstrap


@pytest.fixture(scope="session")
def admin(kafka_bootstrap: str):  # type: ignore[no-untyped-def]
    """A confluent-kafka AdminClient on the session broker."""
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": kafka_bootstrap})


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A topic base name unique to this test: t_<testname>_<random6>, [a-zA-Z0-9_] only.

    Why: the session shares one broker, and auto topic creation is off, so every test
    creates its own topics and must never collide with another test's (or a rerun's).
    """
    test = re.sub(r"[^a-zA-Z0-9_]", "_", request.node.name).strip("_")[:60]
    return f"t_{test}_{uuid.uuid4().hex[:6]}"
