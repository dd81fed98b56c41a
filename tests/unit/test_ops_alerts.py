"""ops/prometheus/ksow-alerts.yml: every rule parses as PromQL (Prometheus's own grammar) and names
only metrics a worker serves, so a renamed metric cannot leave an alert that never fires."""

from pathlib import Path

import promql_parser
import pytest
import yaml

from processor.runners.faust import metrics

RULES = Path(__file__).resolve().parents[2] / "ops" / "prometheus" / "ksow-alerts.yml"
SCRAPE = {"up"}  # Prometheus's own, for every target it scrapes


def _served() -> set[str]:
    """The series names a worker's /metrics may hold (a counter's with _total, a histogram's with
    _bucket, _sum and _count)."""
    names = set()
    for family in metrics.REGISTRY.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        names.update(family.name + suffix for suffix in suffixes)
    return names


def _selected(node) -> set[str]:
    """Metric names the expression's vector selectors read."""
    if node is None or isinstance(node, (str, int, float)):
        return set()
    if isinstance(node, list):
        return set().union(*(_selected(n) for n in node))
    names = {node.name} if type(node).__name__ == "VectorSelector" and node.name else set()
    for part in ("lhs", "rhs", "expr", "args", "vector_selector", "param"):
        names |= _selected(getattr(node, part, None))
    return names


def _rules():
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


@pytest.mark.parametrize("rule", _rules(), ids=lambda rule: rule["alert"])
def test_each_alert_parses_and_reads_only_served_metrics(rule):
    expr = promql_parser.parse(rule["expr"])
    read = _selected(expr)
    assert read, "an alert reads at least one metric"
    assert read <= _served() | SCRAPE, read - _served() - SCRAPE
    assert rule["annotations"]["summary"] and rule["labels"]["severity"] in ("page", "ticket")


def test_a_misspelt_metric_is_caught():
    assert _selected(promql_parser.parse("rate(ksow_inputs_totl[5m]) > 0")) - _served() == {"ksow_inputs_totl"}
