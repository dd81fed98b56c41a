"""The worker's HTTP side: SOW queries for the partitions it serves, metrics, and its registry entry.

What the endpoint may do is decided here, from a WebSettings: the address it binds (exactly the
host asked for), an optional bearer token required on every request, optional TLS, and the row
and time limits of each query. The decisions are pure functions, so the worker only passes
settings in. The handlers see the worker only through `WorkerView` (read-only), and queries run in a
thread, never on the event loop that serves HTTP.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import ipaddress
import os
import socket
import ssl
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Protocol

import orjson
from aiohttp.http_exceptions import BadHttpMessage
from faust.web import View

from processor.contract.errors import ConfigError, KsowError
from processor.contract.limits import QUERY_SPAN, max_delete_keys, query_share, query_threads
from processor.core.filters import FilterError
from processor.kafka.registry import REFRESH_S, announcement
from processor.query.engine import QueryLimitError, QueryLimits, QueryPacer, SowQuery, run_query, through_view
from processor.runners.faust import metrics
from processor.state.base import cached_records
from processor.state.rocksdb import memory_usage as rocksdb_memory
from processor.topology import Topology

log = logging.getLogger(__name__)

CHECK_S = 0.25  # how often the served partitions are compared with the last announcement
IDLE_CLOSE_S = 10.0  # a connection with no request in progress and none completed for this long is closed
MAX_CONNECTIONS = 256  # past this many, idle connections are closed after 1 s instead


class WorkerView(Protocol):
    """What the HTTP side may see of a worker: read-only, none of the loop's Kafka clients (the worker
    hands one in: processor.runners.faust.worker.LoopView)."""

    group: str
    topology: Topology

    def topics(self) -> list[str]: ...

    def engine(self, topic: str): ...

    def served(self, topic: str) -> list[int]: ...

    def stores(self, topic: str): ...

    def busy(self) -> bool:
        """Whether the worker's input loop has work now (queries then give way: QueryPacer)."""
        ...

    def input_lag(self) -> dict[str, int]:
        """Inputs on the broker not applied and committed yet, by SOW topic (SowLoop.input_lag)."""
        ...

    def announce(self, key: bytes, value: bytes) -> None: ...


@dataclass(frozen=True)
class WebSettings:
    """How a worker's HTTP endpoint is exposed. Build with `from_env` (CLI options win over env)."""

    port: int
    host: str = "127.0.0.1"  # the host clients are told (in `__ksow_workers`) and, unless `bind`, bound
    bind: str | None = None  # the interface to listen on when it differs from `host` (e.g. 0.0.0.0 in a container)
    token: str | None = None  # bearer token every request must carry
    cert: str | None = None  # PEM certificate chain: serve HTTPS
    key: str | None = None  # its private key (may be inside `cert`)
    limits: QueryLimits = field(default_factory=QueryLimits)

    @classmethod
    def from_env(cls, port: int, host: str | None = None, bind: str | None = None, token: str | None = None,
                 cert: str | None = None, key: str | None = None) -> "WebSettings":
        """Settings from the given values, else KSOW_WEB_HOST, KSOW_WEB_BIND, KSOW_WEB_TOKEN,
        KSOW_WEB_CERT, KSOW_WEB_KEY; limits from KSOW_QUERY_MAX_ROWS / KSOW_QUERY_MAX_SECONDS."""
        env = os.environ.get
        settings = cls(
            port=port,
            host=host or env("KSOW_WEB_HOST") or "127.0.0.1",
            bind=bind or env("KSOW_WEB_BIND") or None,
            token=token or env("KSOW_WEB_TOKEN") or None,
            cert=cert or env("KSOW_WEB_CERT") or None,
            key=key or env("KSOW_WEB_KEY") or None,
        )
        if settings.key and not settings.cert:
            raise ConfigError("--web-key (KSOW_WEB_KEY) needs --web-cert (KSOW_WEB_CERT)")
        return settings

    def check_port(self) -> None:
        """ConfigError when the address is taken (aiohttp would fail with a traceback once the
        worker has joined its group, after its banner announced the address)."""
        address = web_bind_address(self)
        try:
            infos = socket.getaddrinfo(address, self.port, type=socket.SOCK_STREAM)
            with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
                probe.bind(infos[0][4])
        except OSError as exc:
            raise ConfigError(f"cannot serve queries at {address}:{self.port}: {exc.strerror or exc} "
                              "(--web-port, --web-host, --web-bind; with --workers N, ports --web-port to --web-port + N - 1)") from None

    @property
    def url(self) -> str:
        """The address announced to clients."""
        scheme = "https" if self.cert else "http"
        return f"{scheme}://{_url_host(self.host)}:{self.port}"

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server's TLS context, or None for plain HTTP; a bad certificate is a ConfigError."""
        if not self.cert:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot use --web-cert {self.cert} / --web-key {self.key}: {exc}") from None
        return context


