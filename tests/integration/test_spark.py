"""The Spark pipeline on a real broker: snapshots at instants of a scripted history, replay, SQL.

The history is produced once per module with explicit Kafka timestamps, so every instant's SOW is
known exactly; each snapshot is checked against a hand-written SOW and against the reference fold
(`processor.engine.fold.fold_history`). One SparkSession (local[2]) serves the whole module.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import orjson
import pytest

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'ksow[spark]')")

from processor.contract.types import SowRecord
from processor.core.durations import DurationError, parse_duration_ms  # noqa: E402
from processor.kafka.clients import end_offsets, ensure_topics, make_consumer, make_producer, read_until
from processor.engine.topic import InputMessage
from processor.engine.fold import fold_history
from processor.topology import SowTopic, Topology  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.timeout(300)]

T0 = (int(time.time() * 1000) // 1000 - 600) * 1000  # ten minutes ago: inside any retention


@dataclass
class Scripted:
    spec: SowTopic
    bootstrap: str
    keys: dict[int, str]  # id -> SowKey


def _history(spec: SowTopic):
    """(ms after T0, topic suffix, value, headers) of the scripted history; see the SOWs below."""
    k3 = spec.key_spec.sow_key({"id": 3})
    return [
        (0, "", {"id": 1, "a": 1, "n": {"x": 1, "y": {"p": 1}}, "arr": [1, 2]}, None),
        (0, ".delta", {"id": 1, "n": {"y": {"q": 2}}, "arr": [3]}, None),  # same instant: after the publish
        (1000, "", {"id": 2, "s": "two"}, [("sow-expiration", b"5s")]),  # expires at 6000
        (2000, ".delta", {"id": 1, "n": 5}, None),  # an object replaced by a scalar
        (3000, ".delta", {"id": 1, "n": {"z": 1}}, None),  # and a scalar by an object
        (3000, "", {"id": 3, "s": "three", "tags": ["a"]}, None),
        (4000, "", {"id": 3}, [("sow-command", b"sow_delete")]),  # delete by data
        (4500, ".delta", {"id": 3, "s": "back"}, None),  # a delta on no record becomes the record
        (5000, "", b'{"id": 9, "broken', None),  # rejected: not JSON
        (5000, "", {"other": 1}, None),  # rejected: no key field
        (5000, "", {"id": 9}, [("sow-command", b"bogus")]),  # rejected: unknown command
        (5000, ".delta", {"id": 9}, [("sow-expiration", b"soon")]),  # rejected: bad lifetime
        (7000, ".delta", {"id": 2, "k": 1}, None),  # id 2 expired at 6000: starts anew
        (8000, "", {"id": 4, "v": 1}, [("sow-expiration", b"2s")]),  # expires at 10000...
        (9000, ".delta", {"id": 4, "w": 2}, [("sow-expiration", b"10s")]),  # ...renewed: 19000
        (9500, "", None, [("sow-command", b"sow_delete"), ("sow-keys", k3.encode())]),  # delete by SowKey
        (10000, "", {"id": 5, "nested": {"a": {"b": {"c": 1}}}, "t": "x"}, None),
        (10000, ".delta", {"id": 5, "nested": {"a": {"b": {"d": 2}, "e": []}, "f": {}}}, None),
        (11000, "", {"id": 6, "status": "open"}, [("sow-expiration", b"1s")]),  # expires at 12000
        (12000, "", None, [("sow-command", b"sow_delete"), ("sow-filter", b"/id = 2 OR /status = 'open'")]),
        (13000, ".delta", {"id": 4, "w": 3}, None),  # no header: no lifetime (expiration: enabled)
    ]


EXPECTED = {
    # at 5500: 1 merged, 2 alive until 6000, 3 re-created by its delta
    5500: {
        1: ({"id": 1, "a": 1, "n": {"z": 1}, "arr": [3]}, None),
        2: ({"id": 2, "s": "two"}, 6000),
        3: ({"id": 3, "s": "back"}, None),
    },
    # at 10500: 2 anew from its delta, 3 deleted by SowKey, 4 renewed, 5 merged three levels deep
    10500: {
        1: ({"id": 1, "a": 1, "n": {"z": 1}, "arr": [3]}, None),
        2: ({"id": 2, "k": 1}, None),
        4: ({"id": 4, "v": 1, "w": 2}, 19000),
        5: ({"id": 5, "nested": {"a": {"b": {"c": 1, "d": 2}, "e": []}, "f": {}}, "t": "x"}, None),
    },
    # at 20000: the filter deleted 2 (6 had expired already), 4 lost its lifetime; every key had
    # inputs before the filter delete, so all go through the per-group fallback
    20000: {
        1: ({"id": 1, "a": 1, "n": {"z": 1}, "arr": [3]}, None),
        4: ({"id": 4, "v": 1, "w": 3}, None),
        5: ({"id": 5, "nested": {"a": {"b": {"c": 1, "d": 2}, "e": []}, "f": {}}, "t": "x"}, None),
    },
}


@pytest.fixture(scope="module")
def spark():
    from processor.batch.session import get_spark

    session = get_spark("local[2]", "ksow-tests", {"spark.sql.shuffle.partitions": "2"})
    yield session
    session.stop()


def _create(admin, spec: SowTopic) -> None:
    keep = {"retention.ms": "-1"}
    ensure_topics(admin, {spec.topic: (spec.partitions, keep), spec.delta_topic: (spec.partitions, keep)})


@pytest.fixture(scope="module")
def scripted(kafka_bootstrap, admin, request) -> Scripted:
    name = f"t_spark_{int(time.time() * 1000) % 10**9}"
    spec = SowTopic(timestamps="publisher", topic=name, key=["/id"], expiration="enabled", partitions=2)
    _create(admin, spec)
    producer = make_producer(kafka_bootstrap)
    for at, suffix, value, headers in _history(spec):
        raw = value if value is None or isinstance(value, bytes) else orjson.dumps(value)
        producer.produce(spec.topic + suffix, raw, b"k", headers=headers, timestamp=T0 + at)
    assert producer.flush(30) == 0
    return Scripted(spec, kafka_bootstrap, {i: spec.key_spec.sow_key({"id": i}) for i in range(1, 10)})


def _ends(consumer, topics, partitions: int) -> dict[tuple[str, int], int]:
    """End offsets of the topics' partitions, retried while new topics elect their leaders."""
    return {(t, p): high for t in topics for p, (_, high) in end_offsets(consumer, t, range(partitions)).items()}


