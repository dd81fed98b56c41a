"""Kafka plumbing shared by the worker, the client and the CLI (confluent-kafka)."""

from __future__ import annotations

import logging
import operator
import os
import time
from typing import Callable, Iterable, Iterator

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from processor.contract.errors import ConfigError
from processor.contract.types import UnreadableHeaders
from processor.contract.limits import MAX_FUTURE_STAMP_MS, read_idle_timeout
from processor.kafka.config import kafka_config
from processor.topology import SowTopic, Topology

log = logging.getLogger("ksow.kafka")

# librdkafka's default 1 s fetch-queue backoff stalls loops that read to the end of a partition.
_FAST_FETCH = {"fetch.queue.backoff.ms": 20, "fetch.wait.max.ms": 50}


def resolve_bootstrap(bootstrap: str | None) -> str | None:
    """--bootstrap, else $KAFKA_BOOTSTRAP, else bootstrap.servers of the Kafka client config."""
    return bootstrap or os.environ.get("KAFKA_BOOTSTRAP") or kafka_config().bootstrap


# librdkafka refreshes what it knows of its topics every 5 minutes by default: a worker found an
# input topic deleted under it (and created it again) only then. One small metadata request a client
# every 30 s finds it within 30 s; the deployment may set another (KAFKA_TOPIC_METADATA_REFRESH_INTERVAL_MS).
_COMMON = {"topic.metadata.refresh.interval.ms": 30_000}


def _client_config(bootstrap: str, defaults: dict, overrides: dict) -> dict:
    """ksow's defaults, then the deployment's settings (security, tuning: processor.kafka.config),
    then what the caller needs for this client."""
    return {**_COMMON, **defaults, **kafka_config().properties, **overrides, "bootstrap.servers": bootstrap}


def make_admin(bootstrap: str, **overrides) -> AdminClient:
    return AdminClient(_client_config(bootstrap, {}, overrides))


# Errors librdkafka reports to error callbacks only (a metadata call just fails with "transport
# failure" when its time is up): the cluster refuses this client's settings, and trying again will
# not help.
_REFUSALS = frozenset({KafkaError._AUTHENTICATION, KafkaError._SSL, KafkaError.SASL_AUTHENTICATION_FAILED})


def is_refusal(error: KafkaError) -> bool:
    """Whether an error told to an error callback is the cluster refusing this client's settings.
    An identity provider that cannot be reached (OAUTHBEARER's token endpoint) is an outage, not a
    refusal."""
    return error.code() in _REFUSALS and "OAUTHBEARER token" not in error.str()


class KafkaRefused(ConfigError):
    """The cluster answered but refused this client's settings (a login, a certificate)."""


class KafkaUnreachable(ConfigError):
    """No broker answered in time; `cause` is the last connection error librdkafka told, if any."""

    def __init__(self, message: str, cause: str | None = None):
        super().__init__(message)
        self.cause = cause


