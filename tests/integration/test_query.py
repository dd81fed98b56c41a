"""Queries answered by two workers over HTTP, hash indexes, and sow_delete by filter."""

from __future__ import annotations

import orjson
import pytest

from processor.client.sow_client import Client
from processor.core.filters import FilterError
from processor.query.engine import SowQuery
from processor.topology import load_topology

from .workers import Worker, headers_of, read_all, wait_until, write_topology

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(kafka_bootstrap, unique_name, tmp_path, admin):
    held = {"name": f"{unique_name}_held", "topic": unique_name, "filter": "/status = 'held'", "select": ["/qty"]}
    path = write_topology(tmp_path, unique_name, views=[held], hash_indexes=[["/status"], ["/region", "/desk"]])
    group = f"g-{unique_name}"
    workers = [Worker(kafka_bootstrap, path, group, tmp_path / f"d{i}", f"w{i}").start() for i in (1, 2)]

    def split():
        desc = admin.describe_consumer_groups([group])[group].result(30)
        owned = [{tp.partition for tp in m.assignment.topic_partitions if tp.topic == unique_name} for m in desc.members]
        return len(owned) == 2 and all(owned)

    wait_until(split, timeout=90, interval=1)
    client = Client(kafka_bootstrap, load_topology(path), group)
    yield unique_name, client
    for w in workers:
        w.kill()


def _load(client, topic, n=60):
    for i in range(n):
        client.publish(topic, {"id": i, "status": ["open", "done", "held"][i % 3], "region": ["EU", "US"][i % 2], "desk": i % 4, "qty": i})
    client.flush()
    wait_until(lambda: len(client.query(topic)) == n)


def test_queries_fan_out_to_both_workers(cluster):
    topic, client = cluster
    _load(client, topic)

    def answered_by_workers():  # the load's last queries may have come while a worker was announcing itself
        found = client.query(topic, filter="/status = 'open' AND /qty >= 30")
        return found if client.last_query_source == "workers" else None

    rows = wait_until(answered_by_workers, timeout=60, what="an answer from both workers")
    assert sorted(r.record["id"] for r in rows) == [i for i in range(30, 60) if i % 3 == 0]
    rows = client.query(topic, filter="/region = 'EU' AND /desk IN (0, 2)", select=["/qty"], top=3, order_by="/qty DESC")
    assert [r.record for r in rows] == [{"id": 58, "qty": 58}, {"id": 56, "qty": 56}, {"id": 54, "qty": 54}]
    one = rows[0]
    assert [r.record["id"] for r in client.query(topic, keys=[one.sow_key])] == [58]
    # Ties (15 records a desk) come in SowKey order, from both workers and from `.sow` alike.
    everything = sorted((-r.record["desk"], r.sow_key) for r in client.query(topic))
    ties = client.query(topic, order_by="/desk DESC", top=7)
    assert client.last_query_source == "workers" and [r.sow_key for r in ties] == [key for _, key in everything[:7]]
    changelog = client._query_changelog(client.spec(topic), SowQuery(top=7, order_by="/desk DESC"))
    assert [r["sow_key"] for r in changelog] == [r.sow_key for r in ties]
    assert [r.sow_key for r in client.query(topic, top=5)] == sorted(key for _, key in everything)[:5]
    with pytest.raises(FilterError) as err:
        client.query(topic, filter="/qty >> 3")
    assert err.value.position == 6


