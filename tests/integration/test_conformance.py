"""Cross-engine conformance: one random history, four implementations, one answer.

Each history (Hypothesis-generated from a fixed seed, so every run sees the same histories) is a
list of publishes, delta publishes (nested objects included), deletes by data, deletes by SowKeys,
deletes by filter, inputs that must be rejected, and per-message lifetimes (`sow-expiration`). It
runs through:

  (a) the Faust worker (a `ksow up` subprocess),
  (b) the Spark streaming runner (`run_stream`, transformWithState),
  (c) the Spark snapshot job (`processor.batch.snapshot.snapshot`) at the instant of the check,
  (d) the reference fold (`processor.engine.fold.SowFold`), which also renders the outputs the
      core says the workers must produce.

Each engine gets its own topics (its own topology) fed the same messages, with the same Kafka
timestamps, partitions and keys. The topics of one history share a `key_domain`, so SowKeys are
the same in every engine. Asserted:

- the final SOWs (latest per key of `<topic>.sow`, tombstones removed, with `sow-expires-at`) of
  (a) and (b), the snapshot (c) and the fold (d) are identical;
- per SowKey, the sequence of (sow-op, value, sow-expires-at) on `<topic>.sow`, `<topic>.diff` and
  `EXP.<topic>` (`<topic>.dead` for the topic with `expiry_topic: none`) is identical between (a), (b) and the fold's rendering (d); the rejected inputs on
  `<topic>.errors` (value and `sow-error`) are the same multiset.

Compared modulo what legitimately differs by engine: `sow-seq` (a counter floored by each engine's
own clock; checked to increase per key and to carry the owner partition in its low bits),
`sow-actual-expiry` and the Kafka timestamps of outputs (when each engine ran), and the order
between different keys.

Why the histories are deterministic although the engines run live:
- Every message of a key goes to `<topic>` (deltas and deletes carry `sow-command`), on the key's
  owner partition, with strictly increasing Kafka timestamps: one order for all engines.
- Lifetimes are either long (`1d`, `0` = never) or shorter than the spacing of the history's
  timestamps, which lie minutes in the past: such a record is due before the next input of the
  history and at any wall-clock instant, for the live engines and for the fold alike.
- Deletes by SowKeys and by filter fan out: Faust re-routes them through `<topic>.repartition`,
  where they are not ordered with the inputs on `<topic>`. So they are barriers: the test waits
  until every engine has produced the outputs of everything before, sends the delete alone, waits
  again, then goes on.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import orjson
import pytest
import yaml

pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'ksow[spark]')")
from hypothesis import HealthCheck, Phase, find, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from processor.core.codec import codec_for  # noqa: E402
from processor.core.keys import owner_partition  # noqa: E402
from processor.engine.outputs import Streams, render, sink  # noqa: E402
from processor.kafka.clients import end_offsets, ensure_topics, make_consumer, make_producer, topic_configs
from processor.contract.types import InputMessage
from processor.engine.fold import SowFold
from processor.topology import SowTopic, Topology  # noqa: E402

from .workers import Worker, headers_of, read_all  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.timeout(480)]

# seed -> the topic's expiry options: per-message lifetimes only, a topic default, a clamp
SEEDS = {
    101: {"expiration": "enabled"},
    202: {"expiration": "1d"},
    303: {"expiration": "enabled", "max_expiration": "2d", "expiry_topic": "none"},  # expired records go to .dead
}
PARTITIONS = 2
SPACING = 10  # ms between the Kafka timestamps of consecutive inputs of a history
T0 = (int(time.time() * 1000) // 1000 - 900) * 1000  # fifteen minutes ago
LONG = ["0", "1d"]
EXPIRED = ["1ms", "5ms"]  # shorter than SPACING: due before the next input, and long before the check
assert all(int(x.removesuffix("ms")) < SPACING for x in EXPIRED)

# -- histories ---------------------------------------------------------------------------------
LEAF = st.one_of(st.integers(-3, 3), st.sampled_from(["open", "done", "x"]), st.none(), st.lists(st.integers(0, 3), max_size=2))
NESTED = st.recursive(LEAF, lambda inner: st.dictionaries(st.sampled_from(["p", "q", "r"]), inner, max_size=3), max_leaves=5)
BODY = st.dictionaries(st.sampled_from(["a", "s", "n", "arr"]), NESTED, max_size=3)
IDS = st.integers(0, 7)
LIFETIME = st.sampled_from([None, None, None, None, None, *LONG, *EXPIRED])
FILTERS = [
    "/a IS NOT NULL",
    "/id IN (1, 3, 5)",
    "/s = 'open' OR /a > 0",
    "/n IS NULL AND /id > 2",
    "/a BETWEEN -1 AND 1 OR /s = 'done'",
    "NOT /arr IS NULL",
    "/n/p IS NOT NULL",
    "1=1",  # last: Hypothesis draws the first ones more often
]
BAD = ["not_json", "no_key", "bad_lifetime", "bad_command", "bad_filter"]

WRITE = st.tuples(st.sampled_from(["publish", "delta"]), IDS, BODY, LIFETIME)
DELETE = st.tuples(st.just("delete_data"), IDS)
REJECTED = st.tuples(st.just("bad"), st.sampled_from(BAD), st.integers(0, PARTITIONS - 1))
# about 7 writes to 2 deletes by data to 1 rejected input
EVENT = st.sampled_from(["w"] * 7 + ["d"] * 2 + ["r"]).flatmap(lambda kind: {"w": WRITE, "d": DELETE, "r": REJECTED}[kind])
DELETE_KEYS = st.tuples(st.just("delete_keys"), st.lists(IDS, min_size=1, max_size=3, unique=True), st.integers(0, PARTITIONS - 1))
DELETE_FILTER = st.tuples(st.just("delete_filter"), st.sampled_from(FILTERS), st.integers(0, PARTITIONS - 1))
# events, then a delete by SowKeys and a delete by filter, each at a share of the way through
HISTORY = st.tuples(st.lists(EVENT, min_size=50, max_size=80), st.tuples(st.floats(0.2, 0.9), DELETE_KEYS), st.tuples(st.floats(0.2, 0.9), DELETE_FILTER))


def _rich(drawn) -> bool:
    events = drawn[0]
    kinds = Counter(e[0] for e in events)
    lifetimes = {e[3] for e in events if e[0] in ("publish", "delta")}
    return (
        kinds["delta"] >= 8 and kinds["publish"] >= 8 and kinds["delete_data"] >= 2 and kinds["bad"] >= 1
        and len({e[1] for e in events if e[0] != "bad"}) >= 6
        and bool(lifetimes & set(EXPIRED)) and bool(lifetimes & set(LONG))
    )


def _phases(drawn) -> list[list[tuple]]:
    """The events with the barriers inserted, cut into phases: each barrier is a phase of its own."""
    events, *barriers = drawn
    events = list(events)
    for share, barrier in sorted(barriers, key=lambda b: -b[0]):
        events.insert(max(1, int(len(events) * share)), barrier)
    phases: list[list[tuple]] = [[]]
    for e in events:
        if e[0] in ("delete_keys", "delete_filter"):
            phases += [[e], []]
        else:
            phases[-1].append(e)
    return [p for p in phases if p]


def _barriers_bite(drawn) -> bool:
    """Both barrier deletes remove something, and something is left at the end."""
    spec = SowTopic(timestamps="publisher", topic="probe", key=["/id"], expiration="enabled", partitions=PARTITIONS)
    fold = SowFold(spec, transitions=True)
    bites, n = 0, 0
    for phase in _phases(drawn):
        for event in phase:
            m = to_message(spec, event, T0 + n * SPACING)
            done = fold.apply(InputMessage(spec.topic, m.partition, n, m.key, m.value, m.headers, m.timestamp))
            n += 1
            bites += event[0] in ("delete_keys", "delete_filter") and any(t.op.value == "delete" for t in done)
    return bites == 2 and len(fold.as_of(T0 + n * SPACING)) >= 3


def history(seed: int) -> list[list[tuple]]:
    """The history drawn from `seed` (reproducible: a seeded search without shrinking), in phases."""
    found = find(
        HISTORY, lambda drawn: _rich(drawn) and _barriers_bite(drawn), random=random.Random(seed),
        settings=settings(phases=[Phase.generate], database=None, max_examples=5000, suppress_health_check=list(HealthCheck)),
    )
    return _phases(found)


# -- messages ----------------------------------------------------------------------------------
@dataclass
class Message:
    partition: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    timestamp: int


def to_message(spec: SowTopic, event: tuple, timestamp: int) -> Message:
    """The Kafka message an event is (for any engine's `<topic>`: the values do not name topics)."""
    ks = spec.key_spec

    def keyed(i: int, value, headers) -> Message:
        key = ks.sow_key({"id": i})
        return Message(owner_partition(key, PARTITIONS), key.encode(), orjson.dumps(value), headers, timestamp)

    kind = event[0]
    if kind in ("publish", "delta"):
        _, i, body, lifetime = event
        headers = [("sow-command", b"delta_publish")] if kind == "delta" else []
        if lifetime is not None:
            headers.append(("sow-expiration", lifetime.encode()))
        return keyed(i, {"id": i, **body}, headers)
    if kind == "delete_data":
        return keyed(event[1], {"id": event[1]}, [("sow-command", b"sow_delete")])
    if kind == "delete_keys":
        keys = ",".join(ks.sow_key({"id": i}) for i in event[1])
        return Message(event[2], b"keys", None, [("sow-command", b"sow_delete"), ("sow-keys", keys.encode())], timestamp)
    if kind == "delete_filter":
        return Message(event[2], b"filter", None, [("sow-command", b"sow_delete"), ("sow-filter", event[1].encode())], timestamp)
    _, bad, partition = event
    value, headers = {
        "not_json": (b'{"id": 1, "broken', []),
        "no_key": (b'{"other": 1}', []),
        "bad_lifetime": (b'{"id": 2}', [("sow-expiration", b"soon")]),
        "bad_command": (b'{"id": 3}', [("sow-command", b"bogus")]),
        "bad_filter": (None, [("sow-command", b"sow_delete"), ("sow-filter", b"/a >> 3")]),
    }[bad]
    return Message(partition, b"bad", value, headers, timestamp)


# -- the run -----------------------------------------------------------------------------------
@dataclass
class Run:
    seed: int
    phases: list[list[tuple]]
    specs: dict[str, SowTopic]  # engine -> its topics
    fold: SowFold
    expected: list[tuple[int, int]] = field(default_factory=list)  # per phase: (outputs per stream, errors) so far
    events_of: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # SowKey -> what the history did to it

    @property
    def messages(self) -> list[tuple[int, tuple, Message]]:
        out, n = [], 0
        for p, phase in enumerate(self.phases):
            for event in phase:
                out.append((p, event, to_message(self.specs["faust"], event, T0 + n * SPACING)))
                n += 1
        return out


def _plan(seed: int, base: str) -> Run:
    phases = history(seed)
    domain = f"conf{seed}"
    specs = {
        engine: SowTopic(timestamps="publisher", topic=f"{base}_{seed}_{engine}", key=["/id"], key_domain=domain, partitions=PARTITIONS, **SEEDS[seed])
        for engine in ("faust", "spark")
    }
    run = Run(seed, phases, specs, SowFold(specs["faust"], transitions=True))
    transitions = 0
    n = 0
    for phase in phases:
        for event in phase:
            m = to_message(specs["faust"], event, T0 + n * SPACING)
            msg = InputMessage(specs["faust"].topic, m.partition, n, m.key, m.value, m.headers, m.timestamp)
            for t in run.fold.apply(msg):
                transitions += 1
                run.events_of[t.key].append(f"-> {t.op.value} {t.after.data if t.after else ''}")
            if event[0] in ("publish", "delta", "delete_data"):
                run.events_of[m.key.decode()].append(f"@{n} {event}")
            n += 1
        # What the live engines do at once (their clock is long past): expire what is due now.
        transitions += len(run.fold.expire_until(T0 + n * SPACING - 1))
        run.expected.append((transitions, run.fold.rejected))
    return run


def _snapshot(spark, bootstrap: str, spec: SowTopic, as_of: int) -> dict[str, tuple]:
    from processor.batch.snapshot import snapshot

    return {r["sow_key"]: (orjson.loads(r["record"]), r["expires_at"]) for r in snapshot(spark, bootstrap, spec, as_of).collect()}


def _counts(consumer, topic: str) -> int:
    return sum(high - low for low, high in end_offsets(consumer, topic, range(PARTITIONS)).values())


def _wait_for_outputs(bootstrap: str, runs: list[Run], phase: int, queries, worker, timeout: float = 120) -> None:
    """Until every engine has produced the outputs (and rejections) of the history up to `phase`."""
    consumer = make_consumer(bootstrap)
    deadline = time.monotonic() + timeout
    try:
        while True:
            missing = []
            for run in runs:
                want, rejected = run.expected[min(phase, len(run.expected) - 1)]
                for engine, spec in run.specs.items():
                    got = (_counts(consumer, spec.diff_topic), _counts(consumer, spec.errors_topic))
                    if got[0] < want or got[1] < rejected:
                        missing.append((run.seed, engine, got, (want, rejected)))
            if not missing:
                return
            assert all(q.isActive for q in queries), [q.exception() for q in queries]
            assert worker.proc.poll() is None, worker.log()[-3000:]
            if time.monotonic() > deadline:
                return  # the comparison below shows what is missing
            time.sleep(0.25)
    finally:
        consumer.close()


@pytest.fixture(scope="module")
def conformance(kafka_bootstrap, admin, tmp_path_factory, request):
    from processor.runners.spark.stream import run_stream
    from processor.batch.session import get_spark

    began = time.monotonic()
    base = f"t_conf_{uuid.uuid4().hex[:6]}"
    runs = [_plan(seed, base) for seed in SEEDS]
    for run in runs:
        for spec in run.specs.values():
            ensure_topics(admin, topic_configs(spec))
    tmp = tmp_path_factory.mktemp("conformance")
    topology = tmp / "faust.yaml"
    topology.write_text(yaml.safe_dump({"sow": [
        {"topic": r.specs["faust"].topic, "timestamps": "publisher", "key": ["/id"], "key_domain": r.specs["faust"].key_domain, "partitions": PARTITIONS, **SEEDS[r.seed]}
        for r in runs
    ]}))
    worker = Worker(kafka_bootstrap, topology, f"{base}_faust", tmp / "faust-data", name="conformance").start(wait=False)
    spark = get_spark("local[2]", "ksow-tests", {"spark.sql.shuffle.partitions": "2"})
    _, queries = run_stream(
        kafka_bootstrap, Topology(sow=[r.specs["spark"] for r in runs]), tmp / "checkpoints", master="local[2]", trigger="1 second", block=False,
    )
    stages = {"start": time.monotonic() - began}
    pool = ThreadPoolExecutor(max_workers=len(runs))
    try:
        worker.wait_for("Worker]: Ready", 120)
        stages["faust ready"] = time.monotonic() - began
        producer = make_producer(kafka_bootstrap)
        plans = [r.messages for r in runs]
        phases = max(len(r.phases) for r in runs)
        for phase in range(phases):
            for run, messages in zip(runs, plans):
                for p, _, m in messages:
                    if p != phase:
                        continue
                    for spec in run.specs.values():
                        producer.produce(spec.topic, m.value, m.key, partition=m.partition, headers=m.headers, timestamp=m.timestamp)
            assert producer.flush(30) == 0
            if phase == phases - 1:  # the whole history is in: the snapshot jobs can run meanwhile
                checked_at = int(time.time() * 1000)
                snapshots = {run.seed: pool.submit(_snapshot, spark, kafka_bootstrap, run.specs["spark"], checked_at) for run in runs}
            _wait_for_outputs(kafka_bootstrap, runs, phase, queries, worker)
            stages[f"phase {phase}"] = time.monotonic() - began
        del producer  # flushed; librdkafka lets go of the broker now, not at interpreter exit
        time.sleep(1.5)  # nothing more may come: a duplicate or a late event would show below
        outputs = {
            (run.seed, engine): {
                stream: read_all(kafka_bootstrap, topic, PARTITIONS)
                for stream, topic in (("sow", spec.sow_topic), ("diff", spec.diff_topic), ("expired", spec.expired_topic or spec.dead_topic), ("errors", spec.errors_topic))
            }
            for run in runs
            for engine, spec in run.specs.items()
        }
        stages["read"] = time.monotonic() - began
    finally:
        for q in queries:
            q.stop()
        worker.stop()
    snapshots = {seed: job.result() for seed, job in snapshots.items()}
    pool.shutdown()
    stages["snapshots"] = time.monotonic() - began
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:  # where the time goes (visible with -s)
        reporter.write_line(f"conformance: {len(runs)} histories, {sum(len(r.messages) for r in runs)} inputs; " + ", ".join(f"{k} {v:.1f}s" for k, v in stages.items()))
    yield {"runs": {r.seed: r for r in runs}, "outputs": outputs, "snapshots": snapshots, "checked_at": checked_at}
    spark.stop()


# -- comparisons -------------------------------------------------------------------------------
def _value(raw: bytes | None):
    return None if raw is None else orjson.loads(raw)


def _per_key(messages) -> dict[str, list[tuple]]:
    """SowKey -> [(sow-op, value, sow-expires-at)], in the order written (one partition per key)."""
    out: dict[str, list[tuple]] = defaultdict(list)
    for m in messages:
        h = headers_of(m)
        assert h["sow-key"] == m.key().decode()
        out[m.key().decode()].append((h["sow-op"], _value(m.value()), int(h["sow-expires-at"]) if "sow-expires-at" in h else None))
    return dict(out)


def _seqs_increase(messages) -> None:
    last: dict[bytes, int] = {}
    for m in messages:
        seq = int(headers_of(m)["sow-seq"])
        assert seq > last.get(m.key(), -1), f"sow-seq does not increase for {m.key()!r}"
        assert seq & 1023 == owner_partition(m.key().decode(), PARTITIONS) == m.partition()
        last[m.key()] = seq


def _fold_streams(run: Run) -> dict[str, dict[str, list[tuple]]]:
    """The outputs the core renders for the fold's transitions, per stream and SowKey."""
    spec = run.specs["faust"]
    codec = codec_for(spec.message_type.value, spec.schema_)
    replay = SowFold(spec, transitions=True)
    names = Streams.of(spec)
    stream_of = {names.sow: "sow", names.diff: "diff", names.expired or names.dead: "expired", names.dead: "expired"}
    streams: dict[str, dict[str, list[tuple]]] = {"sow": defaultdict(list), "diff": defaultdict(list), "expired": defaultdict(list)}

    def add(transitions) -> None:
        for t in transitions:
            rendered: list = []
            render(t, 0, codec, names, sink(rendered))
            for e in rendered:
                h = dict(e.headers)
                stream = stream_of[e.topic]  # EXP.<topic>, or .dead with expiry_topic: none
                streams[stream][e.key.decode()].append((h["sow-op"].decode(), _value(e.value), int(h["sow-expires-at"]) if "sow-expires-at" in h else None))

    n = 0
    for phase in run.phases:
        for event in phase:
            m = to_message(spec, event, T0 + n * SPACING)
            add(replay.apply(InputMessage(spec.topic, m.partition, n, m.key, m.value, m.headers, m.timestamp)))
            n += 1
        add(replay.expire_until(T0 + n * SPACING - 1))
    return {s: dict(v) for s, v in streams.items()}


def _final_sow(messages) -> dict[str, tuple]:
    """Latest per key of `<topic>.sow`, tombstones removed: {SowKey: (record, sow-expires-at)}."""
    latest: dict[str, tuple] = {}
    for m in messages:
        h = headers_of(m)
        latest[m.key().decode()] = None if m.value() is None else (orjson.loads(m.value()), int(h["sow-expires-at"]) if "sow-expires-at" in h else None)
    return {k: v for k, v in latest.items() if v is not None}


def _explain(run: Run, keys) -> str:
    return "\n".join(f"  {k}:\n    " + "\n    ".join(run.events_of.get(k, [])) for k in sorted(keys))


@pytest.mark.parametrize("seed", sorted(SEEDS))
def test_final_sow_is_the_same_in_every_engine(conformance, seed):
    """Faust worker, Spark streaming runner, Spark snapshot job and the reference fold agree."""
    run: Run = conformance["runs"][seed]
    outputs = conformance["outputs"]
    fold = {k: (r.data, r.expires_at) for k, r in run.fold.as_of(conformance["checked_at"]).items()}
    assert run.fold.records, "a history that leaves nothing behind checks little"
    sows = {
        "faust": _final_sow(outputs[(seed, "faust")]["sow"]),
        "spark": _final_sow(outputs[(seed, "spark")]["sow"]),
        "snapshot": conformance["snapshots"][seed],
    }
    for name, sow in sows.items():
        if sow != fold:
            wrong = {k for k in set(sow) | set(fold) if sow.get(k) != fold.get(k)}
            pytest.fail(f"seed {seed}: {name} disagrees with the fold on {len(wrong)} keys\n{_explain(run, wrong)}\n"
                        f"{name}: { {k: sow.get(k) for k in wrong} }\nfold: { {k: fold.get(k) for k in wrong} }")


@pytest.mark.parametrize("seed", sorted(SEEDS))
def test_output_streams_are_the_same_in_both_streaming_engines(conformance, seed):
    """Per SowKey: the same (op, value, sow-expires-at) sequence on .sow, .diff and EXP.<topic>
    from Faust, from Spark and from the core's rendering of the fold; the same rejected inputs."""
    run: Run = conformance["runs"][seed]
    outputs = conformance["outputs"]
    want = _fold_streams(run)
    for engine in ("faust", "spark"):
        got = outputs[(seed, engine)]
        for stream in ("sow", "diff", "expired"):
            _seqs_increase(got[stream])
            streams = _per_key(got[stream])
            wrong = {k for k in set(streams) | set(want[stream]) if streams.get(k) != want[stream].get(k)}
            if wrong:
                detail = "\n".join(f"  {k}\n    {engine}: {streams.get(k)}\n    fold:  {want[stream].get(k)}" for k in sorted(wrong))
                pytest.fail(f"seed {seed}: {engine} {stream} differs on {len(wrong)} keys\n{detail}\nhistory:\n{_explain(run, wrong)}")
    errors = {
        engine: Counter((m.value(), headers_of(m)["sow-error"]) for m in outputs[(seed, engine)]["errors"])
        for engine in ("faust", "spark")
    }
    assert errors["faust"] == errors["spark"]
    assert sum(errors["faust"].values()) == run.fold.rejected