def answered_metadata(handle, topic: str | None, timeout: float, unanswered: Callable[[KafkaException, bool], None]):
    """`handle.list_topics(topic)` once the cluster answers, tried every 0.5 s for `timeout` seconds.
    A refused login or certificate reaches only the handle's error callbacks (the call just times
    out), so they are served between tries, and `unanswered(error of the try, time is up)` looks at
    what they were told: it may raise, at once for a refusal. When the time is up and it did not,
    the last try's error is raised."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return handle.list_topics(topic, timeout=max(0.05, min(0.5, deadline - time.monotonic())))
        except KafkaException as exc:
            handle.poll(0)  # serves the error callbacks
            over = time.monotonic() >= deadline
            unanswered(exc, over)
            if over:
                raise
            time.sleep(0.05)  # a call that fails at once (no broker known yet) must not spin


def raise_if_refused(bootstrap: str, told: list[KafkaError]) -> None:
    """Raise KafkaRefused, with librdkafka's reason, when errors told to a client's error callback
    say the cluster refused its login or certificate."""
    refused = next((e for e in told if is_refusal(e)), None)
    if refused is not None:
        raise KafkaRefused(f"Kafka at {bootstrap} refused this client: {refused.str()} (check the client settings: "
                           "--kafka-config / KSOW_KAFKA_CONFIG and KAFKA_* variables)")


def reach(bootstrap: str, timeout: float) -> None:
    """Return once the cluster answers a metadata request. Raise KafkaRefused at once when it refuses
    the login or the TLS handshake (with librdkafka's reason, which no metadata call gives), else
    KafkaUnreachable after `timeout` seconds, with the last connection error seen."""
    seen: list[KafkaError] = []

    def unanswered(_: KafkaException, over: bool) -> None:
        raise_if_refused(bootstrap, seen)
        if over:
            causes = [e.str() for e in seen if e.code() != KafkaError._ALL_BROKERS_DOWN]
            cause = causes[-1] if causes else None
            raise KafkaUnreachable(f"cannot reach Kafka at {bootstrap} within {timeout:g}s{f': {cause}' if cause else ''} (is it up, "
                                   "and are --bootstrap (KAFKA_BOOTSTRAP) and the client settings right?)", cause)

    answered_metadata(AdminClient(_client_config(bootstrap, {}, {"error_cb": seen.append, "log_level": 0})), None, timeout, unanswered)


_READ_HEADERS = operator.methodcaller("headers")


def message_headers(msg) -> list | None:
    """A consumed message's headers, or UnreadableHeaders when a header name is not UTF-8 text: one
    such message must not stop a reader. confluent-kafka then returns a list with a hole in it and
    the decode error set. Called as `msg.headers()`, Python 3.11's specialised call (once the call
    site is hot) does not look for that error, and the hole crashes the process when read; through
    `methodcaller` the call is checked, and raises SystemError. Ask each message once: confluent-kafka
    keeps the broken list and returns it, with no error, to a second call."""
    try:
        return _READ_HEADERS(msg)
    except (UnicodeDecodeError, SystemError):
        return UnreadableHeaders()


def make_producer(bootstrap: str, **overrides) -> Producer:
    defaults = {
        "linger.ms": 5,
        "batch.size": 1_000_000,
        "compression.type": "lz4",
        "enable.idempotence": True,
        "acks": "all",
        "queue.buffering.max.messages": 1_000_000,
        "partitioner": "murmur2_random",  # the Java client's default: a SowKey lands on its owner partition
        # ksow creates its topics itself: one a produce made the broker create (auto.create.topics.enable)
        # would have the broker's partition count and settings (a `.sow` not compacted), not the topology's.
        "allow.auto.create.topics": False,
    }
    return Producer(_client_config(bootstrap, defaults, overrides))


# A reader (no `group`) has a group.id only because confluent-kafka requires one: it assigns, never
# joins or commits. librdkafka looks up its coordinator all the same, and on a cluster whose ACLs
# give the user no access to that group it tells each read "Group authorization failed", which is
# not about the data: readers pass it over (a restore failed on it, and aborted, for ever).
READER_NOISE = frozenset((KafkaError.GROUP_AUTHORIZATION_FAILED,))


def make_consumer(bootstrap: str, group: str | None = None, **overrides) -> Consumer:
    defaults = {
        "group.id": group or f"ksow-reader-{os.getpid()}-{time.monotonic_ns()}",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": True,
        **_FAST_FETCH,
    }
    return Consumer(_client_config(bootstrap, defaults, overrides))


def produce(producer: Producer, topic: str, value, key=None, partition: int | None = None, headers=None, on_delivery=None, timestamp: int = 0) -> None:
    """Produce, waiting for room when the local queue is full instead of failing."""
    kwargs = {"value": value, "key": key, "headers": headers}
    if timestamp:
        kwargs["timestamp"] = timestamp
    if partition is not None:
        kwargs["partition"] = partition
    if on_delivery is not None:
        kwargs["on_delivery"] = on_delivery
    while True:
        try:
            producer.produce(topic, **kwargs)
            return
        except BufferError:
            producer.poll(0.05)


FUTURE_STAMPS = "message.timestamp.after.max.ms"  # Kafka 3.6+ (KIP-937)


def topic_configs(spec: SowTopic, views=()) -> dict[str, tuple[int, dict[str, str]]]:
    """Every topic a SOW topic uses: name -> (partitions, configs). All share the partition count."""
    n = spec.partitions
    compacted = {"cleanup.policy": "compact", "min.compaction.lag.ms": "0"}
    # Inputs the worker creates take the broker's clock by default (`timestamps: arrival`, LogAppendTime):
    # a lifetime counts from the input's arrival whatever the publisher's clock says, and replays see
    # the same instants. The repartition topic keeps CreateTime: a rerouted input carries its timestamp.
    # Publisher stamps far in the future are refused by the broker (MAX_FUTURE_STAMP_MS).
    # The others are streams of events, whatever the cluster's default policy (log.cleanup.policy):
    # compacted, `.diff` would keep one event a record, and a message without a key (an input's own,
    # copied to `.errors`) would be refused.
    streamed = {"cleanup.policy": "delete"}
    arrival = {**streamed, **({"message.timestamp.type": "LogAppendTime"} if spec.timestamps == "arrival" else
                              {"message.timestamp.type": "CreateTime", FUTURE_STAMPS: str(MAX_FUTURE_STAMP_MS)})}
    inputs = ("input", "delta input")
    return {
        t.name: (n, arrival if t.role in inputs else compacted if t.compacted else streamed)
        for t in [*spec.kafka_topics(views), *(t for view in views for t in view.kafka_topics())]
    }


def topology_topic_configs(topology: Topology) -> dict[str, tuple[int, dict[str, str]]]:
    """Every topic of a topology's SOW topics and views (`topic_configs`). A topic several SOW
    topics share (their expired and dead records) gets the most partitions any of them writes to:
    partition p of a SOW topic writes to partition p there."""
    wanted: dict[str, tuple[int, dict[str, str]]] = {}
    for spec in topology.sow:
        for name, (n, configs) in topic_configs(spec, topology.views_of(spec.topic)).items():
            wanted[name] = (max(n, wanted[name][0]) if name in wanted else n, configs)
    return wanted


REPLICATION_FACTOR_ENV = "KSOW_REPLICATION_FACTOR"
MIN_INSYNC_REPLICAS_ENV = "KSOW_MIN_INSYNC_REPLICAS"


def replication_settings(brokers: int, factor: int | None = None, min_insync: int | None = None) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) for the topics ksow creates.

    Defaults: a factor of min(3, brokers), so `.sow` (the source of truth) survives the loss of
    a broker wherever the cluster allows it, and min.insync.replicas of min(2, factor), so an
    acknowledged write (acks=all) is on two brokers before it counts.
    """
    factor = min(3, brokers) if factor is None else factor
    if not 1 <= factor <= brokers:
        raise ConfigError(f"replication factor {factor} does not fit a cluster of {brokers} broker(s)")
    min_insync = min(2, factor) if min_insync is None else min_insync
    if not 1 <= min_insync <= factor:
        raise ConfigError(f"min.insync.replicas {min_insync} must be between 1 and the replication factor {factor}")
    return factor, min_insync


