"""The layers hold: the pure core and the contract import no engine, no Kafka client, no store, no
Spark; the engine imports no runner and no Kafka client; the HTTP side sees the worker only through
its read-only view. Checked over every module of those packages (imports are read, nothing is run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "processor"
ENGINES = ("confluent_kafka", "faust", "mode", "aiokafka", "rocksdict", "pyspark")
RULES = {
    "core": ENGINES + ("processor.engine", "processor.runners", "processor.state", "processor.kafka", "processor.batch", "processor.client"),
    "contract": ENGINES + ("processor.core", "processor.engine", "processor.runners", "processor.state", "processor.kafka"),
    "engine": ENGINES + ("processor.runners", "processor.kafka", "processor.batch", "processor.client", "processor.cli"),
}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


@pytest.mark.parametrize("layer", sorted(RULES))
def test_a_layer_imports_nothing_above_or_beside_it(layer):
    files = sorted((PACKAGE / layer).rglob("*.py"))
    assert files
    broken = {
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in files
        for name in imports(path)
        if any(name == banned or name.startswith(banned + ".") for banned in RULES[layer])
    }
    assert not broken, sorted(broken)


def test_the_web_side_does_not_import_the_worker_at_run_time():
    web = PACKAGE / "runners" / "faust" / "web.py"
    tree = ast.parse(web.read_text())
    runtime = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "processor.runners.faust.worker"]
    assert runtime == []