def test_a_filter_longer_than_a_url_allows_is_answered_by_the_workers(cluster):
    """The client posts its query: a 50 KB IN list (over the 8 KB request line aiohttp reads)
    is answered by the workers, not by a silent fallback to reading `.sow`."""
    import urllib.error
    import urllib.request

    from processor.kafka.registry import live_workers

    topic, client = cluster
    _load(client, topic)
    ids = [3, 4] + list(range(1_000, 9_000))
    text = f"/id IN ({', '.join(map(str, ids))})"
    assert len(text) > 40_000
    rows = client.query(topic, filter=text)
    assert client.last_query_source == "workers"
    assert sorted(r.record["id"] for r in rows) == [3, 4]
    (w, *_) = live_workers(client.bootstrap, client.group)
    for body in (b"[1]", b"{not json", b'{"top": 3}', b'{"fliter": "/id = 3"}'):
        request = urllib.request.Request(f"{w['url']}/sow/{topic}", data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 400 and b"error" in refused.value.read()
    both = urllib.request.Request(f"{w['url']}/sow/{topic}?top=1", data=b'{"filter": "/id = 3"}')
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(both, timeout=10)
    assert refused.value.code == 400 and b"not in both" in refused.value.read()


def test_indexed_queries_read_only_candidates(cluster):
    import urllib.error
    import urllib.request

    import orjson

    from processor.kafka.registry import live_workers

    topic, client = cluster
    _load(client, topic)
    workers = wait_until(lambda: (w := live_workers(client.bootstrap, client.group)) and len(w) == 2 and all(x["topics"].get(topic) for x in w) and w)
    read = 0
    for w in workers:
        url = f"{w['url']}/sow/{topic}?filter=" + urllib.request.quote("/status = 'held'")
        answer = orjson.loads(urllib.request.urlopen(url, timeout=10).read())
        assert answer["plan"]["index"] == 0
        read += answer["plan"]["read"]
        assert all(r["record"]["status"] == "held" for r in answer["results"])
    assert read == 20  # only the 20 'held' records were read, not all 60
    # A filter that names the key field reads the records of the SowKeys it names, nothing else.
    found, read = [], 0
    for w in workers:
        url = f"{w['url']}/sow/{topic}?filter=" + urllib.request.quote("/id IN (7, 8) AND /status <> 'held'")
        answer = orjson.loads(urllib.request.urlopen(url, timeout=10).read())
        assert answer["plan"]["by_key"] == len(answer["partitions"]) > 0 and answer["plan"]["index"] is None
        read += answer["plan"]["read"]
        found += [r["record"]["id"] for r in answer["results"]]
    assert read == 2 and found == [7]  # 8 is 'held'
    # A view's name reads its topic through the view's filter and select list, as the client does.
    held, read = [], 0
    for w in workers:
        url = f"{w['url']}/sow/{topic}_held?filter=" + urllib.request.quote("/qty >= 30 OR /desk = 1")
        answer = orjson.loads(urllib.request.urlopen(url, timeout=10).read())
        assert answer["plan"]["index"] == 0
        read += answer["plan"]["read"]
        held += [r["record"] for r in answer["results"]]
    assert read == 20
    assert sorted(held, key=lambda r: r["id"]) == [{"id": i, "qty": i} for i in range(30, 60) if i % 3 == 2]  # /desk is not in the view
    assert held and sorted(held, key=lambda r: r["id"]) == sorted((r.record for r in client.query(f"{topic}_held", filter="/qty >= 30 OR /desk = 1")), key=lambda r: r["id"])
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{workers[0]['url']}/sow/{topic}_held?order_by=/desk", timeout=10)
    assert refused.value.code == 400 and b"not in the select list of view" in refused.value.read()


def test_delete_by_filter_reports_the_count_and_emits_deletes(cluster, kafka_bootstrap):
    topic, client = cluster
    _load(client, topic)
    assert client.delete(topic, filter="/status = 'done'", wait=30) == 20
    wait_until(lambda: len(client.query(topic)) == 40)
    deletes = [m for m in read_all(kafka_bootstrap, f"{topic}.diff") if headers_of(m)["sow-op"] == "delete"]
    assert len(deletes) == 20
    # A filter that names SowKeys goes to their owners only (and reads only their records there).
    assert client.delete(topic, filter="/id IN ('3', '5', '6', '7') AND /status <> 'held'", wait=30) == 2  # 5 is held, 7 was done
    wait_until(lambda: len(client.query(topic)) == 38)
    deletes = [m for m in read_all(kafka_bootstrap, f"{topic}.diff") if headers_of(m)["sow-op"] == "delete"]
    assert sorted(orjson.loads(m.value())["id"] for m in deletes) == sorted([i for i in range(60) if i % 3 == 1] + [3, 6])
    assert client.delete(topic, filter="1=1", wait=30) == 38
    wait_until(lambda: client.query(topic) == [])


def test_workers_expose_prometheus_metrics(cluster):
    import urllib.request

    from processor.kafka.registry import live_workers

    topic, client = cluster
    _load(client, topic, n=30)
    workers = wait_until(lambda: (w := live_workers(client.bootstrap, client.group)) and len(w) == 2 and w)

    def total(name, label, key="topic"):
        value = 0.0
        for w in workers:
            text = urllib.request.urlopen(f"{w['url']}/metrics", timeout=10).read().decode()
            value += sum(float(line.split()[-1]) for line in text.splitlines()
                         if line.split("{")[0].split()[0] == name and (not label or f'{key}="{label}"' in line))
        return value

    assert total("ksow_inputs_total", topic) == 30
    assert total("ksow_sow_records", topic) == 30
    assert total("ksow_outputs_total", f"{topic}.sow") == 30 and total("ksow_outputs_total", f"{topic}.diff") == 30
    # Where the loop threads' time went: they waited for inputs, applied 30 and committed them.
    for step in ("consume", "file", "apply", "prepare", "commit_wait", "store_commit"):
        assert total("ksow_loop_seconds_total", step, key="step") > 0, step
    # Nothing left to apply; the process's own figures; the stores' memory and cache, within bounds.
    wait_until(lambda: total("ksow_input_lag", topic) == 0)
    assert total("process_resident_memory_bytes", "") > 0 and total("process_cpu_seconds_total", "") > 0
    assert 0 < total("ksow_rocksdb_memory_bytes", "memtables", key="part") <= 2 * (256 << 20)
    assert 30 <= total("ksow_cached_records", "") <= 2 * 200_000
    # `ksow status` (Client.status): each worker's partitions of the topic, together all 4, 30 records
    # between them, nothing left to apply, and their memory.
    status = client.status()
    assert sorted(w["url"] for w in status) == sorted(w["url"] for w in workers) and not any("error" in w for w in status)
    served = [p for w in status for p in w["topics"][topic]["partitions"]]
    assert sorted(served) == [0, 1, 2, 3]
    assert sum(w["topics"][topic]["records"] for w in status) == 30 and all(w["topics"][topic]["input_lag"] == 0 for w in status)
    assert all(w["rss_bytes"] > 0 and w["rocksdb_bytes"]["memtables"] > 0 for w in status)


def test_a_delete_matching_more_than_a_worker_answers_is_sent_uncounted(kafka_bootstrap, unique_name, tmp_path):
    """Review: with a wait, a delete counts the records it matches first; past KSOW_QUERY_MAX_ROWS
    that query failed, and the delete was never sent. It is sent, and said to be uncounted."""
    path = write_topology(tmp_path, unique_name, partitions=2)
    group = f"g-{unique_name}"
    worker = Worker(kafka_bootstrap, path, group, tmp_path / "d", "w", env={"KSOW_QUERY_MAX_ROWS": "5"}).start()
    try:
        client = Client(kafka_bootstrap, load_topology(path), group)
        for i in range(8):
            client.publish(unique_name, {"id": i})
        client.flush()
        wait_until(lambda: len(client.query(unique_name, filter="/id >= 4")) == 4 and client.last_query_source == "workers", timeout=60)
        assert client.delete(unique_name, filter="1=1", wait=30) is None
        assert "matched more than 5 records (KSOW_QUERY_MAX_ROWS)" in client.last_delete_uncounted
        wait_until(lambda: client.query(unique_name, filter="/id < 4") == client.query(unique_name, filter="/id >= 4") == [], timeout=60)
        assert client.delete(unique_name, filter="1=1", wait=5) == 0 and client.last_delete_uncounted is None
    finally:
        worker.kill()


def test_a_delete_of_more_keys_than_the_limit_deletes_them_all(kafka_bootstrap, unique_name, tmp_path, monkeypatch):
    """The client refused a delete of more SowKeys than KSOW_MAX_DELETE_KEYS; it sends them as
    several sow_deletes within the limit, the lowest of its own and its workers' (the worker's 4
    here, which it announces; the client's is the default 10,000): 11 keys, 3 messages, all deleted
    and counted, none on `.errors`."""
    path = write_topology(tmp_path, unique_name, partitions=2)
    group = f"g-{unique_name}"
    worker = Worker(kafka_bootstrap, path, group, tmp_path / "d", "w", env={"KSOW_MAX_DELETE_KEYS": "4"}).start()
    monkeypatch.delenv("KSOW_MAX_DELETE_KEYS", raising=False)
    try:
        client = Client(kafka_bootstrap, load_topology(path), group)
        keys = [client.publish(unique_name, {"id": i}) for i in range(15)]
        client.flush()
        wait_until(lambda: len(client.query(unique_name)) == 15 and client.last_query_source == "workers", timeout=60)
        assert client.delete(unique_name, keys=keys[:11], wait=30) == 11 and client.last_delete_pending == 0
        assert sorted(e.sow_key for e in client.query(unique_name)) == sorted(keys[11:])
        requests = [m for m in read_all(kafka_bootstrap, unique_name, 2) if headers_of(m).get("sow-command") == "sow_delete"]
        assert sorted(len(headers_of(m)["sow-keys"].split(",")) for m in requests) == [3, 4, 4]
        assert read_all(kafka_bootstrap, f"{unique_name}.errors", 2) == []
    finally:
        worker.kill()


def test_a_topic_pattern_queries_every_topic_and_view_it_matches(cluster):
    """A query's topic may be a regular expression over the SOW topics and views (AMPS): each
    entry names its topic, and order_by and top apply to all of them together."""
    topic, client = cluster
    _load(client, topic, 12)  # the view <topic>_held holds ids 2, 5, 8 and 11, with only /qty
    rows = client.query(f"{topic}.*", filter="/qty >= 6", order_by="/qty DESC", top=4)
    assert [r.record["qty"] for r in rows] == [11, 11, 10, 9]
    # One record through the topic and the view: a tie of one SowKey, in topic name order.
    assert [(r.topic, tuple(r.record)) for r in rows[:2]] == [(topic, ("id", "status", "region", "desk", "qty")), (f"{topic}_held", ("id", "qty"))]
    assert rows[0].as_dict()["topic"] in (topic, f"{topic}_held")
    assert all(r.topic is None and "topic" not in r.as_dict() for r in client.query(topic, top=2))
    with pytest.raises(Exception, match="is not a SOW topic"):
        client.query(f"{topic}x.*")