def web_bind_address(settings: WebSettings) -> str:
    """The interface to listen on: `bind` when given, else exactly `host` ('localhost' binds the
    loopback interface, never every interface)."""
    return settings.bind or settings.host


def _url_host(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


def authorized(token: str | None, authorization: str | None) -> bool:
    """Whether a request's Authorization header satisfies the token (always, when there is none)."""
    if token is None:
        return True
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


class MalformedRequests(logging.Filter):
    """aiohttp logs a request it cannot parse (a URL over its 8 KB line, a bad header) at ERROR
    with a traceback: a caller's mistake, which must not fill a worker's log. One line at WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage):
            record.msg, record.args = f"refused a malformed HTTP request: {record.getMessage()}: {exc.message}", ()
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class CallerTurns:
    """The worker's query threads, handed out in turn among the callers waiting for one (by address).
    With one line in arrival order, a caller that sent twenty queries at once held every thread
    for all of them while another's one query waited behind them, and was answered 503 after its
    time limit; now each caller waiting has the next thread in its turn, and a caller's queries wait
    behind its own."""

    def __init__(self, threads: int):
        self._free = threads
        self._waiting: dict[str, deque[asyncio.Future]] = {}  # callers in turn order, each with its queries in order

    async def acquire(self, caller: str, timeout: float) -> bool:
        """A thread for one of `caller`'s queries, or False after `timeout` seconds without one."""
        if self._free and not self._waiting:
            self._free -= 1
            return True
        turn = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(caller, deque()).append(turn)
        try:
            await asyncio.wait_for(turn, timeout)
            return True
        except asyncio.TimeoutError:
            self._leave(caller, turn)
            return False
        except asyncio.CancelledError:  # the request went away
            self._leave(caller, turn)
            raise

    def release(self) -> None:
        """A query is done: its thread goes to the next caller in turn, who goes to the back."""
        waiting = self._waiting
        while waiting:
            caller = next(iter(waiting))
            turns = waiting.pop(caller)
            turn = turns.popleft()
            if turns:
                waiting[caller] = turns
            if not turn.done():
                turn.set_result(None)
                return
        self._free += 1

    def _leave(self, caller: str, turn: asyncio.Future) -> None:
        """A wait that ended without its thread: out of the line, or, handed one just then, passing it on."""
        turns = self._waiting.get(caller)
        if turns is not None and turn in turns:
            turns.remove(turn)
            if not turns:
                del self._waiting[caller]
        elif turn.done() and not turn.cancelled():
            self.release()


class Connections:
    """Closes connections that hold a socket without asking anything: aiohttp waits for a request's
    head as long as its sender likes, so half-sent requests piled up until the worker ran out of
    file handles (audit: 19,700 sockets; then every accept() failed). A connection is idle while no
    request is in progress; one idle with no request completed for IDLE_CLOSE_S is closed (sooner
    past MAX_CONNECTIONS), and so is one whose request has not completed within `max_request_s`
    and IDLE_CLOSE_S more (a body sent a byte at a time). aiohttp keeps no public record of
    a connection's progress: its request count and current request are read when present, and
    without them nothing is closed."""

    def __init__(self, max_request_s: float):
        self.max_request_s = max_request_s
        # handler -> (requests completed, since when). Keyed by the handler itself, held until the
        # next sweep: by id() a new connection took the record of a closed one whose address it
        # reused, and was closed at once as idle (audit).
        self.seen: dict[object, tuple[int, float]] = {}

    def sweep(self, handlers: list, now: float) -> int:
        """Close what overstayed; returns how many."""
        crowded = len(handlers) > MAX_CONNECTIONS
        seen, closed = {}, 0
        for handler in handlers:
            count, busy = getattr(handler, "_request_count", None), getattr(handler, "_current_request", None)
            if count is None:
                continue
            previous = self.seen.get(handler)
            since = previous[1] if previous is not None and previous[0] == count else now
            seen[handler] = (count, since)
            quiet = now - since
            if quiet > self.max_request_s + IDLE_CLOSE_S or (busy is None and (quiet > IDLE_CLOSE_S or (crowded and quiet > 1.0))):
                handler.force_close()
                closed += 1
        self.seen = seen
        return closed


class AcceptErrors:
    """An event loop exception handler that tells 'socket.accept() out of system resource' (no file
    handle left) once a minute with a count, not with a traceback each time (audit: 431,103
    tracebacks in two minutes, 193 MB of log), and hands everything else to the default."""

    EVERY_S = 60.0

    def __init__(self) -> None:
        self.last = float("-inf")
        self.count = 0

    def __call__(self, loop, context: dict) -> None:
        if not str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            loop.default_exception_handler(context)
            return
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.EVERY_S:
            log.error("the worker's HTTP server cannot accept connections: %s (%d times since the last report)",
                      context.get("exception"), self.count)
            self.last, self.count = now, 0


def _json(view, body: dict, status: int = 200, headers: dict | None = None):
    return view.bytes(orjson.dumps(body), status=status, content_type="application/json", headers=headers)


def worker_status(worker: WorkerView, url: str) -> dict:
    """A worker's state for `/status` and `/metrics`: by SOW topic the partitions it serves, the
    records in them and its input lag (inputs on the broker not applied and committed yet); its
    resident memory, RocksDB's (`cache`, the memtables charged to it included, and `memtables`) and
    the decoded records its stores cache."""
    lag = worker.input_lag()
    topics = {topic: {"partitions": worker.served(topic), "records": sum(store.count() for store in worker.stores(topic)),
                      "input_lag": lag.get(topic, 0)} for topic in worker.topics()}
    return {"url": url, "topics": topics, "rss_bytes": _resident_bytes(), "rocksdb_bytes": rocksdb_memory(),
            "cached_records": cached_records()}


def _resident_bytes() -> int | None:
    """This process's resident memory (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def install_web(worker: WorkerView, app, settings: WebSettings) -> None:
    """Serve /sow/{topic}, /status and /metrics, announce the worker in the registry, and configure Faust's
    web server (bind address, TLS) from the settings."""
    app.conf.web_bind = web_bind_address(settings)
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequests) for f in server_log.filters):
        server_log.addFilter(MalformedRequests())
    app.conf.web_ssl_context = settings.ssl_context()

    queries = ThreadPoolExecutor(query_threads(), thread_name_prefix="ksow-query")
    slots = CallerTurns(query_threads())
    pacer = QueryPacer(query_share(), worker.busy)
    # A query may wait its limit for a thread, then run its limit and wait as long for its turns.
    connections = Connections(QUERY_SPAN * settings.limits.max_seconds)

    def refused(view, request):
        """A 401 answer when the request lacks the token, else None."""
        if authorized(settings.token, request.headers.get("Authorization")):
            return None
        return _json(view, {"error": "missing or wrong bearer token (KSOW_WEB_TOKEN)"}, 401, {"WWW-Authenticate": "Bearer"})

    async def sow_query(view, request, topic: str, params: dict):
        """Query the SOW partitions this worker serves, with the parameters filter, keys, select,
        top and order_by (the caller checked the token)."""
        try:
            query = SowQuery.from_params(params)
            topic, filter, select = through_view(worker.topology, topic, query.filter, list(query.select), query.order_by)
        except (FilterError, KsowError, ValueError) as exc:
            return _json(view, {"error": str(exc)}, 400)
        engine = worker.engine(topic)
        if engine is None:
            return _json(view, {"error": f"unknown SOW topic {topic}"}, 404)
        query = replace(query, filter=filter, select=tuple(select or ()))

        def run():
            served = worker.served(topic)
            rows, plan = run_query(worker.stores(topic), query, engine.indexes.hash_indexes, engine.key_paths, settings.limits, engine.spec.expiry,
                                   pacer=pacer, key_spec=engine.indexes.keys)
            return served, rows, plan

        try:
            if not await slots.acquire(request.remote or "", settings.limits.max_seconds):
                return _json(view, {"error": f"the worker ran other queries for {settings.limits.max_seconds:g}s "
                                             "(KSOW_QUERY_THREADS at a time); ask again"}, 503)
            try:
                served, rows, plan = await asyncio.get_running_loop().run_in_executor(queries, run)
            finally:
                slots.release()
        except QueryLimitError as exc:
            return _json(view, {"error": str(exc)}, exc.status)
        except (FilterError, KsowError, ValueError) as exc:
            return _json(view, {"error": str(exc)}, 400)
        body = {"worker": settings.url, "partitions": served, "plan": {"index": plan.index, "by_key": plan.by_key, "read": plan.candidates}, "results": rows}
        return _json(view, body)

    @app.page("/sow/{topic}")
    class SowQueryView(View):
        """GET /sow/{topic}?filter=&keys=&select=&top=&order_by=, or POST the same names as one JSON
        object: the client posts, so a long filter or key list never meets the URL's length limit."""

        async def get(self, request, topic):
            if (answer := refused(self, request)) is not None:
                return answer
            return await sow_query(self, request, topic, dict(request.query))

        async def post(self, request, topic):
            if (answer := refused(self, request)) is not None:  # before the body is read
                return answer
            try:
                params = orjson.loads(await request.read())
            except orjson.JSONDecodeError as exc:
                return _json(self, {"error": f"the body is not JSON: {exc}"}, 400)
            if not isinstance(params, dict) or not all(isinstance(v, str) for v in params.values()):
                return _json(self, {"error": "the body must be a JSON object of strings (filter, keys, select, top, order_by)"}, 400)
            if request.query:
                return _json(self, {"error": "give the query's parameters in the body or in the URL, not in both"}, 400)
            return await sow_query(self, request, topic, params)

    @app.page("/status")
    async def status(view, request):
        """What this worker serves and how it keeps up, as JSON (`ksow status`): by SOW topic its
        partitions, records and input lag, and its memory (see `worker_status`)."""
        if (answer := refused(view, request)) is not None:
            return answer
        return _json(view, worker_status(worker, settings.url))

    @app.page("/metrics")
    async def prometheus(view, request):
        """Prometheus exposition of this worker's metrics."""
        if (answer := refused(view, request)) is not None:
            return answer
        now = worker_status(worker, settings.url)
        for topic, figures in now["topics"].items():
            metrics.RECORDS.labels(topic).set(figures["records"])
            metrics.INPUT_LAG.labels(topic).set(figures["input_lag"])
        for part, used in now["rocksdb_bytes"].items():
            metrics.ROCKSDB_MEMORY.labels(part).set(used)
        metrics.CACHED_RECORDS.set(now["cached_records"])
        return view.bytes(metrics.exposition(), content_type="text/plain")

    last: dict = {"served": None, "at": 0.0}

    @app.timer(1.0, name="ksow-connections")
    async def close_idle_connections() -> None:
        loop = asyncio.get_running_loop()
        if not isinstance(loop.get_exception_handler(), AcceptErrors):
            loop.set_exception_handler(AcceptErrors())
        server = getattr(getattr(app.web, "_runner", None), "server", None)  # faust's aiohttp driver
        handlers = getattr(server, "connections", None)
        if handlers:
            if closed := connections.sweep(list(handlers), time.monotonic()):
                log.info("closed %d HTTP connections that sent no complete request", closed)

    @app.timer(CHECK_S, name="ksow-registry")
    async def announce() -> None:
        """Refresh the registry entry every REFRESH_S, and at once when the partitions served change
        (clients then find the new owners without waiting)."""
        served = {t: ps for t in worker.topics() if (ps := worker.served(t))}
        now = time.monotonic()
        if served == last["served"] and now - last["at"] < REFRESH_S:
            return
        last["served"], last["at"] = served, now
        worker.announce(*announcement(worker.group, settings.url, served, settings.token, max_delete_keys()))