def _read_inputs(s: Scripted) -> list[InputMessage]:
    from confluent_kafka import TopicPartition

    consumer = make_consumer(s.bootstrap)
    ends = _ends(consumer, (s.spec.topic, s.spec.delta_topic), 2)
    consumer.assign([TopicPartition(t, p, 0) for t, p in ends])
    out = [InputMessage(m.topic(), m.partition(), m.offset(), m.key(), m.value(), m.headers(), m.timestamp()[1]) for m in read_until(consumer, ends)]
    consumer.close()
    return out


def _as_sow(s: Scripted, expected: dict[int, tuple[dict, int | None]]) -> dict[str, tuple[dict, int | None]]:
    return {s.keys[i]: (record, None if at is None else T0 + at) for i, (record, at) in expected.items()}


@pytest.mark.parametrize("at", sorted(EXPECTED))
def test_snapshot_at_three_instants(spark, scripted, at):
    from processor.batch.snapshot import snapshot

    rows = snapshot(spark, scripted.bootstrap, scripted.spec, T0 + at).collect()
    got = {r["sow_key"]: (orjson.loads(r["record"]), r["expires_at"]) for r in rows}
    assert got == _as_sow(scripted, EXPECTED[at])
    folded = fold_history(scripted.spec, _read_inputs(scripted), T0 + at)
    assert got == {k: (r.data, r.expires_at) for k, r in folded.items()}


def test_replay_from_instant(spark, scripted):
    """The snapshot at --from, then each change with the workers' ops and diffs, in order."""
    from processor.batch.replay import replay

    events = list(replay(spark, scripted.bootstrap, scripted.spec, T0 + 5500, T0 + 12500))
    sow = [e for e in events if e["op"] == "sow"]
    assert {e["sow_key"]: e["record"] for e in sow} == {scripted.keys[i]: r for i, (r, _) in EXPECTED[5500].items()}
    changes = [(e["op"], e["sow_key"], e["at"] - T0) for e in events if e["op"] != "sow"]
    k = scripted.keys
    assert changes == [
        ("expire", k[2], 6000),
        ("insert", k[2], 7000),
        ("insert", k[4], 8000),
        ("update", k[4], 9000),
        ("delete", k[3], 9500),
        ("insert", k[5], 10000),
        ("update", k[5], 10000),
        ("insert", k[6], 11000),
        ("expire", k[6], 12000),
        ("delete", k[2], 12000),
    ]
    update5 = next(e for e in events if e["op"] == "update" and e["sow_key"] == k[5])
    assert update5["diff"] == {"id": 5, "nested": {"a": {"b": {"d": 2}, "e": []}, "f": {}}}
    update4 = next(e for e in events if e["op"] == "update" and e["sow_key"] == k[4])
    assert update4["expires_at"] == T0 + 19000 and update4["record"] == {"id": 4, "v": 1, "w": 2}
    assert {e["seq"] for e in events} == {None}  # the workers' sow-seq is not in the inputs: no made-up IDs


def test_sql_aggregation_over_current_sow(spark, kafka_bootstrap, admin):
    """`ksow sql`: the latest record per key of `<topic>.sow`, tombstones and records past their
    instant (not removed by any worker yet) out, fields as columns."""
    from processor.kafka.clients import topic_configs
    from processor.batch.sql import run_sql

    name = f"t_spark_sql_{int(time.time() * 1000) % 10**9}"
    spec = SowTopic(timestamps="publisher", topic=f"{name}.orders", key=["/order_id"], partitions=2, expiration="enabled")
    ensure_topics(admin, {spec.sow_topic: topic_configs(spec)[spec.sow_topic]})
    producer = make_producer(kafka_bootstrap)

    def put(i: int, record: dict | None, expires_at: int | None = None) -> None:
        headers = [] if expires_at is None else [("sow-expires-at", b"%d" % expires_at)]
        producer.produce(spec.sow_topic, None if record is None else orjson.dumps(record), spec.key_spec.sow_key({"order_id": i}).encode(), headers=headers)

    put(1, {"order_id": 1, "region": "eu", "qty": 10})
    put(2, {"order_id": 2, "region": "eu", "qty": 5})
    put(3, {"order_id": 3, "region": "us", "qty": 7})
    put(1, {"order_id": 1, "region": "eu", "qty": 20})  # a newer version of 1
    put(4, {"order_id": 4, "region": "us", "qty": 100})
    put(4, None)  # 4 left the SOW
    now = int(time.time() * 1000)
    put(5, {"order_id": 5, "region": "us", "qty": 1000}, expires_at=now - 1)  # past its instant
    put(6, {"order_id": 6, "region": "eu", "qty": 1}, expires_at=now + 3_600_000)
    assert producer.flush(30) == 0
    view = spec.topic.replace(".", "_")
    topology = Topology(sow=[spec])
    rows = run_sql(spark, kafka_bootstrap, topology, f"SELECT region, count(*) AS n, sum(qty) AS qty FROM {view} GROUP BY region ORDER BY region").collect()
    assert [r.asDict() for r in rows] == [{"region": "eu", "n": 3, "qty": 26}, {"region": "us", "n": 1, "qty": 7}]


LIFETIME_CASES = ["10s", " 10s ", "500ms", "1.5", "0", "0s", "2m", "1h", "1d", "1.0005s", "0.0005s", "0.0004", "0.4ms", "3x", "", " ", "-1", "1e3", "10 s", "10S", None,
                  "36500d", "3153600000", "99999999d", "36500.5d", "3153600001", "1" + "0" * 400, "5\u00a0s", "\u0665s", "5s\u2028", "5s\n"]  # limit, ASCII only
POLICIES = [
    dict(expiration=None),
    dict(expiration="enabled"),
    dict(expiration="30s"),
    dict(expiration="30s", min_expiration="20s", max_expiration="1m"),
    dict(expiration="enabled", max_expiration="1h"),
    dict(expiration="enabled", min_expiration="1s"),
    dict(expiration=0, max_expiration="1h"),
]


