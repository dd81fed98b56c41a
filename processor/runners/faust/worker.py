"""The Faust worker: consumes `<topic>`, `<topic>.delta` and `<topic>.repartition` as one consumer
group, keeps each SOW partition in a store restored from `<topic>.sow` (the changelog), and produces
the outputs.

Faust gives the worker its group membership, co-partitioned assignment, offset commits, timers and
web server. The hot path is batched: a batch is applied to the stores, its outputs are produced with
librdkafka and delivered, the stores commit atomically with their changelog positions, and only then
are the input offsets acknowledged. A crash at any point therefore loses nothing: inputs not
acknowledged are read again, and re-applying them is idempotent for the SOW.

Batches come straight from Faust's consumer (`BatchDrainConsumer`: each fetch, up to BATCH_MAX
messages, goes to `SowWorker._on_fetch`) instead of through an agent's stream: Faust's per-event
machinery (tasks, queues and sensors for every message) capped a worker at a few thousand inputs/s;
see docs/benchmarks.md. The agents stay registered, idle, so that Faust subscribes the inputs and
assigns them co-partitioned. KSOW_FAUST_STREAM=1 goes back to the agents' `take_events` streams.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path

import faust
from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer

from processor.kafka.clients import check_partitions, end_offsets, ensure_topics, make_consumer, make_producer, produce, read_until, topic_configs
from processor.topology import Topology
from processor.runners.faust import metrics
from processor.kafka.registry import ensure_registry
from processor.engine.topic import EXPIRE_BATCH, InputMessage, ProduceRequest, SowTopicProcessor
from processor.runners.faust.web import install_web

log = logging.getLogger("ksow.worker")

BATCH_MAX = 500  # inputs per batch (with the batch drain: messages per fetch)
BATCH_WITHIN = 0.02  # seconds a partial batch may wait (Faust streams only; the batch drain never waits)
FAUST_STREAM = os.environ.get("KSOW_FAUST_STREAM", "") not in ("", "0")  # the slower agent-stream path
EXPIRY_TICK = 0.025  # seconds between expiry sweeps (only due records are read)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SowWorker:
    def __init__(
        self,
        topology: Topology,
        bootstrap: str,
        group: str = "ksow",
        data_dir: Path | None = None,
        web_port: int | None = None,
        topology_dir: Path | None = None,
        web_host: str | None = None,
    ):
        self.topology = topology
        self.bootstrap = bootstrap
        self.group = group
        self.web_port = web_port or free_port()
        self.web_host = web_host or os.environ.get("KSOW_WEB_HOST") or "127.0.0.1"
        self.data_dir = Path(data_dir or Path.home() / ".cache" / "ksow" / "data" / group / f"{socket.gethostname()}-{self.web_port}")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.processors = {
            s.topic: SowTopicProcessor(s, self.data_dir / "sow", topology_dir, topology.views_of(s.topic)) for s in topology.sow
        }
        self.locks = {name: asyncio.Lock() for name in self.processors}
        self._by_input = {t: proc for proc in self.processors.values() for t in (proc.spec.topic, proc.spec.delta_topic, proc.spec.repartition_topic)}
        self.ready: set[tuple[str, int]] = set()
        self.producer = make_producer(bootstrap)
        self.app = self._make_app()

    # setup -----------------------------------------------------------------------
    def _make_app(self) -> faust.App:
        app = faust.App(
            self.group,
            broker=f"kafka://{self.bootstrap}",
            store="memory://",
            datadir=str(self.data_dir / "faust"),
            broker_session_timeout=10,
            broker_heartbeat_interval=2,
            broker_commit_interval=1.0,
            consumer_auto_offset_reset="earliest",
            topic_replication_factor=1,
            web_enabled=True,
            web_bind="127.0.0.1" if self.web_host == "127.0.0.1" else "0.0.0.0",
            web_host=self.web_host,
            web_port=self.web_port,
            stream_buffer_maxsize=BATCH_MAX * 2,
            **({} if FAUST_STREAM else {"broker_max_poll_records": BATCH_MAX}),
        )
        for name, proc in self.processors.items():
            spec = proc.spec
            channel = app.topic(
                spec.topic, spec.delta_topic, spec.repartition_topic,
                key_serializer="raw", value_serializer="raw", partitions=spec.partitions,
            )
            app.agent(channel, name=f"ksow-{name}")(self._agent_for(proc))
        app.on_partitions_assigned.connect(self._on_assigned)
        app.on_partitions_revoked.connect(self._on_revoked)
        app.timer(EXPIRY_TICK, name="ksow-expiry")(self._expiry_tick)
        install_web(self, app)
        if not FAUST_STREAM:
            app.transport.Consumer = BatchDrainConsumer
            app.ksow_on_fetch = self._on_fetch  # type: ignore[attr-defined]
        return app

    def create_topics(self) -> None:
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        wanted: dict = {}
        for proc in self.processors.values():
            wanted.update(topic_configs(proc.spec, [v.view for v in proc.views]))
        ensure_topics(admin, wanted)
        ensure_registry(admin)
        for proc in self.processors.values():
            check_partitions(admin, proc.spec)

    # the hot path ----------------------------------------------------------------------
    def _agent_for(self, proc: SowTopicProcessor):
        async def sow_agent(stream):
            async for events in stream.take_events(BATCH_MAX, within=BATCH_WITHIN):
                await self.process(proc, [_input(e.message) for e in events])

        return sow_agent

    async def _on_fetch(self, messages: list) -> None:
        """One fetch of the batch drain: applied per SOW topic, each message acknowledged once its
        outputs are delivered and the stores committed (as `take_events` acks after the agent's body).
        Messages of partitions revoked meanwhile are dropped unacknowledged: their new owner reads them."""
        consumer = self.app.consumer
        groups: dict[str, list] = {}
        for m in messages:
            groups.setdefault(m.topic, []).append(m)
        batches: dict[SowTopicProcessor, list] = {}
        for topic, group in groups.items():
            batches.setdefault(self._by_input[topic], []).extend(group)
        for proc, batch in batches.items():
            assigned = consumer.assignment()
            batch = [m for m in batch if m.tp in assigned]
            if not batch:
                continue
            await self.process(proc, [_input(m) for m in batch])
            ack = consumer.ack
            for m in batch:
                ack(m)

    async def process(self, proc: SowTopicProcessor, messages: list[InputMessage]) -> None:
        topic = proc.spec.topic
        async with self.locks[topic]:
            for p in {m.partition for m in messages}:
                await self._restore_locked(proc, p)
            with metrics.BATCH_SECONDS.labels(topic).time():
                try:
                    await self._deliver(proc, proc.handle(messages))
                except BaseException:
                    proc.rollback()
                    raise
            metrics.INPUTS.labels(topic).inc(len(messages))

    async def _deliver(self, proc: SowTopicProcessor, requests: list[ProduceRequest]) -> None:
        """Produce, wait for every delivery, then commit the stores with their changelog positions."""
        report = DeliveryReport()
        send = self.producer.produce
        counts: dict[str, int] = {}
        for r in requests:
            on_delivery = report.callback(r.changelog)
            try:
                send(r.topic, r.value, r.key, -1 if r.partition is None else r.partition, on_delivery=on_delivery, timestamp=r.timestamp, headers=r.headers)
            except BufferError:  # the local queue is full: wait for room, as kafka.produce does
                produce(self.producer, r.topic, r.value, r.key, r.partition, r.headers, on_delivery, r.timestamp)
            counts[r.topic] = counts.get(r.topic, 0) + 1
        if requests:
            await asyncio.get_running_loop().run_in_executor(None, report.wait, self.producer)
        positions = report.positions()  # raises if anything was not delivered
        for p in list(proc.stores):
            proc.commit(p, positions.get(p))
        for topic, n in counts.items():
            metrics.OUTPUTS.labels(topic).inc(n)

    # partitions: restore on assignment, close on revocation ---------------------------------
    def _owned(self, proc: SowTopicProcessor, tps) -> set[int]:
        names = {proc.spec.topic, proc.spec.delta_topic, proc.spec.repartition_topic}
        return {tp.partition for tp in tps if tp.topic in names}

    async def _on_assigned(self, app, assigned, **kwargs) -> None:
        for name, proc in self.processors.items():
            for p in self._owned(proc, assigned):
                asyncio.ensure_future(self._restore(proc, p))

    async def _on_revoked(self, app, revoked, **kwargs) -> None:
        for name, proc in self.processors.items():
            lost = self._owned(proc, revoked)
            if not lost:
                continue
            async with self.locks[name]:
                for p in lost:
                    if (name, p) in self.ready:
                        await self._deliver(proc, proc.views_due(p, everything=True))
                    self.ready.discard((name, p))
                    proc.close(p)

    async def _restore(self, proc: SowTopicProcessor, p: int) -> None:
        async with self.locks[proc.spec.topic]:
            await self._restore_locked(proc, p)

    async def _restore_locked(self, proc: SowTopicProcessor, p: int) -> None:
        key = (proc.spec.topic, p)
        if key in self.ready:
            return
        if proc.keeps_state:
            count = await asyncio.get_running_loop().run_in_executor(None, self._replay_changelog, proc, p)
            log.info("restored %s partition %d: %d changelog records, %d in SOW", proc.spec.topic, p, count, proc.open(p).count())
            if not proc.restores:  # a `simple` SOW starts empty: tell `.sow` what was lost
                await self._deliver(proc, proc.purge(p))
        else:
            proc.open(p)
        self.ready.add(key)
        # Records whose instant passed while nobody owned them go before any new publish.
        while requests := proc.expire_due(p):
            await self._deliver(proc, requests)
            if len(requests) < EXPIRE_BATCH:
                break

    def _replay_changelog(self, proc: SowTopicProcessor, p: int) -> int:
        """Bring partition p's store up to the end of `<topic>.sow` (runs in a thread)."""
        topic = proc.spec.sow_topic
        consumer = make_consumer(self.bootstrap)
        try:
            ((low, high),) = end_offsets(consumer, topic, [p]).values()
            position = proc.changelog_position(p)
            if position < low or position > high:  # compacted past us, or a recreated topic
                proc.open(p).clear()
                position = low
            count = 0
            if position < high:
                consumer.assign([TopicPartition(topic, p, position)])
                for msg in read_until(consumer, {(topic, p): high}):
                    ts = msg.timestamp()[1]
                    proc.restore(p, msg.key(), msg.value(), msg.headers(), ts)
                    count += 1
                    if count % 20000 == 0:
                        proc.commit(p, msg.offset() + 1)
            proc.commit(p, high)
            return count
        finally:
            consumer.close()

    # expiry --------------------------------------------------------------------------
    async def _expiry_tick(self) -> None:
        """Expire what is due and release conflated view events whose interval ended."""
        for name, proc in self.processors.items():
            if not proc.spec.expiry.active and not any(v.conflation_ms for v in proc.views):
                continue
            async with self.locks[name]:
                requests = []  # every partition's, then one delivery: each waits for the broker
                for (topic, p) in list(self.ready):
                    if topic == name:
                        requests += proc.expire_due(p)
                        requests += proc.views_due(p)
                if requests:
                    await self._deliver(proc, requests)

    # running ----------------------------------------------------------------------------
    def run(self, loglevel: str = "info") -> None:
        """Run until stopped (SIGINT/SIGTERM); exits the process like any Faust worker."""
        self.create_topics()
        os.environ.setdefault("F_BLOCKING_TIMEOUT", "0")
        worker = faust.Worker(self.app, loglevel=loglevel, quiet=True, redirect_stdouts=False)
        # Faust's terminal spinner (installed at loglevel warning and above) also turns the root
        # logger to DEBUG, so every debug line in the hot path would be formatted: none of that.
        worker.spinner = None
        worker.execute_from_commandline()


class BatchDrainConsumer(AIOKafkaConsumer):
    """Faust's aiokafka consumer whose drain loop hands whole fetches to the worker.

    Faust's own loop (`Consumer._drain_messages`) dispatches every message through the conductor,
    a channel queue and the agent's stream: several tasks and sensor calls per message. This loop
    keeps what matters from it (read offsets, gaps of compacted/transactional topics, tracking of
    in-flight messages for rebalances, commit_every) and awaits `app.ksow_on_fetch(messages)`,
    which acknowledges the messages after their outputs are delivered.
    """

    async def _drain_messages(self, fetcher) -> None:  # pragma: no cover - exercised end to end
        on_fetch = self.app.ksow_on_fetch
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set
        get_read_offset = self._read_offset.__getitem__
        set_read_offset = self._read_offset.__setitem__
        acks_enabled_for = self.app.topics.acks_enabled_for
        track = self.track_message
        while not (consumer_should_stop() or fetcher_should_stop()):
            await self.sleep(0)
            if self.should_stop:
                break
            batch = []
            async for tp, message in self.getmany(timeout=1.0):
                offset = message.offset
                r_offset = get_read_offset(tp)
                if r_offset is not None and offset < r_offset:
                    continue  # seen already (Faust drops these too)
                if r_offset and offset - r_offset > 1 and acks_enabled_for(message.topic):
                    await self._add_gap(tp, r_offset + 1, offset)
                track(message)
                batch.append(message)
                set_read_offset(tp, offset)
            if batch:
                await on_fetch(batch)
                if self._commit_every is not None and self._n_acked >= self._commit_every:
                    self._n_acked = 0
                    await self.commit()


class DeliveryReport:
    """Delivery reports of one batch's outputs.

    A batch waits for its own messages only (`wait`), not for the producer's whole queue as
    `flush()` would: an expiry sweep and an input batch of another SOW topic are in flight at the
    same time, and neither should wait for the other's deliveries. Reports are served by whichever
    thread polls the producer; they are appended to lists (atomic under the GIL).
    """

    def __init__(self) -> None:
        self.expected = 0
        self._others: list = []  # errors (None when delivered) of the messages that are not changelog
        self._changelog: dict[int, list] = {}  # SOW partition -> [(error, message)]

    def callback(self, changelog: int | None):
        """The on_delivery callback of one more message (of changelog partition `changelog`)."""
        self.expected += 1
        if changelog is None:
            return self._other
        filed = self._changelog.get(changelog)
        if filed is None:
            filed = self._changelog[changelog] = []
        return lambda err, msg: filed.append((err, msg))

    def _other(self, err, msg) -> None:
        self._others.append(err)

    @property
    def outstanding(self) -> int:
        return self.expected - len(self._others) - sum(map(len, self._changelog.values()))

    def wait(self, producer) -> None:
        """Serve delivery reports until all of this batch's are in (runs in an executor thread)."""
        while self.outstanding > 0:
            producer.poll(0.01)

    def positions(self) -> dict[int, int]:
        """Next changelog offset per SOW partition; raises KafkaException if a message failed."""
        positions: dict[int, int] = {}
        failed = [err for err in self._others if err is not None]
        for p, filed in self._changelog.items():
            failed += [err for err, _ in filed if err is not None]
            offsets = [msg.offset() for err, msg in filed if err is None]
            if offsets:
                positions[p] = max(offsets) + 1
        if failed:
            raise KafkaException(failed[0])
        return positions


def _input(message) -> InputMessage:
    headers = message.headers
    if isinstance(headers, Mapping):
        headers = list(headers.items())
    timestamp = int(message.timestamp * 1000) if message.timestamp else 0
    return InputMessage(message.topic, message.partition, message.offset, message.key, message.value, headers, timestamp)
