"""The worker's HTTP side: SOW queries for the partitions it serves, and its registry entry."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

from processor.core.filters import FilterError
from processor.runners.faust import metrics
from processor.query.engine import SowQuery, run_query
from processor.kafka.registry import REFRESH_S, REGISTRY_TOPIC, announcement

if TYPE_CHECKING:
    from processor.runners.faust.worker import SowWorker


def install_web(worker: "SowWorker", app) -> None:
    url = f"http://{worker.web_host}:{worker.web_port}"

    @app.page("/sow/{topic}")
    async def sow_query(view, request, topic):
        """Query the SOW partitions this worker serves: ?filter=&keys=&select=&top=&order_by="""
        proc = worker.processors.get(topic)
        if proc is None:
            return view.bytes(orjson.dumps({"error": f"unknown SOW topic {topic}"}), status=404, content_type="application/json")
        try:
            query = SowQuery.from_params(dict(request.query))
            async with worker.locks[topic]:
                served = sorted(p for (t, p) in worker.ready if t == topic)
                rows, plan = run_query([proc.stores[p] for p in served], query, proc.indexes.hash_indexes, proc.key_paths, proc.spec.expiry)
        except (FilterError, ValueError) as exc:
            return view.bytes(orjson.dumps({"error": str(exc)}), status=400, content_type="application/json")
        body = {"worker": url, "partitions": served, "plan": {"index": plan.index, "read": plan.candidates}, "results": rows}
        return view.bytes(orjson.dumps(body), content_type="application/json")

    @app.page("/metrics")
    async def prometheus(view, request):
        """Prometheus exposition of this worker's metrics."""
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
