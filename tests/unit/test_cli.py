"""The command line's answers to bad input: a clear message and exit status 1, nothing sent."""

import os

import orjson
import pytest
import yaml
from click.testing import CliRunner

from processor.cli.commands import main
from processor.contract.errors import ConfigError
from processor.engine.topic import SowTopicEngine
from processor.topology import load_topology, schema_base

NOWHERE = ["--bootstrap", "127.0.0.1:1"]  # nothing may be sent, so nothing needs to listen


@pytest.fixture
def run():
    def invoke(*args, input=None):
        return CliRunner().invoke(main, list(args), input=input)

    return invoke


def test_publish_rejects_bad_json_and_missing_keys(run):
    result = run("publish", "orders", *NOWHERE, "{not json")
    assert result.exit_code == 1 and "not valid JSON" in result.output
    result = run("publish", "orders", *NOWHERE, '{"qty": 1}')
    assert result.exit_code == 1 and "missing key field /order_id" in result.output
    result = run("publish", "orders", *NOWHERE, "-", input='\n[1]\n{"order_id": 1}\n')
    assert result.exit_code == 1 and "line 2" in result.output and "nothing was published" in result.output
    # Audit: a line that is not UTF-8 ended the command with a traceback (and lost the lines before it).
    result = run("publish", "orders", *NOWHERE, "-", input=b'\n{"order_id": 1, "s": "\xff"}\n')
    assert result.exit_code == 1 and "line 2: not UTF-8 text (invalid start byte at byte 22)" in result.output and "Traceback" not in result.output
    result = run("subscribe", "orders", *NOWHERE, "--select", "qty")
    assert result.exit_code == 1 and "field path must look like /field" in result.output and "Traceback" not in result.output
    result = run("delete", "orders", *NOWHERE, "--keys", "not base64!")
    assert result.exit_code == 1 and "must use only Base64 characters" in result.output
    result = run("publish", "orders", *NOWHERE, "--expiration", "soon", '{"order_id": 1}')
    assert result.exit_code == 1 and "not a duration" in result.output


def test_bad_filter_points_at_the_position(run):
    result = run("query", "orders", *NOWHERE, "--filter", "/qty >> 3")
    assert result.exit_code == 1
    assert "position 6" in result.output and "        ^" in result.output
    result = run("delete", "orders", *NOWHERE, "--filter", "(/a = 1")
    assert result.exit_code == 1 and "position 7" in result.output


@pytest.mark.parametrize(("args", "says"), [
    (["publish", "orders", "--key", "abc", '{"order_id": 3}'], "a sow-key is for topics without key fields"),
    (["query", "orders", "--order-by", "/qty SIDEWAYS"], "optionally followed by ASC or DESC"),
    (["subscribe", "orders", "--no-empties"], "--no-empties applies to --delta subscriptions"),
    (["subscribe", "orders", "--sow", "--after-seq", "5"], "drop --sow"),
    (["subscribe", "orders", "--after-seq", "-5"], "an event ID (sow-seq) is never negative; got -5"),
    (["subscribe", "orders", "--after", "12,x"], "a bookmark is event IDs (sow-seq) separated by commas; got '12,x'"),
    (["subscribe", "orders", "--after", str(9 << 10 | 1000)], "is of partition 1000, and the topic has"),
    (["delete", "orders", "--filter", " "], "a blank filter would delete every record"),
    (["subscribe", "orders", "--keys", "not base64!"], "must use only Base64 characters"),
    (["subscribe", "orders", "--keys", ","], "keys names no SowKey"),
])
def test_options_that_would_be_ignored_or_misread_are_refused(run, args, says):
    result = run(*args, *NOWHERE)
    assert result.exit_code == 1 and says in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(("args", "value"), [
    (["subscribe", "orders", "--timeout"], "-1"),
    (["subscribe", "orders", "--timeout"], "nan"),
    (["delete", "orders", "--keys", "a1", "--wait"], "nan"),
    (["delete", "orders", "--keys", "a1", "--wait"], "inf"),
    (["demo", "--duration"], "nan"),
])
def test_seconds_are_a_number_zero_or_more(run, args, value):
    """A NaN passed click's FloatRange: `ksow delete --wait nan` returned at once, `ksow demo
    --duration nan` never ended (no comparison refuses NaN)."""
    result = run(*args, value, *NOWHERE)
    assert result.exit_code == 2 and f"{value!r} is not a number of seconds" in result.output and "Traceback" not in result.output


