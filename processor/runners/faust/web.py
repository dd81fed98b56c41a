"""The worker's HTTP side: SOW queries for the partitions it serves, metrics, and its registry entry.

What the endpoint may do is decided here, from a WebSettings: the address it binds (exactly the
host asked for), an optional bearer token required on every request, optional TLS, and the row
and time limits of each query. The decisions are pure functions, so the worker only passes
settings in.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import os
import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import orjson

from processor.contract.errors import ConfigError
from processor.core.filters import FilterError
from processor.kafka.registry import REFRESH_S, REGISTRY_TOPIC, announcement
from processor.query.engine import QueryLimitError, QueryLimits, SowQuery, run_query
from processor.runners.faust import metrics

if TYPE_CHECKING:
    from processor.runners.faust.worker import SowWorker


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


def _json(view, body: dict, status: int = 200, headers: dict | None = None):
    return view.bytes(orjson.dumps(body), status=status, content_type="application/json", headers=headers)


def install_web(worker: "SowWorker", app, settings: WebSettings | None = None) -> None:
    """Serve /sow/{topic} and /metrics, announce the worker in `__ksow_workers`, and configure
    Faust's web server (bind address, TLS) from the settings."""
    settings = settings or WebSettings.from_env(worker.web_port, worker.web_host)
    app.conf.web_bind = web_bind_address(settings)
    app.conf.web_ssl_context = settings.ssl_context()
    url = settings.url

    def refused(view, request):
        """A 401 answer when the request lacks the token, else None."""
        if authorized(settings.token, request.headers.get("Authorization")):
            return None
        return _json(view, {"error": "missing or wrong bearer token (KSOW_WEB_TOKEN)"}, 401, {"WWW-Authenticate": "Bearer"})

    @app.page("/sow/{topic}")
    async def sow_query(view, request, topic):
        """Query the SOW partitions this worker serves: ?filter=&keys=&select=&top=&order_by="""
        if (answer := refused(view, request)) is not None:
            return answer
        proc = worker.processors.get(topic)
        if proc is None:
            return _json(view, {"error": f"unknown SOW topic {topic}"}, 404)
        try:
            query = SowQuery.from_params(dict(request.query))
            async with worker.locks[topic]:
                served = sorted(p for (t, p) in worker.ready if t == topic)
                stores = [proc.stores[p] for p in served]
                # Off the event loop: a long scan must not stall heartbeats and timers.
                rows, plan = await asyncio.get_running_loop().run_in_executor(
                    None, run_query, stores, query, proc.indexes.hash_indexes, proc.key_paths, settings.limits)
        except QueryLimitError as exc:
            return _json(view, {"error": str(exc)}, exc.status)
        except (FilterError, ValueError) as exc:
            return _json(view, {"error": str(exc)}, 400)
        body = {"worker": url, "partitions": served, "plan": {"index": plan.index, "read": plan.candidates}, "results": rows}
        return _json(view, body)

    @app.page("/metrics")
    async def prometheus(view, request):
        """Prometheus exposition of this worker's metrics."""
        if (answer := refused(view, request)) is not None:
            return answer
        for topic, proc in worker.processors.items():
            metrics.RECORDS.labels(topic).set(sum(proc.stores[p].count() for (t, p) in worker.ready if t == topic and p in proc.stores))
        return view.bytes(metrics.exposition(), content_type="text/plain")

    @app.timer(REFRESH_S, name="ksow-registry")
    async def announce() -> None:
        served: dict[str, list[int]] = {}
        for topic, p in sorted(worker.ready):
            served.setdefault(topic, []).append(p)
        key, value = announcement(worker.group, url, served)
        worker.producer.produce(REGISTRY_TOPIC, value, key)
        worker.producer.poll(0)
