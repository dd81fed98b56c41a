"""The command line's answers to bad input: a clear message and exit status 1, nothing sent."""

import pytest
import yaml
from click.testing import CliRunner

from processor.cli.commands import main

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
    result = run("publish", "orders", *NOWHERE, "-", input='{"order_id": 1}\n[1]\n')
    assert result.exit_code == 1 and "line 2" in result.output
    result = run("publish", "orders", *NOWHERE, "--expiration", "soon", '{"order_id": 1}')
    assert result.exit_code == 1 and "not a duration" in result.output


def test_bad_filter_points_at_the_position(run):
    result = run("query", "orders", *NOWHERE, "--filter", "/qty >> 3")
    assert result.exit_code == 1
    assert "position 6" in result.output and "        ^" in result.output
    result = run("delete", "orders", *NOWHERE, "--filter", "(/a = 1")
    assert result.exit_code == 1 and "position 7" in result.output


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