def _env_count(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ConfigError(f"{name}={raw!r}: expected a whole number")
    return int(raw)


def ensure_topics(
    admin: AdminClient,
    wanted: dict[str, tuple[int, dict[str, str]]],
    timeout: float = 30.0,
    replication_factor: int | None = None,
    min_insync_replicas: int | None = None,
) -> list[str]:
    """Create missing topics (existing ones are left as they are), then wait until all are visible.
    Returns the names of those it created.

    New topics get `replication_settings` (the arguments, e.g. from the topology; env
    KSOW_REPLICATION_FACTOR and KSOW_MIN_INSYNC_REPLICAS override them) unless their configs
    already say min.insync.replicas.
    """
    meta = admin.list_topics(timeout=timeout)
    # Partition p of a SOW topic writes to partition p of each of its topics: fewer cannot be
    # written to. More can (an input's exact count is `check_partitions`').
    short = [f"{name} has {len(meta.topics[name].partitions)} partitions, {n} are needed" for name, (n, _) in sorted(wanted.items())
             if name in meta.topics and len(meta.topics[name].partitions) < n]
    if short:
        raise ConfigError(f"{'; '.join(short)}: add partitions to those topics (kafka-topics.sh --alter --partitions N), "
                          "or name other topics in the topology")
    missing = {name: spec for name, spec in wanted.items() if name not in meta.topics}
    if missing:
        env_factor, env_min_insync = _env_count(REPLICATION_FACTOR_ENV), _env_count(MIN_INSYNC_REPLICAS_ENV)
        factor, min_insync = replication_settings(
            len(meta.brokers),
            replication_factor if env_factor is None else env_factor,
            min_insync_replicas if env_min_insync is None else env_min_insync,
        )
        new = [
            NewTopic(name, num_partitions=n, replication_factor=factor, config={"min.insync.replicas": str(min_insync), **cfg})
            for name, (n, cfg) in missing.items()
        ]
        for name, future in admin.create_topics(new, operation_timeout=timeout).items():
            try:
                future.result()
            except KafkaException as exc:
                if exc.args[0].name() == "INVALID_CONFIG" and FUTURE_STAMPS in missing[name][1]:
                    # A broker before Kafka 3.6 does not know the setting: the worker's own bound still holds.
                    log.warning("%s: this cluster does not take %s; publishers' stamps far in the future are not refused", name, FUTURE_STAMPS)
                    ensure_topics(admin, {name: (missing[name][0], {k: v for k, v in missing[name][1].items() if k != FUTURE_STAMPS})},
                                  timeout, replication_factor, min_insync_replicas)
                elif exc.args[0].code() in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED):
                    # It says neither the topic nor what is missing; a topic the user may not see looks missing too.
                    raise KafkaRefused(
                        f"this client is not authorized to create Kafka topic {name} ({exc.args[0].str()}), or to see it if it "
                        "exists: grant its user CREATE on it, or create it beforehand (README, \"Topics\"), and DESCRIBE, "
                        "DESCRIBE_CONFIGS, READ and WRITE on it (Kafka ACLs)"
                    ) from None
                elif exc.args[0].name() != "TOPIC_ALREADY_EXISTS":
                    raise
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        meta = admin.list_topics(timeout=timeout).topics
        if all(name in meta and len(meta[name].partitions) >= n for name, (n, _) in wanted.items()):
            return sorted(missing)
        time.sleep(0.1)
    raise TimeoutError(f"topics not visible after {timeout}s: {sorted(wanted)}")


