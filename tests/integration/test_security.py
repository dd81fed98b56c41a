"""ksow on a secured cluster: the embedded broker in secured mode (SASL/SCRAM-SHA-512 over TLS,
an authorizer, KRaft) and every kind of client reaching it through one Kafka client config.

The broker is this module's own (the session broker is plaintext). Subprocesses get a clean
environment without the session's KAFKA_BOOTSTRAP, so only what a test passes can connect them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson
import pytest
from confluent_kafka import KafkaException, TopicPartition

from processor.contract import headers as H
from processor.kafka.clients import (
    KafkaRefused,
    end_offsets,
    ensure_topics,
    make_admin,
    make_consumer,
    make_producer,
    read_until,
    topic_configs,
)
from processor.kafka.config import load_kafka_config, use_kafka_config
from processor.kafka.embedded import EmbeddedKafka
from processor.topology import load_topology
from tests.integration.workers import Worker, wait_until, write_topology

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("java") is None or shutil.which("mvn") is None, reason="the embedded broker needs Java 17+ and Maven"),
]


@pytest.fixture(scope="module")
def secured():
    with EmbeddedKafka(secured=True) as kafka:
        yield kafka


@pytest.fixture
def as_admin(secured):
    """The clients of this process use the broker's admin credentials."""
    use_kafka_config(load_kafka_config(secured.client_config_path, {}))
    yield secured.client_config_path
    use_kafka_config(None)


@pytest.fixture
def topic(secured, as_admin, tmp_path):
    """A SOW topic with its topics created on the secured broker; yields (name, topology file)."""
    name = f"sec_{uuid.uuid4().hex[:8]}"
    path = write_topology(tmp_path, name, partitions=2, timestamps="publisher")  # the snapshot test sets instants
    ensure_topics(make_admin(secured.bootstrap), topic_configs(load_topology(path).sow[0]))
    return name, path