def test_lifetime_expression_agrees_with_the_core(spark):
    """The Spark rendering of sow-expiration parsing + ExpiryPolicy.lifetime_ms equals the core's."""
    from pyspark.sql import functions as F

    from processor.batch.snapshot import lifetime_expr

    df = spark.createDataFrame([(c,) for c in LIFETIME_CASES], "raw string")
    columns = []
    for n, policy in enumerate(POLICIES):
        valid, life = lifetime_expr(SowTopic(timestamps="publisher", topic="t", key=["/id"], **policy), F.col("raw"))
        columns += [valid.alias(f"v{n}"), life.alias(f"l{n}")]
    rows = {r["raw"]: r for r in df.select("raw", *columns).collect()}
    for n, policy in enumerate(POLICIES):
        spec = SowTopic(timestamps="publisher", topic="t", key=["/id"], **policy)
        for raw in LIFETIME_CASES:
            try:
                expected = (True, spec.expiry.lifetime_ms(None if raw is None else parse_duration_ms(raw)))
            except DurationError:
                expected = (False, None)
            row = rows[raw]
            assert (row[f"v{n}"], row[f"l{n}"] if row[f"v{n}"] else None) == expected, (policy, raw)


def _key_value_corpus() -> list[str]:
    """JSON spellings of key values: the cases the text rule names, then random doubles of every
    kind (raw bit patterns, short decimals, all magnitudes) as orjson writes them."""
    import random
    import struct

    fixed = ['5', '5.0', '5e0', '"5"', '-0', '-0.0', '0.1', '0.10', '1e-1', '"0.1"', 'true', '"true"', 'false', '"false"',
             '1.5E-5', '1e22', '1e16', '9.1e15', '0.0001', '0.00001', '-2.5', '8.41E21', '0.30000000000000004', '5e-324',
             '9007199254740993', '9007199254740993.0', '9223372036854775807', '9223372036854775808', '18446744073709551615',
             '18446744073709551616', '-9223372036854775808', '-9223372036854775809', '123456789.123', '"a\\"b"', '"\\u00e9"', '""']
    rnd = random.Random(13)
    drawn = []
    while len(drawn) < 2000:
        kind = rnd.random()
        if kind < 0.3:
            x = struct.unpack("d", struct.pack("Q", rnd.getrandbits(64)))[0]
        elif kind < 0.6:
            x = round(rnd.uniform(-1e6, 1e6), rnd.randint(0, 8))
        else:
            x = rnd.uniform(-10, 10) * 10 ** rnd.randint(-300, 300)
        if x == x and abs(x) != float("inf"):
            drawn.append(orjson.dumps(x).decode())
    return fixed + drawn


def test_key_groups_agree_with_the_core_key_texts(spark):
    """The snapshot job groups inputs by `key_token`s: each must stand for the text the core makes
    the SowKey of (`key_text`), and equal texts must give one group (5, 5.0 and "5" are one record)."""
    from pyspark.sql import functions as F

    from processor.batch.snapshot import key_token
    from processor.core.keys import key_text

    corpus = _key_value_corpus()
    df = spark.createDataFrame([(f'{{"k": {v}}}',) for v in corpus], "t string")
    rows = df.select("t", key_token(F.variant_get(F.expr("parse_json(t)"), "$['k']", "variant")).alias("token")).collect()
    tokens_of: dict[str, set[str]] = {}
    for row in rows:
        text = key_text(orjson.loads(row["t"])["k"])
        assert key_text(orjson.loads(row["token"])) == text, (row["t"], row["token"])
        tokens_of.setdefault(text, set()).add(row["token"])
    assert {text: tokens for text, tokens in tokens_of.items() if len(tokens) > 1} == {}
    assert tokens_of["5"] == {'"5"'} and tokens_of["0.1"] == {'"0.1"'} and tokens_of["true"] == {'"true"'}


def test_snapshot_keys_five_and_string_five_as_one_record(spark, kafka_bootstrap, admin):
    from processor.batch.snapshot import snapshot

    spec = SowTopic(timestamps="publisher", topic=f"t_spark_keys_{int(time.time() * 1000) % 10**9}", key=["/id", "/leg"], partitions=2)
    _create(admin, spec)
    producer = make_producer(kafka_bootstrap)
    for at, value in ((1, {"id": 5, "leg": True, "v": 1}), (2, {"id": "5", "leg": "true", "w": 2}), (3, {"id": 5.0, "leg": "1", "v": 3})):
        producer.produce(spec.topic, orjson.dumps(value), b"k", timestamp=T0 + at)
    producer.produce(spec.delta_topic, orjson.dumps({"id": 5, "leg": True, "x": 4}), b"k", timestamp=T0 + 4)
    assert producer.flush(30) == 0
    rows = {r["sow_key"]: orjson.loads(r["record"]) for r in snapshot(spark, kafka_bootstrap, spec, T0 + 10).collect()}
    assert rows == {
        spec.key_spec.sow_key({"id": 5, "leg": True}): {"id": 5, "leg": True, "w": 2, "x": 4},
        spec.key_spec.sow_key({"id": 5, "leg": "1"}): {"id": 5.0, "leg": "1", "v": 3},
    }


def test_a_merged_record_keeps_its_numbers_as_the_worker_writes_them(spark, kafka_bootstrap, admin):
    """Audit: a record merged in Spark (VARIANT) had its whole floats written as integers (`2.0` as
    `2`, `-0.0` as `0`) and kept digits a double does not: such chains merge with the core's merge.
    Compared as JSON with sorted keys, where 2 and 2.0 differ."""
    from processor.batch.snapshot import snapshot

    spec = SowTopic(timestamps="publisher", topic=f"t_spark_numbers_{int(time.time() * 1000) % 10**9}", key=["/id"], partitions=2)
    _create(admin, spec)
    producer = make_producer(kafka_bootstrap)
    publishes = {1: b'{"id":1,"px":2.0,"z":-0.0,"legs":[1.0,2]}', 2: b'{"id":2,"n":{"q":7.0},"r":1.5}',
                 3: b'{"id":3,"p":0.10000000000000001}', 4: b'{"id":4,"px":1.50,"e":2.0e5}'}
    deltas = {1: b'{"id":1,"qty":3}', 2: b'{"id":2,"n":{"w":1}}', 3: b'{"id":3,"q":1}', 4: b'{"id":4,"px":2.25}'}
    for i, value in publishes.items():
        producer.produce(spec.topic, value, b"k", timestamp=T0 + i)
        producer.produce(spec.delta_topic, deltas[i], b"k", timestamp=T0 + 10 + i)
    assert producer.flush(30) == 0
    canonical = lambda record: orjson.dumps(record, option=orjson.OPT_SORT_KEYS)  # noqa: E731
    got = {r["sow_key"]: canonical(orjson.loads(r["record"])) for r in snapshot(spark, kafka_bootstrap, spec, T0 + 100).collect()}
    messages = [InputMessage(t, 0, i, None, v, None, T0 + at + i) for i in publishes for t, v, at in ((spec.topic, publishes[i], 0), (spec.delta_topic, deltas[i], 10))]
    folded = {k: canonical(r.data) for k, r in fold_history(spec, messages, T0 + 100).items()}
    assert got == folded
    assert orjson.loads(got[spec.key_spec.sow_key({"id": 1})]) == {"id": 1, "legs": [1.0, 2], "px": 2.0, "qty": 3, "z": -0.0}
    assert b'"px":2.0' in got[spec.key_spec.sow_key({"id": 1})] and b'"q":7.0' in got[spec.key_spec.sow_key({"id": 2})]