def check_partitions(admin: AdminClient, specs: Iterable[SowTopic], timeout: float = 30.0) -> None:
    """Each SOW topic's Kafka topics must have the topology's partition count: a SowKey's owner is
    its hash modulo that count, and the group's range assignor gives partition p of each input to
    the worker that owns SOW partition p. Checked at start and at every assignment (partitions added
    to an input under running workers), from one metadata request for all of them."""
    meta = admin.list_topics(timeout=timeout).topics
    for spec, name in ((spec, name) for spec in specs for name in (spec.topic, spec.delta_topic, spec.sow_topic, spec.repartition_topic)):
        count = len(meta[name].partitions) if name in meta else spec.partitions  # missing: ensure_topics' to make
        if count != spec.partitions:
            raise ConfigError(
                f"topic {name} has {count} partitions but the topology says partitions: {spec.partitions} for {spec.topic}; "
                "a SowKey's partition depends on that count, and partitions cannot be taken back from a topic: "
                "name new topics in the topology (README, \"SowKeys and partitions\")"
            )


_TRANSIENT = {
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._UNKNOWN_PARTITION,
    KafkaError._TRANSPORT,
    KafkaError._TIMED_OUT,
}


def topic_incarnation(admin: AdminClient, topic: str, timeout: float = 30.0) -> int:
    """A positive number that changes when `topic` is deleted and created again (from its topic ID),
    or 0 when the cluster does not say (no topic IDs, or the request failed): a store keeps it
    beside its position in the topic, as offsets of one incarnation of a topic say nothing of
    another (a recreated log may already hold more records, aborted ones too, than the store had
    read of the old one)."""
    from confluent_kafka import TopicCollection

    try:
        uid = admin.describe_topics(TopicCollection([topic]), request_timeout=timeout)[topic].result(timeout).topic_id
    except KafkaException as exc:
        log.warning("no topic ID for %s (%s): a recreated log is told by its offsets alone", topic, exc)
        return 0
    if uid is None:
        return 0
    bits = uid.get_most_significant_bits() ^ uid.get_least_significant_bits()
    return (bits & ((1 << 63) - 1)) or (1 if bits else 0)  # a zero ID: none


DELETE_RETENTION_MS = 86_400_000  # Kafka's default delete.retention.ms


def delete_retention_ms(admin: AdminClient, topic: str, timeout: float = 30.0) -> int:
    """How long the log cleaner keeps the tombstones of compacted `topic` (its delete.retention.ms),
    or Kafka's default when the configuration cannot be read."""
    from confluent_kafka.admin import ConfigResource, ResourceType

    try:
        futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, topic)], request_timeout=timeout)
        (future,) = futures.values()
        return int(future.result(timeout)["delete.retention.ms"].value)
    except (KafkaException, KeyError, ValueError) as exc:
        log.warning("cannot read delete.retention.ms of %s (%s): taking Kafka's default", topic, exc)
        return DELETE_RETENTION_MS


def described_configs(admin: AdminClient, topics: Iterable[str], timeout: float = 30.0) -> dict[str, dict[str, str]]:
    """The configuration (name -> value) of each of `topics` that could be read, in one request."""
    from confluent_kafka.admin import ConfigResource, ResourceType

    futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, t) for t in topics], request_timeout=timeout)
    found = {}
    for resource, future in futures.items():
        try:
            found[resource.name] = {name: entry.value for name, entry in future.result(timeout).items()}
        except KafkaException as exc:
            log.debug("cannot read the configuration of %s: %s", resource.name, exc)
    return found