def ksow(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAFKA_") and k != "KSOW_KAFKA_CONFIG"}
    return subprocess.run([sys.executable, "-m", "processor.cli", *args], capture_output=True, text=True, env=env, timeout=timeout, check=False)


def read_topic(bootstrap: str, topic: str, partitions: int = 2) -> list:
    consumer = make_consumer(bootstrap)
    try:
        ends = {(topic, p): high for p, (_, high) in end_offsets(consumer, topic, range(partitions)).items()}
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        return list(read_until(consumer, ends, idle_timeout=60))
    finally:
        consumer.close()


def put_on_sow(bootstrap: str, spec, record: dict) -> str:
    """Write a record to `<topic>.sow` as a worker would (no worker needed to query it)."""
    key = spec.key_spec.sow_key(record)
    producer = make_producer(bootstrap)
    producer.produce(spec.sow_topic, orjson.dumps(record), key.encode(), headers=[(H.OP, b"insert"), (H.SEQ, b"1")])
    assert producer.flush(30) == 0
    return key


def test_cli_publishes_and_queries_through_kafka_config(secured, topic):
    name, path = topic
    config = str(secured.client_config_path)
    done = ksow("publish", "--bootstrap", secured.bootstrap, "--kafka-config", config, "--topology", str(path), name, '{"id": 1, "v": "cli"}')
    assert done.returncode == 0, done.stderr[-2000:]
    assert [orjson.loads(m.value()) for m in read_topic(secured.bootstrap, name)] == [{"id": 1, "v": "cli"}]

    key = put_on_sow(secured.bootstrap, load_topology(path).sow[0], {"id": 2, "v": "sow"})
    done = ksow("query", "--kafka-config", config, "--topology", str(path), name)  # bootstrap.servers from the file
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [orjson.loads(line) for line in done.stdout.splitlines()]
    assert [(r["sow_key"], r["record"]) for r in rows] == [(key, {"id": 2, "v": "sow"})]


def test_python_client_uses_the_config(secured, topic):
    from processor.client.sow_client import Client

    name, path = topic
    client = Client(secured.bootstrap, str(path))
    client.publish(name, {"id": 7, "v": "py"}, delta=True)
    client.flush()
    # a delta publish goes to <topic> with sow-command (ordered with the full publishes of the record)
    sent = read_topic(secured.bootstrap, name)
    assert [(orjson.loads(m.value()), dict(m.headers())["sow-command"]) for m in sent] == [({"id": 7, "v": "py"}, b"delta_publish")]
    key = put_on_sow(secured.bootstrap, client.spec(name), {"id": 8})
    assert [(e.sow_key, e.record) for e in client.query(name)] == [(key, {"id": 8})]


def test_clients_without_credentials_are_refused(secured, topic, tmp_path):
    from processor.client.sow_client import Client

    name, path = topic
    began = time.monotonic()
    done = ksow("publish", "--bootstrap", secured.bootstrap, "--topology", str(path), name, '{"id": 1}')
    assert done.returncode == 1 and f"Error: Kafka: cannot read the metadata of {name}: " in done.stderr
    assert time.monotonic() - began < 90

    wrong = tmp_path / "wrong.properties"
    wrong.write_text(secured.client_config_path.read_text().replace(secured.client_config["sasl.password"], "not-the-password"))
    use_kafka_config(load_kafka_config(wrong, {}))
    client = Client(secured.bootstrap, str(path))
    began = time.monotonic()
    with pytest.raises(KafkaRefused, match="Authentication failed"):
        client.publish(name, {"id": 2})  # its first look at the topic's metadata is refused
    assert time.monotonic() - began < 5  # at once, not when the metadata call's 10 s are up
    for call in (lambda: client.query(name), lambda: client.delete(name, filter="/id = 2"), lambda: next(iter(client.subscribe(name, timeout=3)))):
        began = time.monotonic()
        with pytest.raises(KafkaRefused, match="Authentication failed"):  # one exception for a refused login, whatever the call
            call()
        assert time.monotonic() - began < 5
    with pytest.raises(KafkaException):
        make_admin(secured.bootstrap).list_topics(timeout=5)


def test_a_refused_login_is_told_with_its_reason_and_a_worker_pool_stops_at_once(secured, topic, tmp_path):
    """Audit: query and subscribe said only "Broker transport failure" (after 30 s for a query), and
    `ksow up --workers 2` restarted its workers for 58 s before it stopped. Publish, subscribe and
    delete then took ~11 s to say so (a metadata call's timeout): they say it at once."""
    name, path = topic
    wrong = tmp_path / "wrong.properties"
    wrong.write_text(secured.client_config_path.read_text().replace(secured.client_config["sasl.password"], "not-the-password"))
    for command in (["query", name], ["subscribe", name, "--sow", "--timeout", "3"], ["publish", name, '{"id": 1}'],
                    ["delete", name, "--filter", "/id = 1"]):
        began = time.monotonic()
        done = ksow(*command, "--kafka-config", str(wrong), "--topology", str(path))
        took = time.monotonic() - began
        assert done.returncode == 1 and f"Kafka at {secured.bootstrap} refused this client: " in done.stderr, done.stderr[-2000:]
        assert "Authentication failed" in done.stderr and "not-the-password" not in done.stderr
        assert took < 9, (command, took)
    began = time.monotonic()
    done = ksow("up", "--kafka-config", str(wrong), "--topology", str(path), "--group", f"g-{name}",
                "--data-dir", str(tmp_path / "pool"), "--workers", "2", timeout=90)
    assert done.returncode == 1 and "the cluster refused its client settings: stopping" in done.stderr, done.stderr[-2000:]
    assert "restarting" not in done.stderr and time.monotonic() - began < 30


def _user(secured, tmp_path, role: str, grants=()) -> tuple[str, Path]:
    """A new SCRAM user of the secured broker allowed `grants`, (resource type, name, pattern type,
    operation) each: (its principal, a client config file that logs in as it)."""
    from confluent_kafka.admin import AclBinding, AclPermissionType, ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

    user, password = f"{role}_{uuid.uuid4().hex[:6]}", f"{role}-password"
    admin = make_admin(secured.bootstrap)
    upsert = UserScramCredentialUpsertion(user, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192), password.encode())
    for future in admin.alter_user_scram_credentials([upsert]).values():
        future.result(30)
    principal = f"User:{user}"
    if grants:
        bindings = [AclBinding(kind, name, pattern, principal, "*", operation, AclPermissionType.ALLOW) for kind, name, pattern, operation in grants]
        for future in admin.create_acls(bindings).values():
            future.result(30)
    config = tmp_path / f"{role}.properties"
    config.write_text(secured.client_config_path.read_text()
                      .replace(f"sasl.username={secured.client_config['sasl.username']}", f"sasl.username={user}")
                      .replace(secured.client_config["sasl.password"], password))
    return principal, config


