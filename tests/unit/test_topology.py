"""Topology validation: errors name the topic and the field."""

import pytest

from processor.core.expiry import ExpirationMode
from processor.topology import DEFAULT_TOPOLOGY, TopologyError, load_topology, parse_topology


def test_default_topology_loads():
    topo = load_topology(DEFAULT_TOPOLOGY)
    orders = topo.topic("orders")
    assert orders.key == ["/order_id"]
    assert orders.sow_topic == "orders.sow" and orders.expired_topic == "EXP.orders"


def test_contract_example():
    topo = parse_topology({
        "sow": [{
            "topic": "orders", "key": ["/order_id"], "key_domain": "orders", "message_type": "json",
            "expiration": "30s", "min_expiration": "1s", "max_expiration": "1h", "persistence": "persistent",
            "capacity": 0, "capacity_policy": "evict_oldest", "expiry_topic": "EXP.orders",
            "dead_event_topic": "orders.dead", "hash_indexes": [["/region"], ["/customer", "/status"]], "partitions": 8,
        }],
        "views": [{"name": "big_open_orders", "topic": "orders", "filter": "/status = 'open' AND /qty > 1000",
                   "select": ["/order_id", "/qty", "/status"], "options": ["oof", "no_empties"], "conflation": "250ms"}],
    })
    spec = topo.topic("orders")
    assert spec.expiry.mode is ExpirationMode.DEFAULT and spec.expiry.default_ms == 30_000
    assert spec.expiry.min_ms == 1_000 and spec.expiry.max_ms == 3_600_000


@pytest.mark.parametrize("entry,message", [
    ({"topic": "orders", "expiration": "soon"}, "sow[orders].expiration"),
    ({"topic": "orders", "key": ["order_id"]}, "sow[orders].key"),
    ({"topic": "orders", "persistence": "disk"}, "sow[orders].persistence"),
    ({"topic": "orders", "partitions": 0}, "sow[orders].partitions"),
    ({"topic": "orders", "capacity_policy": "drop"}, "sow[orders].capacity_policy"),
    ({"topic": "orders", "min_expiration": "1h", "max_expiration": "1s"}, "min_expiration is greater"),
    ({"topic": "orders", "colour": "red"}, "sow[orders].colour"),
])
def test_errors_name_topic_and_field(entry, message):
    with pytest.raises(TopologyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_topology({"sow": [entry]})


def test_view_errors():
    with pytest.raises(TopologyError, match=r"views\[v\]\.options"):
        parse_topology({"sow": [{"topic": "t"}], "views": [{"name": "v", "topic": "t", "options": ["bogus"]}]})
    with pytest.raises(TopologyError, match="unknown SOW topic"):
        parse_topology({"sow": [{"topic": "t"}], "views": [{"name": "v", "topic": "nope"}]})


def test_expiry_topic_none_and_missing_file(tmp_path):
    topo = parse_topology({"sow": [{"topic": "t", "expiry_topic": "none"}]})
    assert topo.topic("t").expired_topic is None
    with pytest.raises(TopologyError, match="not found"):
        load_topology(tmp_path / "missing.yaml")