def check_compaction(wanted: dict[str, tuple[int, dict[str, str]]], configs: dict[str, dict[str, str]]) -> None:
    """A topic ksow creates compacted (`.sow`, the SOW's changelog; `.holds`) that exists with the
    `delete` policy and a time or size retention (someone else made it, or changed it) loses the
    records older than that: a worker that rebuilds its store from it would lose them from the SOW,
    with no error. Refused at start, as Kafka Streams refuses such changelogs (ConfigError, one line)."""
    for name, (_, want) in sorted(wanted.items()):
        found = configs.get(name)
        if want.get("cleanup.policy") != "compact" or found is None:
            continue
        policy = {p.strip() for p in found.get("cleanup.policy", "").split(",")}
        if "delete" in policy and (found.get("retention.ms") != "-1" or found.get("retention.bytes") != "-1"):
            raise ConfigError(
                f"topic {name} has cleanup.policy={found.get('cleanup.policy')}, retention.ms={found.get('retention.ms')}, "
                f"retention.bytes={found.get('retention.bytes')}"
                ": its records would be removed by time or size, and a worker that rebuilds its store from it would lose them; "
                f"make it cleanup.policy=compact (kafka-configs.sh --alter --entity-type topics --entity-name {name} "
                "--add-config cleanup.policy=compact)"
            )


def end_offsets(consumer: Consumer, topic: str, partitions, timeout: float = 30.0) -> dict[int, tuple[int, int]]:
    """(low, high) watermarks per partition, retrying the transient errors of freshly created topics."""
    out = {}
    deadline = time.monotonic() + timeout
    for p in partitions:
        while True:
            try:
                out[p] = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=min(10.0, max(0.5, deadline - time.monotonic())))
                break
            except KafkaException as exc:
                if exc.args[0].code() not in _TRANSIENT or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    return out


def topic_refused(client, topic: str) -> KafkaError | None:
    """The cluster's refusal to let this client see `topic` (TOPIC_AUTHORIZATION_FAILED), if it is
    one: reading an unauthorized topic's offsets fails only with "unknown partition"."""
    try:
        found = client.list_topics(topic, timeout=5).topics.get(topic)
    except KafkaException:
        return None
    error = found.error if found is not None else None
    return error if error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED else None


def read_until(consumer: Consumer, ends: dict[tuple[str, int], int], idle_timeout: float | None = None) -> Iterator:
    """Yield messages of the assigned partitions below their end offsets; stop when all reached them.

    Compacted topics have gaps in their offsets, so "done" is judged by end-of-partition events too.
    There is no limit on the total time (a large SOW restores, or is subscribed to, however long
    it takes): a TimeoutError comes only after `idle_timeout` seconds (default: env
    KSOW_READ_IDLE_TIMEOUT, 60 s) without a message or an end-of-partition event of a partition
    still being read. Time the caller spends between messages does not count.
    """
    for batch in read_batches(consumer, ends, idle_timeout):
        yield from batch


def read_batches(consumer: Consumer, ends: dict[tuple[str, int], int], idle_timeout: float | None = None,
                 size: int = 1000) -> Iterator[list]:
    """`read_until`'s messages as the lists one `consume` of up to `size` hands out (none empty):
    a reader that handles a batch at a time (a restore) makes no generator step a message."""
    idle = read_idle_timeout() if idle_timeout is None else idle_timeout
    remaining = {tp: end for tp, end in ends.items() if end > 0}
    progress_at = time.monotonic()
    while remaining:
        progressed = False
        batch = []
        for msg in consumer.consume(size, 0.2):
            tp = (msg.topic(), msg.partition())
            end = remaining.get(tp)
            err = msg.error()
            if err is not None:
                if err.code() in READER_NOISE:
                    continue
                if err.code() != KafkaError._PARTITION_EOF:
                    if batch:  # what came before the error is handed out first, as one by one
                        yield batch
                    raise KafkaException(err)
                if end is not None:
                    progressed = True
                    if msg.offset() >= end:
                        remaining.pop(tp)
                continue
            if end is None or msg.offset() >= end:
                continue
            progressed = True
            batch.append(msg)
            if msg.offset() + 1 >= end:
                remaining.pop(tp)
        if batch:
            yield batch
        now = time.monotonic()
        if progressed:
            progress_at = now
        elif remaining and now - progress_at > idle:
            raise TimeoutError(f"reading {sorted(remaining)}: no progress for {idle:g}s (KSOW_READ_IDLE_TIMEOUT)")