def test_a_user_without_access_is_told_which_topic_it_may_not_use(secured, topic, tmp_path):
    """Audit: a user the authorizer gives no access got "Unknown partition" after 31-37 s."""
    name, path = topic
    _, config = _user(secured, tmp_path, "nobody")
    for command, topic_named in ((["query", name], f"{name}.sow"), (["subscribe", name, "--sow", "--timeout", "3"], f"{name}.sow"),
                                 (["delete", name, "--keys", "x"], name)):
        began = time.monotonic()
        done = ksow(*command, "--kafka-config", str(config), "--topology", str(path))
        assert done.returncode == 1, done.stderr[-2000:]
        assert f"this client is not authorized to use Kafka topic {topic_named} (Broker: Topic authorization failed)" in done.stderr
        assert time.monotonic() - began < 25
    assert "where the workers announce themselves (Broker: Topic authorization failed)" in ksow("query", name, "--kafka-config", str(config), "--topology", str(path)).stderr


@pytest.mark.spark
def test_spark_snapshot_reads_the_secured_topics(secured, topic):
    pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'ksow[spark]')")
    from processor.batch.session import get_spark
    from processor.batch.snapshot import snapshot

    name, path = topic
    spec = load_topology(path).sow[0]
    producer = make_producer(secured.bootstrap)
    t0 = int(time.time() * 1000) - 60_000
    producer.produce(name, orjson.dumps({"id": 1, "a": 1}), b"1", timestamp=t0)
    producer.produce(f"{name}.delta", orjson.dumps({"id": 1, "b": 2}), b"1", timestamp=t0 + 1000)
    producer.produce(name, orjson.dumps({"id": 2, "a": 3}), b"2", timestamp=t0 + 2000)
    assert producer.flush(30) == 0

    rows = snapshot(get_spark("local[2]", "ksow-secured-snapshot"), secured.bootstrap, spec, t0 + 1500).collect()
    assert sorted(orjson.loads(r["record"]) for r in rows) == [{"id": 1, "a": 1, "b": 2}]


def test_worker_keeps_the_sow_on_the_secured_broker(secured, as_admin, tmp_path):
    name = f"secw_{uuid.uuid4().hex[:8]}"
    path = write_topology(tmp_path, name, partitions=2)
    worker = Worker(secured.bootstrap, path, f"g-{name}", tmp_path / "data", extra_args=("--kafka-config", str(as_admin)))
    worker.start(wait=False)
    try:
        admin = make_admin(secured.bootstrap)

        def running_and(check):
            if worker.proc.poll() is not None:
                raise AssertionError(f"worker exited ({worker.proc.returncode}):\n{worker.log()[-4000:]}")
            return check()

        wait_until(lambda: running_and(lambda: f"{name}.sow" in admin.list_topics(timeout=10).topics), timeout=120)
        producer = make_producer(secured.bootstrap)
        for i in range(5):
            producer.produce(name, orjson.dumps({"id": i, "v": i}), str(i).encode())
        assert producer.flush(30) == 0
        records = wait_until(lambda: running_and(lambda: len(msgs := read_topic(secured.bootstrap, f"{name}.sow")) >= 5 and msgs), timeout=120)
        assert sorted(orjson.loads(m.value())["id"] for m in records) == list(range(5))
    finally:
        worker.stop()