def test_cli_snapshot_json_lines_and_parquet(spark, scripted, tmp_path):
    """`ksow snapshot` (in-process, on the module's SparkSession): --filter, JSON lines, --out."""
    from click.testing import CliRunner

    from processor.cli.spark import main

    topo = tmp_path / "topo.yaml"
    topo.write_text(json.dumps({"sow": [{"topic": scripted.spec.topic, "timestamps": "publisher", "key": ["/id"], "expiration": "enabled", "partitions": 2}]}))
    common = ["--bootstrap", scripted.bootstrap, "--topology", str(topo), "--master", "local[2]"]
    result = CliRunner().invoke(main, ["snapshot", scripted.spec.topic, "--as-of", str(T0 + 10500), "--filter", "/id >= 4", *common])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    want = _as_sow(scripted, EXPECTED[10500])
    assert {x["sow_key"]: (x["record"], x["expires_at"]) for x in lines} == {scripted.keys[i]: want[scripted.keys[i]] for i in (4, 5)}

    out = tmp_path / "sow.parquet"
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime((T0 + 20000) / 1000)) + "Z"
    result = CliRunner().invoke(main, ["snapshot", scripted.spec.topic, "--as-of", iso, "--out", str(out), *common])
    assert result.exit_code == 0, result.output
    import pyarrow.parquet as pq

    table = pq.read_table(out).to_pylist()
    assert {r["sow_key"]: (orjson.loads(r["record"]), r["expires_at"]) for r in table} == _as_sow(scripted, EXPECTED[20000])


def _cli(topo_path, spec: SowTopic, bootstrap: str, *args: str):
    from click.testing import CliRunner

    from processor.cli.spark import main

    topo_path.write_text(json.dumps({"sow": [{"topic": spec.topic, "timestamps": "publisher", "key": spec.key, "expiration": "enabled", "partitions": spec.partitions}]}))
    return CliRunner().invoke(main, [*args, "--bootstrap", bootstrap, "--topology", str(topo_path), "--master", "local[2]"])


def test_rejected_inputs_change_nothing_in_snapshot_and_replay(spark, kafka_bootstrap, admin, tmp_path):
    """Inputs the worker rejects (that Spark's JSON parser or the lifetime expression would take)
    are left out of the snapshot, `--filter` and `replay` included: no crash, no raw bad text."""
    spec = SowTopic(timestamps="publisher", topic=f"t_spark_rej_{int(time.time() * 1000) % 10**9}", key=["/order_id"], expiration="enabled", partitions=2)
    _create(admin, spec)
    deep = b'{"order_id": 2, "n": ' + b'{"n": ' * 299 + b"1" + b"}" * 300  # 300 levels
    inputs = [
        ("", b'{"order_id": 1, "v": 1}', None),
        ("", b'{"order_id": 1e400}', None),
        ("", b'{"order_id": 129}  trailing', None),
        ("", deep, None),
        ("", b'{"order_id": 3, "big": 123456789012345678901234567890}', None),
        ("", b'{"order_id": 123456789012345678901234567890}', None),
        (".delta", b'{"order_id": 1, "v": 1e400}', None),
        *(("", b'{"order_id": 4}', [("sow-expiration", e)]) for e in (b"99999999d", b"36500.5d", b"3153600001")),
        ("", b'{"order_id": 5}', [("sow-expiration", b"36500d")]),  # the limit itself is fine
    ]
    producer = make_producer(kafka_bootstrap)
    for n, (suffix, value, headers) in enumerate(inputs):
        producer.produce(spec.topic + suffix, value, b"k", headers=headers, timestamp=T0 + n)
    producer.produce(spec.delta_topic, b'{"order_id": 1, "w": 2}', b"k", timestamp=T0 + 100)
    assert producer.flush(30) == 0
    k1, k5 = spec.key_spec.sow_key({"order_id": 1}), spec.key_spec.sow_key({"order_id": 5})
    want = {k1: {"order_id": 1, "v": 1}, k5: {"order_id": 5}}

    result = _cli(tmp_path / "topo.yaml", spec, kafka_bootstrap, "snapshot", spec.topic, "--as-of", str(T0 + 50), "--filter", "/order_id > 0")
    assert result.exit_code == 0, result.output
    assert {x["sow_key"]: x["record"] for x in map(json.loads, result.stdout.splitlines())} == want

    result = _cli(tmp_path / "topo.yaml", spec, kafka_bootstrap, "replay", spec.topic, "--from", str(T0 + 50))
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(e["op"], e["sow_key"], e["seq"]) for e in events if e["op"] != "sow"] == [("update", k1, None)]
    assert {e["sow_key"]: e["record"] for e in events if e["op"] == "sow"} == want


def test_cli_sql_syntax_error_says_what_is_wrong(spark, kafka_bootstrap, admin, tmp_path):
    from processor.kafka.clients import topic_configs

    spec = SowTopic(timestamps="publisher", topic=f"t_spark_sqlerr_{int(time.time() * 1000) % 10**9}", key=["/id"], partitions=2, expiration="enabled")
    ensure_topics(admin, {spec.sow_topic: topic_configs(spec)[spec.sow_topic]})
    result = _cli(tmp_path / "topo.yaml", spec, kafka_bootstrap, "sql", f"SELEC * FROM {spec.topic}")
    assert result.exit_code == 1
    assert "Error: [PARSE_SYNTAX_ERROR] Syntax error at or near 'SELEC'" in result.output, result.output


