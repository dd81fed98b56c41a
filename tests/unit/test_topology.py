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
    ({"topic": "orders", "min_expiration": 0}, "sow[orders].min_expiration: Value error, must be a positive duration"),
    ({"topic": "orders", "max_expiration": "0s"}, "sow[orders].max_expiration: Value error, must be a positive duration"),
    ({"topic": "orders", "min_expiration": -1}, "sow[orders].min_expiration"),
    ({"topic": "orders", "max_expiration": "-5s"}, "sow[orders].max_expiration"),
    ({"topic": "orders", "persistence": "transient", "capacity": 10}, "capacity: a transient topic keeps no records"),
    ({"topic": "orders", "dead_event_topic": "None"}, "'none' would be a Kafka topic of that name"),
])
def test_errors_name_topic_and_field(entry, message):
    with pytest.raises(TopologyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_topology({"sow": [entry]})


def test_view_errors():
    with pytest.raises(TopologyError, match=r"views\[v\]\.options"):
        parse_topology({"sow": [{"topic": "t"}], "views": [{"name": "v", "topic": "t", "options": ["bogus"]}]})
    with pytest.raises(TopologyError, match="unknown SOW topic"):
        parse_topology({"sow": [{"topic": "t"}], "views": [{"name": "v", "topic": "nope"}]})
    # audit: over a transient topic a view kept a record on <view>.sow after it left the filter
    with pytest.raises(TopologyError, match=r"views\[v\]\.topic: 't' is transient: it keeps no SOW"):
        parse_topology({"sow": [{"topic": "t", "persistence": "transient"}], "views": [{"name": "v", "topic": "t"}]})


def test_expiry_topic_none_and_missing_file(tmp_path):
    topo = parse_topology({"sow": [{"topic": "t", "expiry_topic": "none"}]})
    assert topo.topic("t").expired_topic is None
    with pytest.raises(TopologyError, match="not found"):
        load_topology(tmp_path / "missing.yaml")


@pytest.mark.parametrize("expiration", [0, "0", "0s", "0ms"])
def test_expiration_zero_is_no_default_lifetime(expiration):
    """As a Universal Messaging TTL of 0: records keep no default lifetime (per-message ones still expire)."""
    policy = parse_topology({"sow": [{"topic": "t", "expiration": expiration}]}).topic("t").expiry
    assert policy.mode is ExpirationMode.ENABLED and policy.default_ms is None
    assert policy.expires_at(1_000, None) is None
    assert policy.expires_at(1_000, 500) == 1_500


def test_warns_when_a_topic_default_overrides_clamps():
    topo = parse_topology({"sow": [
        {"topic": "a", "expiration": "30s", "max_expiration": "1h"},
        {"topic": "b", "expiration": "enabled", "min_expiration": "1s", "max_expiration": "1h"},
        {"topic": "c", "expiration": "30s"},
    ]})
    (warning,) = topo.warnings()
    assert warning.startswith("sow[a]: expiration 30s") and "overrides max_expiration" in warning


def test_warns_when_clamps_give_instants_that_never_expire():
    """Clamps on a topic whose expiration is disabled stamp every record with an instant (an hour
    ahead with max_expiration: 1h) that no worker acts on: valid, but not what an operator meant."""
    topo = parse_topology({"sow": [{"topic": "a", "max_expiration": "1h"}, {"topic": "b", "expiration": "disabled", "min_expiration": "1s"},
                                   {"topic": "c", "expiration": "enabled", "max_expiration": "1h"}]})
    assert topo.sow[0].expiry.expires_at(1_000, None) == 1_000 + 3_600_000 and not topo.sow[0].expiry.active
    first, second = topo.warnings()
    assert first.startswith("sow[a]: expiration is disabled, so max_expiration only stamps") and "never expire" in first
    assert second.startswith("sow[b]: expiration is disabled, so min_expiration") and "set expiration: enabled" in second


def _rejected(raw: dict) -> str:
    with pytest.raises(TopologyError) as info:
        parse_topology(raw)
    message = str(info.value)
    assert message.startswith("invalid topology: ") and not message.startswith("invalid topology: :")
    return message.removeprefix("invalid topology: ")


def test_expiry_topic_may_not_be_its_own_input():
    """Every expired record would be read back as a publish, so it would never go away."""
    assert _rejected({"sow": [{"topic": "loopt", "expiry_topic": "loopt"}]}) == (
        "sow[loopt].expiry_topic: expiry topic 'loopt' is also the input of SOW topic 'loopt'")


LONG = "t" * 240  # a legal name, whose ".repartition" is not


@pytest.mark.parametrize("sow,views,message", [
    ([{"topic": "a", "expiry_topic": "x y"}], [],
     "sow[a].expiry_topic: expiry topic 'x y' is no Kafka topic name (1 to 249 letters, digits, '.', '_' or '-', not . or ..)"),
    ([{"topic": "a", "dead_event_topic": ".."}], [],
     "sow[a].dead_event_topic: dead event topic '..' is no Kafka topic name (1 to 249 letters, digits, '.', '_' or '-', not . or ..)"),
    ([{"topic": LONG}], [],
     f"sow[{LONG}].topic: repartition topic '{LONG}.repartition' is no Kafka topic name (1 to 249 letters, digits, '.', '_' or '-', not . or ..)"),
    ([{"topic": "a"}], [{"name": "v" * 246, "topic": "a"}],
     f"views[{'v' * 246}].name: changelog '{'v' * 246}.sow' is no Kafka topic name (1 to 249 letters, digits, '.', '_' or '-', not . or ..)"),
])
def test_every_topic_named_is_one_kafka_can_create(sow, views, message):
    """Every command took these; `ksow up` failed only when creating the topics, with Kafka's words
    naming neither the SOW topic nor the field ("Topic name is invalid: 'x y' contains ...")."""
    assert _rejected({"sow": sow, "views": views}) == message


def test_dead_event_topic_may_not_be_its_own_changelog():
    assert _rejected({"sow": [{"topic": "a", "dead_event_topic": "a.sow"}]}) == (
        "sow[a].dead_event_topic: dead event topic 'a.sow' is also the changelog of SOW topic 'a'")


def test_a_sow_topic_may_not_be_the_delta_input_of_another():
    assert _rejected({"sow": [{"topic": "a"}, {"topic": "a.delta"}]}) == (
        "sow[a.delta].topic: input 'a.delta' is also the delta input of SOW topic 'a'")
    assert _rejected({"sow": [{"topic": "a.delta"}, {"topic": "a"}]}) == (
        "sow[a].topic: delta input 'a.delta' is also the input of SOW topic 'a.delta'")


def test_a_sow_topic_may_not_be_the_changelog_of_another():
    assert _rejected({"sow": [{"topic": "a"}, {"topic": "a.sow"}]}) == (
        "sow[a.sow].topic: input 'a.sow' is also the changelog of SOW topic 'a'")


@pytest.mark.parametrize("sow,view,message", [
    ([{"topic": "a"}, {"topic": "v.sow"}], "v", "views[v].name: changelog 'v.sow' is also the input of SOW topic 'v.sow'"),
    ([{"topic": "a"}], "a.errors", None),  # a.errors.sow / a.errors.diff: no clash
    ([{"topic": "a", "expiry_topic": "v.sow"}], "v", "views[v].name: changelog 'v.sow' is also the expiry topic of SOW topic 'a'"),
    ([{"topic": "a"}, {"topic": "b", "dead_event_topic": "a.dead"}], "v", None),  # shared dead event topics: see below
    ([{"topic": "a"}, {"topic": "b", "expiry_topic": "a.errors"}], "v",
     "sow[b].expiry_topic: expiry topic 'a.errors' is also the errors topic of SOW topic 'a'"),
])
def test_views_and_sow_topics_write_topics_of_their_own(sow, view, message):
    raw = {"sow": sow, "views": [{"name": view, "topic": "a"}]}
    if message is None:
        parse_topology(raw)
    else:
        assert _rejected(raw) == message


def test_two_views_may_not_write_the_same_topic():
    raw = {"sow": [{"topic": "a"}], "views": [{"name": "v", "topic": "a"}, {"name": "v", "topic": "a"}]}
    assert _rejected(raw) == "views[1].name: 'v' is defined twice"


def test_holds_topic_is_claimed_when_a_view_conflates():
    sow = [{"topic": "a", "expiry_topic": "a.holds"}]
    parse_topology({"sow": sow, "views": [{"name": "v", "topic": "a"}]})
    assert _rejected({"sow": sow, "views": [{"name": "v", "topic": "a", "conflation": "1s"}]}) == (
        "sow[a].topic: holds topic 'a.holds' is also the expiry topic of SOW topic 'a'")


def test_expired_and_dead_records_may_share_a_topic():
    """As with `expiry_topic: none`, where expired records go to the dead event topic."""
    parse_topology({"sow": [{"topic": "a", "expiry_topic": "a.dead"}]})
    parse_topology({"sow": [{"topic": "a", "expiry_topic": "gone", "dead_event_topic": "gone"}]})


def test_sow_topics_may_share_expiry_and_dead_event_topics():
    """Seed 004: many queues may be bound to one expiry address; seed 002: a dead event store is a
    channel like any other. Each message there names its SOW topic (`sow-topic`)."""
    topo = parse_topology({"sow": [
        {"topic": "a", "expiry_topic": "expired", "dead_event_topic": "dead", "partitions": 2},
        {"topic": "b", "expiry_topic": "expired", "partitions": 8},
        {"topic": "c", "expiry_topic": "dead", "dead_event_topic": "expired", "partitions": 4},
    ]})
    assert [t.expired_topic for t in topo.sow] == ["expired", "expired", "dead"]
    from processor.kafka.clients import topology_topic_configs

    configs = topology_topic_configs(topo)
    streamed = {"cleanup.policy": "delete"}
    assert configs["expired"] == (8, streamed) and configs["dead"] == (4, streamed), "the most partitions any SOW topic writes to"
    assert configs["a.sow"][0] == 2 and configs["b.sow"][0] == 8
    # Whatever the cluster's default policy: only the changelogs are compacted.
    assert {name: c["cleanup.policy"] for name, (_, c) in configs.items() if name.startswith("a")} == {
        "a": "delete", "a.delta": "delete", "a.repartition": "delete", "a.diff": "delete", "a.errors": "delete", "a.sow": "compact"}


def test_a_shared_expiry_topic_is_still_no_other_role():
    assert _rejected({"sow": [{"topic": "a", "expiry_topic": "b.diff"}, {"topic": "b"}]}) == (
        "sow[b].topic: diff topic 'b.diff' is also the expiry topic of SOW topic 'a'")
    assert _rejected({"sow": [{"topic": "a", "expiry_topic": "x"}, {"topic": "b", "expiry_topic": "x"}, {"topic": "x"}]}) == (
        "sow[x].topic: input 'x' is also the expiry topic of SOW topic 'a'")


def test_duplicate_and_unknown_topics_are_named():
    assert _rejected({"sow": [{"topic": "a"}, {"topic": "a"}]}) == "sow[1].topic: 'a' is defined twice"
    assert _rejected({"sow": [{"topic": "a"}], "views": [{"name": "v", "topic": "nope"}]}) == (
        "views[v].topic: unknown SOW topic 'nope' (known: a)")


def test_repo_topologies_still_load():
    files = sorted(DEFAULT_TOPOLOGY.parent.glob("*.yaml"))
    assert DEFAULT_TOPOLOGY in files
    for path in files:
        load_topology(path)


def test_a_view_filter_that_does_not_parse_is_a_topology_error():
    """Not a traceback when the worker starts: the view and the field, and where the filter breaks."""
    message = _rejected({"sow": [{"topic": "vb", "key": ["/id"]}], "views": [{"name": "vbv", "topic": "vb", "filter": "/x >> 1"}]})
    assert message.startswith("views[vbv].filter: ") and "position 4" in message


@pytest.mark.parametrize(("word", "mode"), [("on", ExpirationMode.ENABLED), ("yes", ExpirationMode.ENABLED), ("true", ExpirationMode.ENABLED),
                                            ("off", ExpirationMode.DISABLED), ("no", ExpirationMode.DISABLED), ("false", ExpirationMode.DISABLED)])
def test_a_yaml_boolean_switches_expiration_and_is_no_lifetime(tmp_path, word, mode):
    """Audit: `expiration: on` (a YAML boolean) was read as 1, a one-second lifetime for every record."""
    path = tmp_path / "t.yaml"
    path.write_text(f"sow:\n  - topic: t\n    key: [/id]\n    expiration: {word}\n")
    policy = load_topology(path).topic("t").expiry
    assert policy.mode is mode and policy.default_ms is None


@pytest.mark.parametrize("field", ["min_expiration", "max_expiration", "capacity", "partitions"])
def test_a_yaml_boolean_is_no_number_or_duration(tmp_path, field):
    path = tmp_path / "t.yaml"
    path.write_text(f"sow:\n  - topic: t\n    key: [/id]\n    {field}: on\n")
    with pytest.raises(TopologyError, match=rf"sow\[t\]\.{field}: .*YAML boolean"):
        load_topology(path)
    path.write_text("sow:\n  - topic: t\n    key: [/id]\nviews:\n  - name: v\n    topic: t\n    conflation: yes\n")
    with pytest.raises(TopologyError, match="conflation: .*YAML boolean"):
        load_topology(path)


@pytest.mark.parametrize("pattern, names", [
    ("orders", ["orders"]),
    ("ord", []),  # a name matches whole, not in part
    (".*orders", ["orders", "eu.orders"]),
    ("orders.*", ["orders", "orders_open"]),  # views too
    ("eu[.].*", ["eu.orders"]),
    ("trades|orders", ["orders", "trades"]),  # in the topology's order: SOW topics, then views
    ("a)|(orders", []),  # the pattern alone is matched whole, not spliced into an anchored one
    ("(", []),  # no regular expression: no topic
])
def test_a_query_topic_pattern_matches_whole_names_of_sow_topics_and_views(pattern, names):
    topology = parse_topology({"sow": [{"topic": t, "key": ["/id"]} for t in ("orders", "eu.orders", "trades")],
                               "views": [{"name": "orders_open", "topic": "orders", "filter": "/status = 'open'"}]})
    assert topology.matching(pattern) == names


@pytest.mark.parametrize("entry,message", [
    ({"key": ["/a", "/a/b"]}, "sow[t].key: Value error, /a/b lies inside /a: key values are scalars, so no record has both"),
    ({"key": ["/x/y", "/x"]}, "sow[t].key: Value error, /x/y lies inside /x: key values are scalars, so no record has both"),
    ({"key": ["/a", "/b", "/a"]}, "sow[t].key: Value error, /a is named twice"),
    ({"expiry_topic": ""}, "sow[t].expiry_topic: String should have at least 1 character"),
    ({"dead_event_topic": ""}, "sow[t].dead_event_topic: String should have at least 1 character"),
])
def test_key_paths_and_topic_names_that_could_not_work_are_refused(entry, message):
    """Both loaded: `key: [/a, /a/b]` sent every input to .errors (/a is an object when /a/b is
    there), and an empty topic name quietly meant the default one."""
    assert _rejected({"sow": [{"topic": "t", **entry}]}) == message
