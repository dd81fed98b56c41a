"""The Faust worker: the application around the input loop.

Faust is the worker's application: its lifecycle (`faust.Worker`: signals, logging, start and
stop), its HTTP server (SOW queries, metrics), its timers (the registry announcement). The input
loop (processor.runners.faust.loop) runs beside it in a thread of its own, with confluent-kafka:
Faust's per-event stream machinery costs ~100 µs of CPU an event and its aiokafka consumer has no
transactions, so neither sits on the hot path. The Faust app therefore starts no Kafka client of
its own; the loop is the worker's only member of the consumer group.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
from pathlib import Path
from typing import Awaitable, Callable

import faust
import mode
from confluent_kafka import KafkaError, KafkaException
from faust.app.base import BootStrategy

from processor.contract.errors import KsowError
from processor.kafka.clients import ensure_topics, make_admin, make_producer
from processor.kafka.registry import REGISTRY_TOPIC, REGISTRY_TOPICS
from processor.runners.faust.loop import LoopSettings, SowLoop
from processor.runners.faust.stores import adopt_worker_stores, hold_data_dir
from processor.runners.faust.web import WebSettings, install_web
from processor.topology import Topology

log = logging.getLogger("ksow.worker")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_data_dir(group: str, topology: Topology) -> Path:
    """Where a worker keeps its stores when not told: stable for a group and topology, so a restart
    finds its RocksDB stores again instead of rebuilding them from the changelogs."""
    digest = hashlib.blake2b(topology.model_dump_json().encode(), digest_size=6).hexdigest()
    return Path.home() / ".cache" / "ksow" / "data" / group / digest


class _NoKafkaBoot(BootStrategy):
    """The Faust app starts its web server, sensors and timers, but no Kafka client: the loop is the
    worker's Kafka side."""

    enable_kafka = False


class _App(faust.App):
    BootStrategy = _NoKafkaBoot


class LoopService(mode.Service):
    """Runs the input loop in a thread for as long as the Faust worker runs; a loop that fails
    stops the worker (exit status 1) so that its supervisor restarts it."""

    def __init__(self, sow_loop: SowLoop, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sow_loop = sow_loop
        self._done: asyncio.Future | None = None
        self.refused: KsowError | None = None  # why the loop stopped, when a setting or the cluster refused it
        self.stop_worker: Callable[[], Awaitable] | None = None  # the worker's stop (SowWorker.run sets it)
        self._stopping: asyncio.Future | None = None  # that stop, once begun (held: asyncio keeps only weak references to tasks)

    async def on_start(self) -> None:
        self._done = asyncio.get_running_loop().run_in_executor(None, self.sow_loop.run)
        self.add_future(self._watch())

    async def _watch(self) -> None:
        assert self._done is not None
        try:
            await self._done
        except KsowError as exc:
            # A setting or a cluster that refuses us: the message says it all, so the worker stops
            # as on a signal (no crash report: its tracebacks would bury the line) and exits 1.
            log.error("the input loop stopped: %s", exc)
            self.refused = exc
            if self.stop_worker is not None:
                self._stopping = asyncio.ensure_future(self.stop_worker())
            else:
                await self.crash(exc)
        except Exception as exc:  # noqa: BLE001 - reported, then the worker stops
            log.exception("the input loop failed")
            await self.crash(exc)

    async def on_stop(self) -> None:
        self.sow_loop.stop()
        if self._done is not None and not self._done.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._done), 30)
            except Exception:  # noqa: BLE001 - stopping anyway
                log.warning("the input loop did not stop cleanly", exc_info=True)