def test_fold_history_is_order_independent(scripted):
    """The reference fold sorts its input: any arrival order gives the same SOW."""
    messages = _read_inputs(scripted)
    forward = fold_history(scripted.spec, messages, T0 + 20000)
    backward = fold_history(scripted.spec, list(reversed(messages)), T0 + 20000)
    assert forward == backward
    assert all(isinstance(r, SowRecord) for r in forward.values())


def test_snapshot_and_replay_keep_a_partitions_offset_order_when_its_timestamps_go_back(spark, kafka_bootstrap, admin):
    """Audit: the batch paths sorted inputs by raw timestamp, a worker by its partition's time (the
    largest timestamp so far): a publish sent after another but stamped earlier by a publisher whose
    clock is behind was applied first by a snapshot, and lost to the older one."""
    from processor.batch.replay import replay
    from processor.batch.snapshot import broker_stamped, snapshot
    from processor.kafka.clients import topic_configs

    name = f"t_spark_back_{int(time.time() * 1000) % 10**9}"
    spec = SowTopic(timestamps="publisher", topic=name, key=["/id"], expiration="enabled", partitions=2)
    _create(admin, spec)  # the broker's default: CreateTime
    assert not broker_stamped(kafka_bootstrap, spec)
    arrival = SowTopic(topic=f"{name}_arrival", key=["/id"], partitions=2)  # `timestamps: arrival`: LogAppendTime, no window
    ensure_topics(admin, {t: c for t, c in topic_configs(arrival).items() if t in (arrival.topic, arrival.delta_topic)})
    assert broker_stamped(kafka_bootstrap, arrival)
    producer = make_producer(kafka_bootstrap)
    for at, suffix, value, headers in [
        (1000, "", {"id": 1, "v": "a"}, None),
        (900, "", {"id": 1, "v": "b"}, None),  # sent after "a" by a publisher whose clock is behind
        (950, ".delta", {"id": 1, "w": 1}, None),  # before "a" in a worker's order
        (2000, "", {"id": 2, "x": 1}, [("sow-expiration", b"1s")]),  # due at 3000
        (4000, "", {"id": 3}, None),
        (2500, "", {"id": 2, "y": 1}, [("sow-command", b"delta_publish")]),  # sorts at 4000: 2 is gone, it starts anew
    ]:
        producer.produce(spec.topic + suffix, orjson.dumps(value), b"k", headers=headers, timestamp=T0 + at)
    assert producer.flush(30) == 0
    scripted = Scripted(spec, kafka_bootstrap, {i: spec.key_spec.sow_key({"id": i}) for i in (1, 2, 3)})
    for at, expected in [(999, {1: ({"id": 1, "w": 1}, None)}),
                         (5000, {1: ({"id": 1, "v": "b"}, None), 2: ({"id": 2, "y": 1}, None), 3: ({"id": 3}, None)})]:
        got = {r["sow_key"]: (orjson.loads(r["record"]), r["expires_at"]) for r in snapshot(spark, kafka_bootstrap, spec, T0 + at).collect()}
        assert got == _as_sow(scripted, expected), at
        assert got == {k: (r.data, r.expires_at) for k, r in fold_history(spec, _read_inputs(scripted), T0 + at).items()}
    k = scripted.keys
    events = list(replay(spark, kafka_bootstrap, spec, T0 + 999, T0 + 5000))
    assert [(e["op"], e["sow_key"]) for e in events] == [
        ("sow", k[1]), ("update", k[1]), ("update", k[1]), ("insert", k[2]), ("expire", k[2]), ("insert", k[3]), ("insert", k[2])]
    assert events[2]["record"] == {"id": 1, "v": "b"} and events[-1]["record"] == {"id": 2, "y": 1}


def _row(spec: SowTopic, at: int, value: dict | bytes | None, delta: bool = False, headers=None, offset: int = 0):
    from pyspark.sql import Row

    raw = value if value is None or isinstance(value, bytes) else orjson.dumps(value)
    topic = spec.delta_topic if delta else spec.topic
    return Row(ts=at, rank=int(delta), partition=0, offset=offset, topic=topic, kafka_key=b"k", value=raw, headers=[Row(key=k, value=v) for k, v in headers or []], reason=None)


def test_streaming_processor_keeps_capacity_and_views():
    """The same partition engine as the Faust worker, so the streaming engine evicts by capacity and
    maintains views (no JVM: TwsTester)."""
    from pyspark.sql.streaming.tws_tester import TwsTester

    from processor.runners.spark.stream import make_processor
    from processor.topology import View

    spec = SowTopic(timestamps="publisher", topic="cv", key=["/id"], partitions=1, capacity=2)
    view = View(name="cv_big", topic="cv", filter="/qty > 10")
    tester = TwsTester(make_processor(spec, [view])(), timeMode="ProcessingTime", outputMode="Update")
    tester.setProcessingTime(1_000)
    out = tester.test("0", [_row(spec, 900 + i, {"id": i, "qty": 5 * i}, offset=i) for i in range(4)])
    assert [orjson.loads(r["value"])["id"] for r in out if r["topic"] == "cv.dead"] == [0, 1]  # least recently updated first
    assert [orjson.loads(r["value"]) for r in out if r["topic"] == "cv_big.sow"] == [{"id": 3, "qty": 15}]
    assert all(r["partition"] == 0 for r in out if r["topic"] != "cv.errors")


def test_the_streaming_engine_refuses_by_name_what_it_cannot_do():
    from processor.contract.errors import UnsupportedByEngine
    from processor.runners.spark.stream import check_topology
    from processor.topology import Topology, View

    spec = SowTopic(topic="cv", key=["/id"], partitions=1)
    with pytest.raises(UnsupportedByEngine, match=r"views\[slow\]\.conflation"):
        check_topology(Topology(sow=[spec], views=[View(name="slow", topic="cv", conflation="250ms")]))
    with pytest.raises(UnsupportedByEngine, match=r"sow\[cv\]\.persistence"):
        check_topology(Topology(sow=[SowTopic(topic="cv", key=["/id"], partitions=1, persistence="simple")]))
    check_topology(Topology(sow=[SowTopic(topic="cv", key=["/id"], partitions=1, capacity=2)], views=[View(name="v", topic="cv")]))


