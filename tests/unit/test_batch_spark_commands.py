"""The Spark commands' pure parts, without a JVM: which inputs the snapshot job lets through (the
worker's rules), replay's event IDs, and the CLI's errors and JSON lines."""

from __future__ import annotations

import orjson
import pytest
from click.testing import CliRunner

from processor.batch.replay import event
from processor.batch.snapshot import accepted
from processor.cli.spark import _print_parquet, error_message, main
from processor.contract.types import Op, SowRecord
from processor.core.sow import Transition
from processor.topology import SowTopic

SPEC = SowTopic(timestamps="publisher", topic="orders", key=["/order_id"], expiration="enabled", partitions=2)


def _nested(levels: int) -> bytes:
    """An object whose objects nest `levels` deep (the record itself is level 1)."""
    return b'{"order_id": 2, "n": ' + b'{"n": ' * (levels - 1) + b"1" + b"}" * levels


def _expiring(value: bytes) -> list[dict]:
    return [{"key": "sow-expiration", "value": value}]


@pytest.mark.parametrize(
    "value, headers, ok",
    [
        (b'{"order_id": 1}', None, True),
        (b'{"order_id": 1e400}', None, False),  # Spark's parser reads Infinity
        (b'{"order_id": 129}  trailing', None, False),  # Spark's parser stops after the object
        (_nested(200), None, True),
        (_nested(201), None, False),  # past MAX_NESTING
        (b'{"order_id": 3, "big": 123456789012345678901234567890}', None, False),  # past 64 bits
        (b'{"order_id": 123456789012345678901234567890}', None, False),  # a key past 64 bits
        (b'{"order_id": 4}', _expiring(b"36500d"), True),
        (b'{"order_id": 4}', _expiring(b"99999999d"), False),  # over the 36500d limit
        (b'{"order_id": 4}', _expiring(b"36500.5d"), False),
        (b'{"order_id": 4}', _expiring(b"3153600001"), False),
        (b'{"order_id": 4}', _expiring("5\u00a0s".encode()), False),  # ASCII whitespace only
    ],
)
def test_accepted_is_the_workers_check(value, headers, ok):
    assert accepted(SPEC, [SPEC.topic], [value], [headers]) == [ok]


def test_replay_events_carry_no_made_up_event_ids():
    """The fold's counter is not the workers' sow-seq: replay says null rather than a wrong ID."""
    before, after = SowRecord({"order_id": 1, "v": 1}, 7), SowRecord({"order_id": 1, "v": 2}, 8)
    out = event(Transition(Op.UPDATE, "k", 8, before, after, {"order_id": 1, "v": 2}, 1000))
    assert out["seq"] is None and out["record"] == {"order_id": 1, "v": 2}


def test_replay_to_before_from_is_an_error_naming_both():
    result = CliRunner().invoke(main, ["replay", "orders", "--from", "2000", "--to", "1000"], env={"KAFKA_BOOTSTRAP": "127.0.0.1:1"})
    assert result.exit_code == 1
    assert "--to 1000" in result.output and "--from 2000" in result.output


def test_spark_error_message_is_its_first_useful_line():
    text = "\n[PARSE_SYNTAX_ERROR] Syntax error at or near 'SELEC'. SQLSTATE: 42601 (line 1, pos 0)\n\n== SQL ==\nSELEC * FROM t\n^^^\n"
    assert error_message(Exception(text)) == "[PARSE_SYNTAX_ERROR] Syntax error at or near 'SELEC'. SQLSTATE: 42601 (line 1, pos 0)"
    assert error_message(RuntimeError("")) == "RuntimeError"


def test_snapshot_json_lines_stay_one_line_per_record(tmp_path, capsysbinary):
    """A record published pretty-printed is valid, but its text must not break the JSON lines."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"sow_key": "1", "record": '{\n  "order_id": 1\n}', "expires_at": None, "updated_at": 5}, {"sow_key": "2", "record": '{"order_id": 2}', "expires_at": 9, "updated_at": 6}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "sow.parquet")
    _print_parquet(str(tmp_path / "sow.parquet"))
    lines = capsysbinary.readouterr().out.splitlines()
    assert [orjson.loads(line) for line in lines] == [
        {"sow_key": "1", "expires_at": None, "updated_at": 5, "record": {"order_id": 1}},
        {"sow_key": "2", "expires_at": 9, "updated_at": 6, "record": {"order_id": 2}},
    ]
    assert lines[1].endswith(b'"record":{"order_id": 2}}')  # one-write records as published


def test_a_snapshot_refuses_the_topics_whose_sow_it_cannot_rebuild():
    """Audit: a snapshot of a topic with a capacity held every record (the worker had evicted or
    refused some), and one of a transient topic held records the worker never kept."""
    from processor.batch.snapshot import SnapshotError, check_batch_topic

    check_batch_topic(SPEC)
    with pytest.raises(SnapshotError, match="has a capacity"):
        check_batch_topic(SowTopic(topic="c", key=["/id"], capacity=10, partitions=2))
    with pytest.raises(SnapshotError, match="is transient"):
        check_batch_topic(SowTopic(topic="t", key=["/id"], persistence="transient"))


@pytest.mark.parametrize("text", ["99999999999999999999", "253402300800000", "-253402300800000"])
def test_an_instant_past_year_9999_is_refused_not_handed_to_spark(text):
    from processor.batch.snapshot import SnapshotError, parse_instant

    with pytest.raises(SnapshotError, match="end of year 9999"):
        parse_instant(text)
    assert parse_instant("253402300799999") == 253_402_300_799_999


def test_sql_writes_whole_decimals_exactly():
    """Audit: two integers past 2**63 that Spark read as decimal(20,0) came out as one float."""
    from decimal import Decimal

    from processor.cli.spark import _json_default

    assert orjson.dumps([Decimal("18446744073709551615"), Decimal("18446744073709551614")], default=_json_default) == \
        b"[18446744073709551615,18446744073709551614]"
    assert orjson.dumps(Decimal("123456789012345678901234567890"), default=_json_default) == b'"123456789012345678901234567890"'
    assert orjson.dumps(Decimal("12.50"), default=_json_default) == b"12.5"


def test_the_spark_stream_refuses_a_capacity_on_an_expiring_topic():
    """Audit: its state sees an instant only when the timer fires, so a full partition evicted a
    live record where the worker first expires the due one."""
    from processor.contract.errors import UnsupportedByEngine
    from processor.runners.spark.stream import check_topology
    from processor.topology import Topology

    with pytest.raises(UnsupportedByEngine, match=r"sow\[c\]\.capacity with expiration"):
        check_topology(Topology(sow=[SowTopic(topic="c", key=["/id"], capacity=8, expiration="enabled")]))
    check_topology(Topology(sow=[SowTopic(topic="c", key=["/id"], capacity=8)]))