def test_unknown_topic_and_bad_topology(run, tmp_path):
    result = run("query", "nope", *NOWHERE)
    assert result.exit_code == 1 and "not a SOW topic" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"sow": [{"topic": "orders", "expiration": "soon"}]}))
    result = run("query", "orders", *NOWHERE, "--topology", str(bad))
    assert result.exit_code == 1 and "sow[orders].expiration" in result.output


def test_delete_needs_exactly_one_selector(run):
    result = run("delete", "orders", *NOWHERE)
    assert result.exit_code == 1 and "exactly one of" in result.output


@pytest.fixture
def clean_kafka_env(monkeypatch):
    """`--kafka-config` writes KSOW_KAFKA_CONFIG into this process's environment: undo it."""
    monkeypatch.setenv("KSOW_KAFKA_CONFIG", "")
    for name in [n for n in os.environ if n.startswith("KAFKA_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_bad_kafka_config_is_a_clear_error_before_connecting(run, tmp_path, clean_kafka_env):
    path = tmp_path / "client.properties"
    path.write_text("security.protocol=SASL_SSL\n=SCRAM-SHA-512 Hunter2\n")
    result = run("publish", "orders", *NOWHERE, "--kafka-config", str(path), '{"order_id": 1}')
    assert result.exit_code == 1 and f"{path}:2: expected name=value" in result.output and "Hunter2" not in result.output
    clean_kafka_env.setenv("KSOW_KAFKA_CONFIG", "")  # the run above exported its file
    clean_kafka_env.setenv("KAFKA_SECURITY_PROTOCOL", "TLS")
    result = run("query", "orders", *NOWHERE)
    assert result.exit_code == 1 and "env KAFKA_SECURITY_PROTOCOL: security.protocol=TLS: Invalid value" in result.output


def test_every_command_that_connects_takes_kafka_config(run):
    for name, command in main.commands.items():
        options = {opt for param in command.params for opt in param.opts}
        assert ("--kafka-config" in options) == (name != "broker"), name
    assert "--secured" in run("broker", "--help").output


@pytest.mark.parametrize("name,value", [("KSOW_BATCH_MAX", "abc"), ("KSOW_BATCH_MAX", "0"), ("KSOW_SESSION_TIMEOUT_MS", "-5"),
                                        ("KSOW_MAX_TASK_IDLE_MS", "soon"), ("KSOW_TRANSACTION_TIMEOUT_MS", "1.5"), ("KSOW_EXPIRY_TICK_MS", "0"),
                                        ("KSOW_RESTORE_SLICE_MS", "0")])
def test_up_refuses_a_bad_loop_setting_before_connecting(run, monkeypatch, name, value):
    """The worker loop's environment settings are checked when `ksow up` starts: exit 1 naming the
    variable, not a traceback from the worker's thread."""
    monkeypatch.setenv(name, value)
    result = run("up", *NOWHERE, "--group", "g", "--data-dir", "/nonexistent/ksow-never-created")
    assert result.exit_code == 1 and f"{name} must be a positive integer, got '{value}'" in result.output


@pytest.mark.parametrize("name", ["KSOW_ORDER_GRACE_MS", "KSOW_COMMIT_INTERVAL_MS"])
@pytest.mark.parametrize("workers", ["1", "3"])
def test_up_refuses_a_negative_order_grace_or_commit_interval(run, monkeypatch, name, workers):
    """Also a pool of workers (`--workers 3`) refuses it before it starts any."""
    monkeypatch.setenv(name, "-1")
    result = run("up", *NOWHERE, "--group", "g", "--data-dir", "/nonexistent/ksow-never-created", "--workers", workers)
    assert result.exit_code == 1 and f"{name} must be a non-negative integer, got '-1'" in result.output
    assert "worker 0 started" not in result.output


def test_up_takes_worker_processes_for_the_faust_engine_only(run):
    result = run("up", *NOWHERE, "--engine", "spark", "--workers", "2")
    assert result.exit_code == 1 and "--workers is for the faust engine" in result.output


def test_loop_settings_from_the_environment(monkeypatch):
    from processor.runners.faust.loop import Guarantee, LoopSettings

    monkeypatch.setenv("KSOW_BATCH_MAX", "1234")
    monkeypatch.setenv("KSOW_PROCESSING_GUARANTEE", "at_least_once")
    settings = LoopSettings.from_env()
    assert settings.batch_max == 1234 and settings.guarantee is Guarantee.AT_LEAST_ONCE and settings.session_timeout_ms == 10_000
    monkeypatch.delenv("KSOW_BATCH_MAX")
    assert LoopSettings.from_env().batch_max is None  # the loop picks 50,000, or 20,000 for timed topics
    assert LoopSettings.from_env().order_grace_ms == 20
    monkeypatch.setenv("KSOW_ORDER_GRACE_MS", "0")  # 0 is allowed: no wait for caught-up inputs
    assert LoopSettings.from_env().order_grace_ms == 0
    assert LoopSettings.from_env().expiry_tick_ms == 25
    monkeypatch.setenv("KSOW_EXPIRY_TICK_MS", "100")
    assert LoopSettings.from_env().expiry_tick_ms == 100
    assert LoopSettings.from_env().restore_slice_ms == 100
    monkeypatch.setenv("KSOW_RESTORE_SLICE_MS", "20")
    assert LoopSettings.from_env().restore_slice_ms == 20


def test_files_that_cannot_be_used_are_clear_errors(run, tmp_path):
    """Audit: a topology that is not UTF-8, an Avro schema missing or malformed, and a --data-dir
    that is a file each ended `ksow` with a traceback."""
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"sow:\n  - topic: \xff\n")
    result = run("query", "x", *NOWHERE, "--topology", str(binary))
    assert result.exit_code == 1 and "is not UTF-8 text" in result.output
    afile = tmp_path / "afile"
    afile.write_text("")
    for workers in ("1", "2"):
        result = run("up", *NOWHERE, "--group", "g", "--data-dir", str(afile), "--workers", workers)
        assert result.exit_code == 1 and "it is a file, not a folder" in result.output and "worker 0 started" not in result.output
    bad = tmp_path / "bad.avsc"
    bad.write_text("{bad")
    for schema, says in ((tmp_path / "none.avsc", "cannot read the Avro schema .*none.avsc"), (bad, "the Avro schema .*bad.avsc is not a valid schema")):
        topology = tmp_path / "av.yaml"
        topology.write_text(f"sow:\n  - topic: av\n    key: [/id]\n    message_type: avro\n    schema: {schema}\n")
        with pytest.raises(ConfigError, match=rf"sow\[av\]\.schema: {says}"):
            SowTopicEngine(load_topology(topology).topic("av"))


def test_without_a_bootstrap_only_plaintext_settings_start_the_embedded_broker(run, clean_kafka_env, monkeypatch):
    """Settings for a secured cluster mean that cluster, not the plaintext embedded broker; an
    explicit security.protocol=PLAINTEXT does not (re-check: it was refused by its name alone)."""
    import processor.kafka.embedded as embedded

    class Started(Exception):
        pass

    def embedded_broker(*args, **kwargs):
        raise Started()

    monkeypatch.setattr(embedded, "EmbeddedKafka", embedded_broker)
    clean_kafka_env.setenv("KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    clean_kafka_env.setenv("KAFKA_SASL_MECHANISM", "PLAIN")
    clean_kafka_env.setenv("KAFKA_SASL_USERNAME", "u")
    clean_kafka_env.setenv("KAFKA_SASL_PASSWORD", "p")
    result = run("up", "--group", "g", "--data-dir", "/nonexistent/ksow-never-created")
    assert result.exit_code == 1 and "the client settings are for a secured cluster (security.protocol=SASL_SSL)" in result.output
    for name in ("KAFKA_SASL_MECHANISM", "KAFKA_SASL_USERNAME", "KAFKA_SASL_PASSWORD"):
        clean_kafka_env.delenv(name)
    clean_kafka_env.setenv("KAFKA_SECURITY_PROTOCOL", "PLAINTEXT")
    result = run("up", "--group", "g", "--data-dir", "/nonexistent/ksow-never-created")
    assert isinstance(result.exception, Started)


def test_bad_option_values_are_one_clear_error_before_anything_starts(run):
    """Review: an empty record was "published 0 record(s)" with status 0; a --web-port past 65535
    ended in Faust's traceback, and a pool's last ports were found out of range by its workers, which
    the pool restarted; a negative --wait was taken; --select was checked by the workers only."""
    result = run("publish", "orders", *NOWHERE, "  ")
    assert result.exit_code == 1 and "the record is empty" in result.output
    result = run("up", *NOWHERE, "--web-port", "99999")
    assert result.exit_code == 2 and "99999 is not in the range 0<=x<=65535" in result.output
    result = run("up", *NOWHERE, "--group", "g", "--data-dir", "/nonexistent/ksow-never-created", "--web-port", "65534", "--workers", "3")
    assert result.exit_code == 1 and "needs ports up to 65536, past 65535" in result.output and "worker 0 started" not in result.output
    result = run("delete", "orders", *NOWHERE, "--wait", "-1", "--data", '{"order_id": 1}')
    assert result.exit_code == 2 and "--wait" in result.output
    result = run("query", "orders", *NOWHERE, "--select", "qty")
    assert result.exit_code == 1 and "select: field path must look like /field" in result.output


def test_relative_avro_schemas_are_read_from_the_topology_folders_parent_by_every_command(run, tmp_path, monkeypatch):
    """Review: `ksow up` read `schemas/a.avsc` of `proj/topology/av.yaml` from `proj/`, the client
    commands from the working folder; and a schema it could not read made `ksow up` exit with the
    status of an unreachable cluster (3), which a pool restarts."""
    from processor.client.sow_client import Client

    project = tmp_path / "proj"
    (project / "topology").mkdir(parents=True)
    (project / "schemas").mkdir()
    (project / "schemas" / "a.avsc").write_text('{"type": "record", "name": "A", "fields": [{"name": "id", "type": "long"}]}')
    topology = project / "topology" / "av.yaml"
    topology.write_text(yaml.safe_dump({"sow": [{"topic": "av", "key": ["/id"], "message_type": "avro", "schema": "schemas/a.avsc"}]}))
    monkeypatch.chdir(tmp_path)  # not the project's folder: `schemas/a.avsc` is not here
    named = "proj/topology/av.yaml"
    client = Client("127.0.0.1:1", named)
    worker = SowTopicEngine(client.spec("av"), schema_base(named))  # as `ksow up --topology` makes it
    assert worker.codec.decode(client.codec(client.spec("av")).encode({"id": 7})) == {"id": 7}
    (project / "schemas" / "a.avsc").unlink()
    result = run("up", *NOWHERE, "--topology", named, "--group", "g", "--data-dir", "/nonexistent/ksow-never-created")
    assert result.exit_code == 1 and "sow[av].schema: cannot read the Avro schema" in result.output


def test_status_shows_each_live_worker_and_fails_when_none_answers(run, monkeypatch):
    """`ksow status`: a row a worker and SOW topic (partitions, records, input lag), its memory on
    its first row; --json gives each worker's /status answer; no live worker, or none answering,
    exits 1 saying so."""
    from processor.client.sow_client import Client

    answers = [
        {"url": "http://w1:6066", "topics": {"orders": {"partitions": [0, 1], "records": 1500, "input_lag": 42}},
         "rss_bytes": 300 << 20, "rocksdb_bytes": {"cache": 12 << 20, "memtables": 9 << 20}, "cached_records": 1500},
        {"url": "http://w2:6066", "error": "no answer", "topics": {}},
    ]
    monkeypatch.setattr(Client, "status", lambda self: answers)
    result = run("status", *NOWHERE)
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "http://w1:6066" in line)
    for shown in ("orders", "0,1", "1,500", "42", "300 MiB", "12 MiB"):
        assert shown in row, shown
    assert "no answer" in next(line for line in result.output.splitlines() if "http://w2:6066" in line)
    result = run("status", *NOWHERE, "--json")
    assert [orjson.loads(line) for line in result.output.splitlines()] == answers
    answers.pop(0)
    result = run("status", *NOWHERE)
    assert result.exit_code == 1 and "no worker of group ksow answered" in result.output
    answers.clear()
    result = run("status", *NOWHERE)
    assert result.exit_code == 1 and "no live worker in group ksow" in result.output