def test_stateful_processor_with_tws_tester():
    """The streaming runner's StatefulProcessor (no JVM): merge, diff, lifetimes, timer expiry, and
    deletes by filter that see the records of their own micro-batch."""
    from pyspark.sql.streaming.tws_tester import TwsTester

    from processor.core.keys import owner_partition
    from processor.runners.spark.stream import Router, make_processor

    spec = SowTopic(timestamps="publisher", topic="orders", key=["/id"], expiration="enabled", partitions=4)
    key = spec.key_spec.sow_key({"id": 1})
    group = str(owner_partition(key, 4))
    assert Router(spec)(spec.topic, orjson.dumps({"id": 1}), []) == [(group, None)]
    assert [g for g, _ in Router(spec)(spec.topic, None, [{"key": "sow-command", "value": b"sow_delete"}, {"key": "sow-filter", "value": b"1=1"}])] == ["0", "1", "2", "3"]
    tester = TwsTester(make_processor(spec)(), timeMode="ProcessingTime", outputMode="Update")
    tester.setProcessingTime(1_000)
    out = tester.test(group, [
        _row(spec, 900, {"id": 1, "n": {"x": 1}}, headers=[("sow-expiration", b"5s")], offset=0),
        _row(spec, 950, {"id": 1, "n": {"y": 2}}, delta=True, headers=[("sow-expiration", b"5s")], offset=1),
    ])
    by_topic = [(r["topic"], dict((h["key"], h["value"]) for h in r["headers"])["sow-op"], orjson.loads(r["value"])) for r in out]
    assert by_topic == [
        ("orders.sow", b"insert", {"id": 1, "n": {"x": 1}}),
        ("orders.diff", b"insert", {"id": 1, "n": {"x": 1}}),
        ("orders.sow", b"update", {"id": 1, "n": {"x": 1, "y": 2}}),
        ("orders.diff", b"update", {"id": 1, "n": {"y": 2}}),
    ]
    seqs = [int(dict((h["key"], h["value"]) for h in r["headers"])["sow-seq"]) for r in out[::2]]
    assert seqs[0] < seqs[1] and all(s & 1023 == int(group) for s in seqs)  # the worker's layout
    assert tester.peekMapState("records", group)[(key,)][2] == 5_950  # the lifetime counts from the input's timestamp
    assert tester.setProcessingTime(5_000) == []
    fired = tester.setProcessingTime(6_000)
    assert [(r["topic"], r["value"]) for r in fired] == [("orders.sow", None), ("orders.diff", b'{"id":1,"n":{"x":1,"y":2}}'), ("EXP.orders", b'{"id":1,"n":{"x":1,"y":2}}')]
    assert tester.peekMapState("records", group) == {}

    # A publish and a delete by filter in one micro-batch: the delete sees the new record.
    out = tester.test(group, [
        _row(spec, 7_000, {"id": 1, "s": "x"}, offset=2),
        _row(spec, 7_001, None, headers=[("sow-command", b"sow_delete"), ("sow-filter", b"/s = 'x'")], offset=3),
    ])
    assert [dict((h["key"], h["value"]) for h in r["headers"])["sow-op"] for r in out if r["topic"] == "orders.sow"] == [b"insert", b"delete"]


def test_the_streaming_processor_judges_an_input_at_its_sort_time_as_the_worker_does():
    """Record 2 lives until 3000. A delta on it stamped 2500 comes after an input stamped 4000 in its
    input partition, so it sorts at 4000: the record has expired by then, and the delta starts a new
    record (test_fold_order has the fold and the worker do the same). Judged at its own timestamp,
    the delta would merge into the live record."""
    from pyspark.sql.streaming.tws_tester import TwsTester

    from processor.runners.spark.stream import make_processor

    spec = SowTopic(timestamps="publisher", topic="late", key=["/id"], expiration="enabled", partitions=1)
    tester = TwsTester(make_processor(spec)(), timeMode="ProcessingTime", outputMode="Update")
    tester.setProcessingTime(5_000)
    out = tester.test("0", [
        _row(spec, 2_000, {"id": 2, "x": 1}, headers=[("sow-expiration", b"1s")], offset=0),
        _row(spec, 4_000, {"id": 3}, offset=1),
        _row(spec, 2_500, {"id": 2, "y": 1}, headers=[("sow-command", b"delta_publish")], offset=2),
    ])
    told = [(r["topic"], dict((h["key"], h["value"]) for h in r["headers"])["sow-op"], orjson.loads(r["value"] or b"null")) for r in out]
    assert ("EXP.late", b"expire", {"id": 2, "x": 1}) in told
    assert told[-2:] == [("late.sow", b"insert", {"id": 2, "y": 1}), ("late.diff", b"insert", {"id": 2, "y": 1})]


def _read_all(bootstrap: str, topic: str, partitions: int) -> list:
    from confluent_kafka import TopicPartition

    consumer = make_consumer(bootstrap)
    ends = _ends(consumer, (topic,), partitions)
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    out = list(read_until(consumer, ends))
    consumer.close()
    return out


