"""Prometheus metrics of a worker, served at GET /metrics on its HTTP port."""

from __future__ import annotations

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry()
# The process's own figures, as any Prometheus client serves them: resident memory, CPU seconds, open
# files (process_*), the Python version and its garbage collections.
for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
    REGISTRY.register(_collector)
INPUTS = Counter("ksow_inputs", "Input messages applied, by SOW topic", ["topic"], registry=REGISTRY)
OUTPUTS = Counter("ksow_outputs", "Messages produced, by output topic", ["topic"], registry=REGISTRY)
BATCH_SECONDS = Histogram(
    "ksow_commit_seconds", "Time to produce a batch's outputs and commit its transaction", registry=REGISTRY,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
ENFORCED = Counter("ksow_enforced_order", "Batches applied without waiting longer for an input that was behind (max idle reached)", registry=REGISTRY)
ABORTED = Counter("ksow_aborted_batches", "Batches whose transaction was aborted (fenced, rebalanced, broker error)", registry=REGISTRY)
CHECKPOINTS = Counter("ksow_delete_checkpoints", "Commits in the middle of a sow_delete that removes many records (KSOW_DELETE_CHUNK)", registry=REGISTRY)
TOPICS_RECREATED = Counter("ksow_topics_recreated", "Topics of the topology deleted under a running worker and created again by it", registry=REGISTRY)
RESEEDS = Counter("ksow_changelog_reseeds", "Partitions whose store wrote its records back to .sow: the changelog was deleted or truncated, or the topic's encoding changed", registry=REGISTRY)
CHANGELOG_SKIPPED = Counter("ksow_changelog_skipped", "Records of .sow that were not SOW records, skipped on restore", registry=REGISTRY)
# Where the loop thread's time goes (wall time, summed): a worker that falls behind shows which step
# holds it, without a profiler. consume: waiting for and taking inputs; file: queueing them;
# apply: applying inputs; sweep: expiring records and releasing conflated view events; prepare:
# building the stores' write batches while the broker commits; commit_wait: waiting for the
# transaction's commit (or the flush) after that; store_commit: writing the stores. A delete that
# removes many records commits in the middle of being applied (KSOW_DELETE_CHUNK): those commits
# count in their own steps and in apply too.
LOOP_STEPS = ("consume", "file", "apply", "sweep", "prepare", "commit_wait", "store_commit")
LOOP_SECONDS = Counter("ksow_loop_seconds", "Wall time of the worker's loop thread, by step", ["step"], registry=REGISTRY)
# Expiry on time, as a deployment sees it: a sweep of a partition that expired records observes how
# late it came for the oldest of them (the sweep's `sow-actual-expiry` less that record's
# `sow-expires-at`; the others were due after it, so they came less late: the sweep's worst). Sweeps run
# every KSOW_EXPIRY_TICK_MS; one falling behind shows here before anyone reads `EXP.`.
EXPIRY_LATENESS = Histogram(
    "ksow_expiry_lateness_seconds", "How late each sweep of a partition expired the oldest record it expired, by SOW topic",
    ["topic"], registry=REGISTRY, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
RECORDS = Gauge("ksow_sow_records", "Records in the SOW partitions this worker serves", ["topic"], registry=REGISTRY)
# Set when /metrics is read. A worker falling behind its publishers shows here first, by how many
# inputs, as Kafka Streams' records-lag: each input partition it owns, its end as of the last fetch
# (the last stable offset: a transaction's commit marker counts as one) less its committed offset.
INPUT_LAG = Gauge("ksow_input_lag", "Input messages on the broker not yet applied and committed, by SOW topic (its input partitions this worker owns)",
                  ["topic"], registry=REGISTRY)
ROCKSDB_MEMORY = Gauge("ksow_rocksdb_memory_bytes", "RocksDB memory of this process's stores (KSOW_ROCKSDB_MEMORY_MB): the block cache, "
                       "memtables charged to it included, and the memtables alone", ["part"], registry=REGISTRY)
CACHED_RECORDS = Gauge("ksow_cached_records", "Decoded records this process's stores keep between batches (KSOW_CACHE_RECORDS)", registry=REGISTRY)


def exposition() -> bytes:
    return generate_latest(REGISTRY)