class SowWorker:
    def __init__(
        self,
        topology: Topology,
        bootstrap: str,
        group: str = "ksow",
        data_dir: Path | None = None,
        topology_dir: Path | None = None,
        settings: LoopSettings | None = None,
        web: WebSettings | None = None,
        stores_dir: Path | None = None,
    ):
        self.topology = topology
        self.bootstrap = bootstrap
        self.group = group
        self.web = web or WebSettings.from_env(free_port())
        self.data_dir = Path(data_dir or default_data_dir(group, topology))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock = hold_data_dir(self.data_dir)
        # The stores: in the data folder, or in the folder of the pool this worker is one of (`ksow up
        # --workers N` gives each worker a folder of its own in it, for its lock and identity).
        stores = Path(stores_dir) if stores_dir else self.data_dir
        if stores == self.data_dir:
            adopt_worker_stores(stores)  # the pool's parent does it before its workers start
        # A stable transactional.id per worker identity: a restarted worker fences its earlier self.
        instance = hashlib.blake2b(f"{socket.gethostname()}:{self.data_dir.resolve()}".encode(), digest_size=6).hexdigest()
        self.loop = SowLoop(topology, bootstrap, group, stores, topology_dir, settings, instance)
        self.topics = list(self.loop.engines)
        self.app = self._make_app()

    def _make_app(self) -> faust.App:
        app = _App(
            f"{self.group}-worker",
            broker=f"kafka://{self.bootstrap}",
            store="memory://",
            datadir=str(self.data_dir / "faust"),
            web_enabled=True,
            web_host=self.web.host,
            web_port=self.web.port,
        )
        install_web(LoopView(self), app, self.web)
        return app

    def create_topics(self) -> None:
        self.loop.ensure_topics()

    def run(self, loglevel: str = "info") -> None:
        """Run until stopped (SIGINT/SIGTERM); exits the process like any Faust worker."""
        self.create_topics()
        os.environ.setdefault("F_BLOCKING_TIMEOUT", "0")
        service = LoopService(self.loop)
        worker = faust.Worker(self.app, service, loglevel=loglevel, quiet=True, redirect_stdouts=False)
        service.stop_worker = worker.stop
        # Faust's terminal spinner (installed at loglevel warning and above) also turns the root
        # logger to DEBUG, so every debug line in the hot path would be formatted: none of that.
        worker.spinner = None
        try:
            worker.execute_from_commandline()
        except SystemExit as status:
            if service.refused is not None and not status.code:
                raise SystemExit(1) from None
            raise


class LoopView:
    """The web side's WorkerView of this worker: its loop's engines and stores, read-only, and a
    small producer of its own for the registry."""

    def __init__(self, worker: SowWorker):
        self.group = worker.group
        self.topology = worker.topology
        self._loop = worker.loop
        self._producer = None
        self._bootstrap = worker.bootstrap

    def topics(self) -> list[str]:
        return list(self._loop.engines)

    def engine(self, topic: str):
        return self._loop.engines.get(topic)

    def served(self, topic: str) -> list[int]:
        return self._loop.served(topic)

    def stores(self, topic: str):
        return self._loop.stores(topic)

    def busy(self) -> bool:
        return self._loop.busy()

    def input_lag(self) -> dict[str, int]:
        return self._loop.input_lag()

    def announce(self, key: bytes, value: bytes) -> None:
        """Write this worker's registry entry (its own small producer: the loop's is transactional).
        A registry topic deleted under the worker is created again: clients would find no worker
        to ask, and fall back to reading `.sow`, for as long as it ran."""
        if self._producer is None:
            self._producer = make_producer(self._bootstrap)
        try:
            self._producer.produce(REGISTRY_TOPIC, value, key)
        except KafkaException as exc:
            if exc.args[0].code() not in (KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_OR_PART):
                raise
            log.warning("the registry topic %s is gone: creating it again", REGISTRY_TOPIC)
            try:
                ensure_topics(make_admin(self._bootstrap), REGISTRY_TOPICS, 10, self.topology.replication_factor, self.topology.min_insync_replicas)
            except (KafkaException, TimeoutError) as exc:  # the next announcement tries again
                log.warning("could not create the registry topic %s: %s", REGISTRY_TOPIC, exc)
        self._producer.poll(0)