def test_streaming_runner_maintains_the_sow(spark, kafka_bootstrap, tmp_path):
    """`run_stream`: inputs in, `.sow`/`.diff`/`EXP.`/`.errors` out, a delete by filter fanned out."""
    from processor.client.sow_client import Client
    from processor.runners.spark.stream import run_stream

    name = f"t_spark_stream_{int(time.time() * 1000) % 10**9}"
    spec = SowTopic(timestamps="publisher", topic=name, key=["/id"], expiration="enabled", partitions=2)
    topology = Topology(sow=[spec])
    _, queries = run_stream(kafka_bootstrap, topology, tmp_path / "ckpt", block=False, trigger="500 milliseconds")
    try:
        client = Client(kafka_bootstrap, topology)
        client.publish(name, {"id": 1, "a": 1, "n": {"x": 1}})
        client.publish(name, {"id": 1, "n": {"y": 2}}, delta=True)
        client.publish(name, {"id": 2, "s": "gone soon"}, expiration="1s")
        client.publish(name, {"id": 3, "s": "x"})
        client.producer.produce(name, b'{"broken', b"k")
        client.flush()
        k = {i: spec.key_spec.sow_key({"id": i}) for i in (1, 2, 3)}
        want = {k[1]: {"id": 1, "a": 1, "n": {"x": 1, "y": 2}}, k[3]: {"id": 3, "s": "x"}}
        deadline = time.monotonic() + 120
        while {e.sow_key: e.record for e in client.query(name)} != want:
            assert all(q.isActive for q in queries), queries[0].exception()
            assert time.monotonic() < deadline, {e.sow_key: e.record for e in client.query(name)}
            time.sleep(1)
        client.delete(name, filter="/s = 'x'")
        client.flush()
        while {e.sow_key for e in client.query(name)} != {k[1]}:
            assert time.monotonic() < deadline, "the delete by filter was not applied"
            time.sleep(1)
    finally:
        for q in queries:
            q.stop()
    expired = _read_all(kafka_bootstrap, spec.expired_topic, 2)
    assert [orjson.loads(m.value()) for m in expired] == [{"id": 2, "s": "gone soon"}]
    errors = _read_all(kafka_bootstrap, spec.errors_topic, 2)
    assert [m.value() for m in errors] == [b'{"broken'] and dict(errors[0].headers())["sow-error"].startswith(b"value is not valid JSON")
    ops = sorted(dict(m.headers())["sow-op"].decode() for m in _read_all(kafka_bootstrap, spec.diff_topic, 2))
    assert ops == ["delete", "expire", "insert", "insert", "insert", "update"]


def _latest(messages) -> dict[str, tuple[dict, int | None]]:
    """`<topic>.sow` as a SOW: latest per key, tombstones removed, with sow-expires-at."""
    latest: dict[str, tuple[dict, int | None] | None] = {}
    for m in messages:
        h = dict(m.headers() or ())
        latest[m.key().decode()] = None if m.value() is None else (orjson.loads(m.value()), int(h["sow-expires-at"]) if "sow-expires-at" in h else None)
    return {k: v for k, v in latest.items() if v is not None}


def _wait_sow(bootstrap: str, spec: SowTopic, want: dict, queries, timeout: float = 180, also: str | None = None) -> dict:
    """Until `<topic>.sow` holds `want` (plus `also`, a record that may expire meanwhile, when it was
    written at least once)."""
    deadline = time.monotonic() + timeout
    while True:
        messages = _read_all(bootstrap, spec.sow_topic, spec.partitions)
        got = {k: r for k, (r, _) in _latest(messages).items() if k != also}
        if got == want and (also is None or any(m.key().decode() == also for m in messages)):
            return got
        assert all(q.isActive for q in queries), [q.exception() for q in queries]
        assert time.monotonic() < deadline, got
        time.sleep(1)


def _wait_committed(bootstrap: str, spec: SowTopic, queries, timeout: float = 120) -> None:
    """Until every query has committed a micro-batch that read its inputs to their current ends. A
    micro-batch writes to Kafka before Spark commits it (its offsets and state in the checkpoint),
    and a progress report follows that commit, so a stop after it cannot make the restart run those
    inputs again. (`processAllAvailable` would wait for ever: processing-time timers make Spark run
    a micro-batch at every trigger, so it never sees the query idle.)"""
    consumer = make_consumer(bootstrap)
    ends = {t: {str(p): high for (_, p), high in _ends(consumer, (t,), spec.partitions).items()} for t in (spec.topic, spec.delta_topic)}
    consumer.close()
    deadline = time.monotonic() + timeout
    for q in queries:
        while not ((last := q.lastProgress) is not None and [json.loads(s.endOffset) for s in last.sources] == [ends]):
            assert q.isActive, q.exception()
            assert time.monotonic() < deadline, (ends, last and [s.endOffset for s in last.sources])
            time.sleep(0.2)


def test_streaming_runner_survives_stop_and_restart(spark, kafka_bootstrap, tmp_path):
    """Stop the queries, publish more while they are down, restart from the same checkpoint: the
    deltas merge into the state from before the stop, the deletes (by data, SowKeys and filter)
    find their records, a lifetime that ran out during the downtime expires, and no input is
    applied twice. Spark's `stop()` interrupts the micro-batch under way: one whose outputs are in
    Kafka but which is not yet committed runs again after the restart (at least once), so the test
    stops once the inputs are committed (`_wait_committed`)."""
    from processor.client.sow_client import Client
    from processor.runners.spark.stream import run_stream, stop_queries

    name = f"t_spark_restart_{int(time.time() * 1000) % 10**9}"
    spec = SowTopic(timestamps="publisher", topic=name, key=["/id"], expiration="enabled", partitions=2)
    topology = Topology(sow=[spec])
    checkpoint = tmp_path / "ckpt"
    k = {i: spec.key_spec.sow_key({"id": i}) for i in range(1, 8)}
    client = Client(kafka_bootstrap, topology)

    _, queries = run_stream(kafka_bootstrap, topology, checkpoint, block=False, trigger="500 milliseconds")
    try:
        client.publish(name, {"id": 1, "a": 1, "n": {"x": 1}})
        client.publish(name, {"id": 2, "s": "two"})
        client.publish(name, {"id": 3, "s": "three"}, expiration="1h")
        client.publish(name, {"id": 4, "s": "four"})
        client.publish(name, {"id": 7, "s": "short"}, expiration="20s")
        client.flush()
        client.publish(name, {"id": 1, "n": {"y": 2}}, delta=True)
        client.flush()
        published_7 = time.monotonic()
        before = {k[1]: {"id": 1, "a": 1, "n": {"x": 1, "y": 2}}, k[2]: {"id": 2, "s": "two"}, k[3]: {"id": 3, "s": "three"}, k[4]: {"id": 4, "s": "four"}}
        _wait_sow(kafka_bootstrap, spec, before, queries, also=k[7])
        _wait_committed(kafka_bootstrap, spec, queries)
    finally:
        stop_queries(queries)
    assert not any(q.isActive for q in queries)

    # While stopped: deltas on keys that exist, deletes of every kind, a new record.
    client.publish(name, {"id": 1, "n": {"z": 3}, "b": True}, delta=True)
    client.publish(name, {"id": 3, "t": 1}, delta=True)  # no lifetime header: the update clears it
    client.delete(name, filter="/s = 'two'")
    client.delete(name, keys=[k[4]])
    client.publish(name, {"id": 5, "s": "five"})
    client.publish(name, {"id": 6, "s": "six"})
    client.delete(name, data={"id": 6})
    client.flush()
    time.sleep(max(0.0, 20.5 - (time.monotonic() - published_7)))  # 7's lifetime runs out while stopped

    _, queries = run_stream(kafka_bootstrap, topology, checkpoint, block=False, trigger="500 milliseconds")
    final = {k[1]: {"id": 1, "a": 1, "n": {"x": 1, "y": 2, "z": 3}, "b": True}, k[3]: {"id": 3, "s": "three", "t": 1}, k[5]: {"id": 5, "s": "five"}}
    try:
        _wait_sow(kafka_bootstrap, spec, final, queries)
        time.sleep(2)  # a repeated micro-batch would show up on .diff below
    finally:
        for q in queries:
            q.stop()

    assert all(at is None for _, at in _latest(_read_all(kafka_bootstrap, spec.sow_topic, 2)).values())
    diffs: dict[str, list] = {}
    for m in _read_all(kafka_bootstrap, spec.diff_topic, 2):
        h = dict(m.headers())
        diffs.setdefault(m.key().decode(), []).append((h["sow-op"].decode(), orjson.loads(m.value()), int(h["sow-seq"])))
    ops = {i: [op for op, _, _ in diffs[k[i]]] for i in k}
    assert ops == {
        1: ["insert", "update", "update"],
        2: ["insert", "delete"],
        3: ["insert", "update"],
        4: ["insert", "delete"],
        5: ["insert"],
        6: ["insert", "delete"],
        7: ["insert", "expire"],
    }
    assert diffs[k[1]][2][1] == {"id": 1, "n": {"z": 3}, "b": True}  # the diff against the state from before the stop
    assert diffs[k[3]][1][1] == {"id": 3, "t": 1}
    for events in diffs.values():
        seqs = [seq for _, _, seq in events]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)  # event IDs go on increasing after the restart
    assert [orjson.loads(m.value()) for m in _read_all(kafka_bootstrap, spec.expired_topic, 2)] == [{"id": 7, "s": "short"}]
    folded = fold_history(spec, _read_inputs(Scripted(spec, kafka_bootstrap, {})), int(time.time() * 1000))
    assert {key: r.data for key, r in folded.items()} == final


