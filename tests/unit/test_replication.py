"""Replication of the topics ksow creates: defaults from the cluster size, overrides, refusals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from processor.contract.errors import ConfigError
from processor.kafka.clients import replication_settings
from processor.topology import TopologyError, parse_topology


@pytest.mark.parametrize(("brokers", "expected"), [(1, (1, 1)), (2, (2, 2)), (3, (3, 2)), (7, (3, 2))])
def test_defaults_follow_the_cluster(brokers, expected):
    assert replication_settings(brokers) == expected


@given(st.integers(1, 50), st.data())
def test_chosen_settings_always_fit_the_cluster(brokers, data):
    factor = data.draw(st.none() | st.integers(1, brokers))
    min_insync = data.draw(st.none() | st.integers(1, factor or min(3, brokers)))
    got_factor, got_min_insync = replication_settings(brokers, factor, min_insync)
    assert got_factor == (factor or min(3, brokers))
    assert 1 <= got_min_insync <= got_factor <= brokers
    assert got_min_insync == (min_insync or min(2, got_factor))


@pytest.mark.parametrize(
    ("brokers", "factor", "min_insync", "message"),
    [(1, 3, None, "replication factor 3 does not fit a cluster of 1 broker"), (3, 0, None, "replication factor 0"),
     (3, 2, 3, "min.insync.replicas 3 must be between 1 and the replication factor 2")],
)  # fmt: skip
def test_impossible_settings_are_config_errors(brokers, factor, min_insync, message):
    with pytest.raises(ConfigError, match=message):
        replication_settings(brokers, factor, min_insync)


def test_topology_carries_replication_settings():
    topology = parse_topology({"sow": [{"topic": "t", "key": ["/id"]}], "replication_factor": 3, "min_insync_replicas": 2})
    assert (topology.replication_factor, topology.min_insync_replicas) == (3, 2)
    assert parse_topology({"sow": []}).replication_factor is None


def test_topology_refuses_min_insync_above_the_factor():
    with pytest.raises(TopologyError, match="min_insync_replicas 3 is above replication_factor 2"):
        parse_topology({"sow": [], "replication_factor": 2, "min_insync_replicas": 3})
