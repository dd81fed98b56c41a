"""Prometheus metrics of a worker, served at GET /metrics on its HTTP port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry()
INPUTS = Counter("ksow_inputs", "Input messages handled", ["topic"], registry=REGISTRY)
OUTPUTS = Counter("ksow_outputs", "Messages produced, by output topic", ["topic"], registry=REGISTRY)
BATCH_SECONDS = Histogram(
    "ksow_batch_seconds", "Time to apply a batch and deliver its outputs", ["topic"], registry=REGISTRY,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RECORDS = Gauge("ksow_sow_records", "Records in the SOW partitions this worker serves", ["topic"], registry=REGISTRY)


def exposition() -> bytes:
    return generate_latest(REGISTRY)