def test_ksow_up_engine_spark_end_to_end(kafka_bootstrap, tmp_path):
    """`ksow up --engine spark` as a process: publish with `ksow publish`, read `<topic>.sow`, stop
    with SIGTERM (a clean stop, exit status 0)."""
    import os
    import signal
    import subprocess
    import sys

    name = f"t_spark_cli_{int(time.time() * 1000) % 10**9}"
    spec = SowTopic(timestamps="publisher", topic=name, key=["/id"], partitions=2)
    topo = tmp_path / "topo.yaml"
    topo.write_text(json.dumps({"sow": [{"topic": name, "timestamps": "publisher", "key": ["/id"], "partitions": 2}]}))
    log_path = tmp_path / "up.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KSOW_SPARK_DRIVER_MEMORY": "1g"}
    common = ["--bootstrap", kafka_bootstrap, "--topology", str(topo)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "processor.cli", "up", "--engine", "spark", *common, "--master", "local[1]",
             "--checkpoint-dir", str(tmp_path / "ckpt"), "--trigger", "500 milliseconds"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    try:
        deadline = time.monotonic() + 120
        while b"running 1 streaming queries" not in log_path.read_bytes():
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        lines = '{"id": 1, "s": "a", "n": {"x": 1}}\n{"id": 2, "s": "b"}\n'
        subprocess.run([sys.executable, "-m", "processor.cli", "publish", name, "-", *common], input=lines.encode(), check=True, env=env)
        subprocess.run([sys.executable, "-m", "processor.cli", "publish", name, "--delta", '{"id": 1, "n": {"y": 2}}', *common], check=True, env=env)
        k1, k2 = (spec.key_spec.sow_key({"id": i}) for i in (1, 2))
        want = {k1: {"id": 1, "s": "a", "n": {"x": 1, "y": 2}}, k2: {"id": 2, "s": "b"}}
        while {key: r for key, (r, _) in _latest(_read_all(kafka_bootstrap, spec.sow_topic, 2)).items()} != want:
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
            time.sleep(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, log_path.read_text(errors="replace")[-3000:]
    assert "Traceback" not in log_path.read_text(errors="replace")


def test_stateful_processor_on_an_avro_topic():
    """Avro records through the StatefulProcessor (no JVM): the schema path is relative to the
    topology's base folder, as for the Faust worker; a null in an Avro delta means "not sent"."""
    import io
    from pathlib import Path

    import fastavro
    from pyspark.sql.streaming.tws_tester import TwsTester

    from processor.core.codec import AvroCodec
    from processor.core.keys import owner_partition
    from processor.runners.spark.stream import Router, make_processor

    repo = Path(__file__).resolve().parents[2]
    spec = SowTopic(timestamps="publisher", topic="ao", key=["/order_id"], message_type="avro", schema="schemas/orders.avsc", partitions=2)
    parsed = fastavro.parse_schema(orjson.loads((repo / "schemas" / "orders.avsc").read_bytes()))

    def avro(record: dict) -> bytes:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, parsed, record)
        return out.getvalue()

    full = {"order_id": 7, "customer": "ann", "status": "open", "qty": 5, "px": 1.5}
    delta = {"order_id": 7, "customer": None, "status": "filled", "qty": None, "px": None}
    group = str(owner_partition(spec.key_spec.sow_key(full), 2))
    assert Router(spec, repo)(spec.topic, avro(full), []) == [(group, None)]
    tester = TwsTester(make_processor(spec, base=repo)(), timeMode="ProcessingTime", outputMode="Update")
    tester.setProcessingTime(1_000)
    out = tester.test(group, [_row(spec, 900, avro(full), offset=0), _row(spec, 950, avro(delta), delta=True, offset=1)])
    sow = [r["value"] for r in out if r["topic"] == "ao.sow"]
    assert AvroCodec(repo / "schemas" / "orders.avsc").decode(sow[-1]) == {**full, "status": "filled"}
    assert [orjson.loads(r["value"]) for r in out if r["topic"] == "ao.diff"][-1] == {"order_id": 7, "status": "filled"}