def test_secured_broker_restarts_on_its_data_dir_with_the_same_credentials(tmp_path):
    with EmbeddedKafka(secured=True, data_dir=tmp_path / "kafka") as first:
        config = dict(first.client_config)
        make_admin(first.bootstrap, **config).list_topics(timeout=30)
    with EmbeddedKafka(secured=True, data_dir=tmp_path / "kafka") as again:
        assert again.client_config == config
        assert 1 in make_admin(again.bootstrap, **config).list_topics(timeout=30).brokers


def test_ksow_broker_secured_prints_address_then_client_config():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAFKA_")}
    proc = subprocess.Popen([sys.executable, "-m", "processor.cli", "broker", "--secured"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    try:
        bootstrap, config_path = proc.stdout.readline().strip(), proc.stdout.readline().strip()
        config = load_kafka_config(config_path, {})
        assert config.bootstrap == bootstrap and config.properties["security.protocol"] == "SASL_SSL"
        assert 1 in make_admin(bootstrap, **config.properties).list_topics(timeout=30).brokers
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _worker_user(secured, tmp_path, name: str, *, expired_topic: bool = True) -> tuple[str, Path]:
    """A user that may do what a worker of SOW topic `name` does (ALL on its topics, the registry,
    its group and transactional IDs; with `expired_topic`, on EXP.<name> too), as the README says."""
    from confluent_kafka.admin import AclOperation, ResourcePatternType, ResourceType

    resources = [(ResourceType.TOPIC, name, ResourcePatternType.PREFIXED), (ResourceType.TOPIC, "__ksow", ResourcePatternType.PREFIXED),
                 (ResourceType.GROUP, f"g-{name}", ResourcePatternType.LITERAL),
                 (ResourceType.TRANSACTIONAL_ID, f"ksow-g-{name}", ResourcePatternType.PREFIXED)]
    if expired_topic:
        resources.append((ResourceType.TOPIC, f"EXP.{name}", ResourcePatternType.PREFIXED))
    return _user(secured, tmp_path, "worker", [(*resource, AclOperation.ALL) for resource in resources])


def test_a_user_who_may_only_read_the_topics_queries_and_subscribes(secured, topic, tmp_path):
    """The client's readers of `.sow` have a group.id only because confluent-kafka requires one; a
    user with no ACL on such a group got "Group authorization failed" from every read, so `ksow
    query` without workers, and `ksow subscribe`, failed for anyone but a super user."""
    from confluent_kafka.admin import AclOperation, ResourcePatternType, ResourceType

    name, path = topic
    _, config = _user(secured, tmp_path, "reader", [(ResourceType.TOPIC, prefix, ResourcePatternType.PREFIXED, operation)
                                                     for prefix in (name, "__ksow") for operation in (AclOperation.READ, AclOperation.DESCRIBE)])
    key = put_on_sow(secured.bootstrap, load_topology(path).sow[0], {"id": 3, "v": "read"})
    time.sleep(2)  # the authorizer takes the new ACLs
    done = ksow("query", "--kafka-config", str(config), "--topology", str(path), name)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [(r["sow_key"], r["record"]) for r in map(orjson.loads, done.stdout.splitlines())] == [(key, {"id": 3, "v": "read"})]
    done = ksow("subscribe", name, "--sow", "--timeout", "3", "--kafka-config", str(config), "--topology", str(path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert [orjson.loads(line)["record"] for line in done.stdout.splitlines()] == [{"id": 3, "v": "read"}]


def test_a_worker_not_allowed_to_create_one_of_its_topics_is_told_which(secured, as_admin, tmp_path):
    """It said "Kafka: Authorization failed." and nothing else (here: no ACL on EXP.<topic>)."""
    name = f"secexp_{uuid.uuid4().hex[:8]}"
    _, config = _worker_user(secured, tmp_path, name, expired_topic=False)
    path = write_topology(tmp_path, name, partitions=2)
    worker = Worker(secured.bootstrap, path, f"g-{name}", tmp_path / "data", extra_args=("--kafka-config", str(config))).start(wait=False)
    try:
        assert worker.proc.wait(120) == 1
    finally:
        worker.kill()
    assert f"Error: this client is not authorized to create Kafka topic EXP.{name} (Authorization failed.), or to see it" in worker.log()


def test_a_write_acl_taken_away_under_a_running_worker_stalls_it_without_loss_until_it_is_back(secured, as_admin, tmp_path):
    """Operators revoke a worker's WRITE on `.diff` (a DENY ACL) while it runs, then restore it. While
    it cannot write, every batch aborts: no output of it becomes visible, nothing is applied twice,
    and the worker redoes it less and less often rather than as fast as the broker answers. Once the
    ACL is back, the inputs held meanwhile are applied, each once. It never came back: each abort
    restores the partition, and the restore's reader (a group.id confluent-kafka requires, no ACL on
    it) failed on "Group authorization failed", which aborted the next batch, for ever."""
    from confluent_kafka.admin import AclBinding, AclBindingFilter, AclOperation, AclPermissionType, ResourcePatternType, ResourceType

    name = f"secacl_{uuid.uuid4().hex[:8]}"
    principal, config = _worker_user(secured, tmp_path, name)
    admin = make_admin(secured.bootstrap)
    path = write_topology(tmp_path, name, partitions=2)
    worker = Worker(secured.bootstrap, path, f"g-{name}", tmp_path / "data", extra_args=("--kafka-config", str(config))).start(timeout=120)
    deny = AclBinding(ResourceType.TOPIC, f"{name}.diff", ResourcePatternType.LITERAL, principal, "*", AclOperation.WRITE, AclPermissionType.DENY)
    try:
        producer = make_producer(secured.bootstrap)
        producer.produce(name, orjson.dumps({"id": 0, "v": 0}), b"0")
        assert producer.flush(30) == 0
        wait_until(lambda: len(read_topic(secured.bootstrap, f"{name}.diff")) == 1, timeout=120)
        for future in admin.create_acls([deny]).values():
            future.result(30)
        time.sleep(3)  # the authorizer takes the new ACL
        for i in range(1, 4):
            producer.produce(name, orjson.dumps({"id": i, "v": i}), str(i).encode())
        assert producer.flush(30) == 0
        before = worker.log().count("batch not committed")
        time.sleep(20)
        aborts = worker.log().count("batch not committed") - before
        assert worker.proc.poll() is None
        assert len(read_topic(secured.bootstrap, f"{name}.diff")) == 1 and len(read_topic(secured.bootstrap, f"{name}.sow")) == 1
        assert 1 <= aborts <= 12  # redone less and less often (without the pause: 92 in 20 s)
        for future in admin.delete_acls([AclBindingFilter(ResourceType.TOPIC, f"{name}.diff", ResourcePatternType.LITERAL, principal, "*",
                                                          AclOperation.WRITE, AclPermissionType.DENY)]).values():
            future.result(30)
        wait_until(lambda: len(read_topic(secured.bootstrap, f"{name}.diff")) >= 4, timeout=60)
        time.sleep(3)  # a repeat would come now
        assert sorted(orjson.loads(m.value())["id"] for m in read_topic(secured.bootstrap, f"{name}.diff")) == [0, 1, 2, 3]
        assert sorted(orjson.loads(m.value())["id"] for m in read_topic(secured.bootstrap, f"{name}.sow")) == [0, 1, 2, 3]
    finally:
        worker.stop()
