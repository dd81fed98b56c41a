"""Seeded fuzzing of a worker on the real broker: 100,000 generated inputs (random bytes, valid and
broken JSON and Avro, every header with random and hostile values, huge values, deep nesting) on
both input topics, interleaved with good inputs. The worker keeps running, every input is either
applied or on `<topic>.errors` with a reason (counted), and the good inputs' SOW equals the model."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import fastavro
import orjson
import pytest
import yaml
from confluent_kafka import Producer

from processor.contract import headers as H
from processor.testing import WorkerProcess, read_topic, wait_until
from processor.topology import load_topology

pytestmark = pytest.mark.integration

P = 4
N = 100_000
REPO = Path(__file__).resolve().parents[2]

HEADER_NAMES = [H.COMMAND, H.EXPIRATION, H.KEY, H.FILTER, H.KEYS, H.ORIGIN, H.LOCAL, "x-other", ""]
# Header values: hostile ones, and commands. No filter here matches a good record (they have no /a),
# so the good records' SOW stays the model's whatever deletes the fuzz sends.
HOSTILE = [b"", b"\x00\xff\xfe", b"publish", b"delta_publish", b"sow_delete", b"PUBLISH ", b"0", b"-1s", b"200000000000d",
           b"1e309s", b"nan", b"5ms", b"/a = 1", b"/a LIKE '^(a+)+$'", b"/a = = 1", b"((((((((((", b"k1,k2,,", b"," * 5000,
           b"\xc3\x28", "é".encode(), b"9" * 400, b"/a IN (" + b"1," * 3000 + b"1)"]


def junk(rnd: random.Random, avro_schema) -> bytes | None:
    kind = rnd.randrange(10)
    if kind == 0:
        return None
    if kind == 1:
        return rnd.randbytes(rnd.randrange(0, 64))
    if kind == 2:
        return b'{"id": ' + str(rnd.randrange(100)).encode()  # truncated JSON
    if kind == 3:
        return orjson.dumps([1, 2, 3]) if rnd.random() < 0.5 else b'"text"'
    if kind == 4:
        depth = rnd.choice([50, 500, 5000])
        return b'{"id": 1, "n": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"
    if kind == 5:
        return orjson.dumps({"id": rnd.choice([None, {"x": 1}, [1], "", 1.5, True]), "v": 1})
    if kind == 6:
        return orjson.dumps({"no_id": 1})
    if kind == 7:  # a valid Avro record of another schema, or bytes an Avro reader chokes on
        out = io.BytesIO()
        fastavro.schemaless_writer(out, avro_schema, {"order_id": 1, "status": "x", "qty": 1, "px": 1.0, "desk": None, "meta": None})
        return out.getvalue()
    if kind == 8:  # large values, now and then near the message size
        size = 900_000 if rnd.random() < 0.001 else 100_000 if rnd.random() < 0.01 else 10
        return orjson.dumps({"id": 1000 + rnd.randrange(100), "big": "x" * size})
    return orjson.dumps({"id": rnd.randrange(1000, 2000), "v": rnd.random()})  # valid JSON, keyed elsewhere


def test_the_worker_survives_100k_hostile_inputs(kafka_bootstrap, unique_name, tmp_path):
    rnd = random.Random(20261123)
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump({"sow": [{"topic": unique_name, "key": ["/id"], "partitions": P, "expiration": "enabled"}]}))
    spec = load_topology(path).sow[0]
    avro_schema = fastavro.parse_schema(json.loads((REPO / "schemas" / "orders.avsc").read_text()))
    worker = WorkerProcess(kafka_bootstrap, path, f"g-{unique_name}", tmp_path / "d", "fuzz").start()
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 20, "message.max.bytes": 2_000_000,
                         "queue.buffering.max.messages": 500_000, "compression.type": "lz4"})
    model: dict[int, dict] = {}
    try:
        for n in range(N):
            topic = spec.topic if rnd.random() < 0.6 else spec.delta_topic
            if n % 4 == 0:  # a good input: publish or delta publish of one of 200 records, on `<topic>`
                i = rnd.randrange(200)  # (one partition per record: applied in the order sent)
                if rnd.random() < 0.3 and i in model:
                    fields = {"id": i, "v": n}
                    model[i] = {**model[i], **fields}
                    headers = [(H.COMMAND, b"delta_publish")]
                else:
                    fields = model[i] = {"id": i, "v": n, "grp": rnd.choice(["a", "b"])}
                    headers = []
                producer.produce(spec.topic, orjson.dumps(fields), spec.key_spec.sow_key({"id": i}).encode(), headers=headers)
            else:
                headers = [(rnd.choice(HEADER_NAMES), rnd.choice(HOSTILE)) for _ in range(rnd.randrange(0, 4))]
                key = rnd.choice([None, b"", rnd.randbytes(8)])
                producer.produce(topic, junk(rnd, avro_schema), key, headers=headers)
            if n % 5000 == 0:
                producer.poll(0)
        assert producer.flush(120) == 0

        def everything_consumed() -> bool:
            if worker.proc.poll() is not None:
                raise AssertionError(f"the worker stopped:\n{worker.log()[-3000:]}")
            return _committed_inputs(kafka_bootstrap, spec) >= N

        # An input's offset is committed (with its outputs, in one transaction) only once it was
        # applied or parked on `.errors`: all N committed means none was skipped or stuck.
        wait_until(everything_consumed, 600, "every input applied or on .errors", interval=3)
        assert worker.proc.poll() is None, "the worker must still run"
        errors = read_topic(kafka_bootstrap, spec.errors_topic, range(P))
        reasons = [dict(m.headers()).get(H.ERROR) for m in errors]
        assert len(errors) > N // 2 and all(reasons), "the junk is on .errors, each with the reason"
        print(f"fuzz: {N} inputs, {len(errors)} on .errors, {N - len(errors)} applied")
        # The good inputs decide the 200 records; junk that happened to be valid only touched ids >= 1000.
        sow = {}
        for m in read_topic(kafka_bootstrap, spec.sow_topic, range(P)):
            value = None if m.value() is None else orjson.loads(m.value())
            if value is None:
                sow.pop(m.key(), None)
            elif type(value.get("id")) is int and value["id"] < 1000 and set(value) <= {"id", "v", "grp"}:
                sow[m.key()] = value
        assert {v["id"]: v for v in sow.values()} == model
    finally:
        worker.kill()


def _committed_inputs(bootstrap, spec) -> int:
    """Inputs whose offsets the worker's group committed, over both input topics."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g-{spec.topic}", "enable.auto.commit": False})
    try:
        tps = [TopicPartition(t, p) for t in (spec.topic, spec.delta_topic) for p in range(P)]
        return sum(max(tp.offset, 0) for tp in consumer.committed(tps, 30))
    finally:
        consumer.close()
