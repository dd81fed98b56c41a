"""`ksow up --engine`: the choice, and clear errors (exit status 1, no traceback, no JVM) when the
spark engine cannot start."""

import subprocess
import sys

from click.testing import CliRunner

from processor.cli.commands import main


def test_up_offers_both_engines_faust_by_default():
    result = CliRunner().invoke(main, ["up", "--help"])
    assert result.exit_code == 0
    assert "[faust|spark]" in result.output
    engine = next(p for p in main.commands["up"].params if p.name == "engine")
    assert engine.default == "faust"
    for option in ("--checkpoint-dir", "--master", "--trigger"):
        assert option in result.output


def test_spark_engine_with_a_bad_topology_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sow:\n  - topic: orders\n    key: [/id]\n    expiration: soon\n")
    result = CliRunner().invoke(main, ["up", "--engine", "spark", "--topology", str(bad), "--bootstrap", "127.0.0.1:1"])
    assert result.exit_code == 1
    assert "invalid topology: sow[orders].expiration" in result.output


def test_spark_engine_without_pyspark_is_a_clear_error():
    """As if pyspark were not installed: a one-line error, and the CLI never imported pyspark."""
    code = (
        "import sys; sys.modules['pyspark'] = None\n"
        "from processor.cli import main\n"
        "main(['up', '--engine', 'spark', '--bootstrap', '127.0.0.1:1'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "Error: the spark engine needs pyspark: pip install 'ksow[spark]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_cli_starts_without_pyspark_loaded():
    code = "import sys, processor.cli; assert 'pyspark' not in sys.modules and 'processor.runner.spark_stream' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
