"""The worker's HTTP side: SOW queries for the partitions it serves, metrics, and its registry entry.

It sees the worker only through `WorkerView` (read-only): topics, the partitions served, their stores.
Queries run in a thread, never on the event loop that serves HTTP.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import orjson

from processor.contract.errors import KsowError
from processor.core.filters import FilterError
from processor.kafka.registry import REFRESH_S, announcement
from processor.query.engine import SowQuery, run_query
from processor.runners.faust import metrics

CHECK_S = 0.25  # how often the served partitions are compared with the last announcement

if TYPE_CHECKING:
    from processor.runners.faust.worker import WorkerView


def _json(view, body, status: int = 200):
    return view.bytes(orjson.dumps(body), status=status, content_type="application/json")


def install_web(worker: "WorkerView", app) -> None:
    @app.page("/sow/{topic}")
    async def sow_query(view, request, topic):
        """Query the SOW partitions this worker serves: ?filter=&keys=&select=&top=&order_by="""
        engine = worker.engine(topic)
        if engine is None:
            return _json(view, {"error": f"unknown SOW topic {topic}"}, 404)
        try:
            query = SowQuery.from_params(dict(request.query))
        except (FilterError, KsowError, ValueError) as exc:
            return _json(view, {"error": str(exc)}, 400)

        def run():
            served = worker.served(topic)
            rows, plan = run_query(worker.stores(topic), query, engine.indexes.hash_indexes, engine.key_paths)
            return served, rows, plan

        try:
            served, rows, plan = await asyncio.get_running_loop().run_in_executor(None, run)
        except (FilterError, KsowError, ValueError) as exc:
            return _json(view, {"error": str(exc)}, 400)
        body = {"worker": worker.url, "partitions": served, "plan": {"index": plan.index, "read": plan.candidates}, "results": rows}
        return _json(view, body)

    @app.page("/metrics")
    async def prometheus(view, request):
        """Prometheus exposition of this worker's metrics."""
        for topic in worker.topics():
            metrics.RECORDS.labels(topic).set(sum(store.count() for store in worker.stores(topic)))
        return view.bytes(metrics.exposition(), content_type="text/plain")

    last: dict = {"served": None, "at": 0.0}

    @app.timer(CHECK_S, name="ksow-registry")
    async def announce() -> None:
        """Refresh the registry entry every REFRESH_S, and at once when the partitions served change
        (clients then find the new owners without waiting)."""
        served = {t: ps for t in worker.topics() if (ps := worker.served(t))}
        now = time.monotonic()
        if served == last["served"] and now - last["at"] < REFRESH_S:
            return
        last["served"], last["at"] = served, now
        worker.announce(*announcement(worker.group, worker.url, served))
