"""What the client says when its messages cannot be delivered (no broker needed)."""

import pytest
from confluent_kafka import KafkaError

from processor.client.sow_client import Client, SowEntry


def test_a_flush_that_times_out_names_the_cause_not_the_brokers_being_down():
    client = Client("127.0.0.1:1")
    auth = KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error: Authentication failed")
    client._remember_error(auth)
    client._remember_error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    assert client._kafka_error is auth
    # a later real cause still replaces the earlier one
    refused = KafkaError(KafkaError._TRANSPORT, "Connection refused")
    client._remember_error(refused)
    assert client._kafka_error is refused


def test_brokers_down_is_kept_when_nothing_else_was_reported():
    client = Client("127.0.0.1:1")
    down = KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down")
    client._remember_error(down)
    assert client._kafka_error is down


def test_close_lets_the_producer_go_and_a_later_publish_makes_a_new_one():
    client = Client("127.0.0.1:1")
    first = client.producer
    client.close()  # nothing queued: the flush returns at once
    assert client._producer is None
    assert client.producer is not first
    client.close()


def test_values_json_cannot_carry_are_refused_before_anything_is_sent():
    """NaN and infinities would go out as null; an integer past 64 bits as a float, which could give
    two order IDs one SowKey. The client refuses both and says which field."""
    import pytest

    from processor.client.sow_client import ClientError

    client = Client("127.0.0.1:1")
    with pytest.raises(ClientError, match=r"field /legs/1/px is nan"):
        client.publish("orders", {"order_id": 1, "legs": [{"px": 1.5}, {"px": float("nan")}]})
    with pytest.raises(ClientError, match=r"field /order_id is inf"):
        client.publish("orders", {"order_id": float("inf")})
    with pytest.raises(ClientError, match=r"integer 123456789012345678901234567890 is outside the 64-bit range"):
        client.publish("orders", '{"order_id": 123456789012345678901234567890}')
    assert client._producer is None  # nothing was produced


def test_a_sow_key_on_a_topic_with_key_fields_is_refused_not_ignored():
    """The worker makes the SowKey from /order_id whatever the header says: publishing would
    quietly file the record under another key than the one the caller chose."""
    import pytest

    from processor.client.sow_client import ClientError

    client = Client("127.0.0.1:1")
    with pytest.raises(ClientError, match=r"orders makes each SowKey from the record's key fields \(/order_id\)"):
        client.publish("orders", {"order_id": 3}, sow_key="abc")
    with pytest.raises(ClientError, match="blank filter would delete every record"):
        client.delete("orders", filter="  ")
    # Newcomer audit: data beside a filter was dropped without a word (the CLI refuses the same)
    with pytest.raises(ClientError, match="exactly one of filter, keys or data"):
        client.delete("orders", filter="/order_id = 9", data={"order_id": 1})
    with pytest.raises(ClientError, match="exactly one of filter, keys or data"):
        client.delete("orders")
    with pytest.raises(ClientError, match="empty key list"):
        client.delete("orders", keys=[])
    assert client._producer is None  # nothing was produced


def test_a_view_name_reads_its_topic_through_the_view_filter_and_select_list():
    import pytest

    from processor.client.sow_client import ClientError
    from processor.topology import parse_topology

    topology = parse_topology({"sow": [{"topic": "orders", "key": ["/order_id"]}], "views": [
        {"name": "big", "topic": "orders", "filter": "/qty > 10", "select": ["/qty", "/status"]}]})
    client = Client("127.0.0.1:1", topology)
    assert client._through_view("big", None, None) == ("orders", "/qty > 10", ["/qty", "/status"])
    assert client._through_view("big", "/status = 'open'", ["/qty"]) == ("orders", "(/qty > 10) AND (/status = 'open')", ["/qty"])
    assert client._through_view("orders", "/a = 1", None) == ("orders", "/a = 1", None)
    with pytest.raises(ClientError, match=r"/px not in the select list of view big"):
        client._through_view("big", None, ["/qty", "/px"])
    assert client._through_view("big", None, ["/order_id", "/qty"])[2] == ["/order_id", "/qty"]  # key fields are in every view record
    # the caller's filter reads the view's records: a field the select list hides is NULL to it
    assert client._through_view("big", "/px > 5 OR /order_id = 1", None)[1] == "(/qty > 10) AND (NULL > 5 OR /order_id = 1)"
    assert client._through_view("big", None, None, "/qty DESC")[0] == "orders"
    with pytest.raises(ClientError, match=r"/px not in the select list of view big"):
        client._through_view("big", None, None, "/px DESC")
    with pytest.raises(ValueError, match="'big' is a view of the SOW topic 'orders': query or subscribe to the view, publish to or delete from 'orders'"):
        client.publish("big", {"order_id": 1})


def test_a_filter_given_with_a_view_must_parse_on_its_own():
    """Joined as text, '1=1) OR (1=1' closed the view's parenthesis and returned every record of
    the topic; errors pointed into the joined text."""
    import pytest

    from processor.core.filters import FilterError
    from processor.topology import parse_topology

    topology = parse_topology({"sow": [{"topic": "orders", "key": ["/order_id"]}], "views": [
        {"name": "open", "topic": "orders", "filter": "/status = 'open'"}]})
    client = Client("127.0.0.1:1", topology)
    with pytest.raises(FilterError) as escape:
        client._through_view("open", "1=1) OR (1=1", None)
    assert escape.value.position == 3
    with pytest.raises(FilterError) as bad:
        client._through_view("open", "/qty > 1\n  AND /px >> 3", None)
    assert bad.value.position == 20 and "(line 2, column 12)" in str(bad.value)
    assert client._through_view("open", "/a = 1 OR /b = 2", None)[1] == "(/status = 'open') AND (/a = 1 OR /b = 2)"


def test_a_record_nested_past_the_bound_is_refused_by_the_client_as_by_the_worker():
    import pytest

    from processor.client.sow_client import ClientError

    client = Client("127.0.0.1:1")
    deep: object = 1
    for _ in range(200):
        deep = [deep]
    with pytest.raises(ClientError, match="deeper than 200 levels"):
        client.publish("orders", {"order_id": 1, "a": deep})
    with pytest.raises(ClientError, match="deeper than 200 levels"):
        client.publish("orders", '{"order_id": 1, "a": ' + "[" * 200 + "1" + "]" * 200 + "}")
    assert client._producer is None


def test_keys_that_are_no_sowkeys_are_refused_by_a_query_as_by_a_delete():
    """Audit: `ksow query --keys 'a b'` matched nothing without a word, where delete refused it."""
    import pytest

    from processor.client.sow_client import ClientError

    client = Client("127.0.0.1:1")
    for call in (client.query, client.delete):
        with pytest.raises(ClientError, match="Base64"):
            call("orders", keys=["10646205654257188313", "a b"])
        with pytest.raises(ClientError, match="a list of SowKeys, not one string"):
            call("orders", keys="10646205654257188313")
    with pytest.raises(ClientError, match="keys names no SowKey"):  # audit: an empty list matched every record
        client.query("orders", keys=[])


class _Workers:
    """Real HTTP servers standing in for workers' /sow endpoints: each answers for the given
    partitions with one record, after `stall` seconds."""

    def __init__(self) -> None:
        self.servers: list = []

    def start(self, partitions: list[int], stall: float = 0.0) -> dict:
        import http.server
        import threading
        import time

        import orjson

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                time.sleep(stall)
                body = orjson.dumps({"partitions": partitions, "results": [{"sow_key": "1", "record": {"order_id": 1}}]})
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.servers.append(server)
        return {"url": f"http://127.0.0.1:{server.server_address[1]}", "topics": {"orders": partitions}}

    def stop(self) -> None:
        for server in self.servers:
            server.shutdown()


def test_a_query_is_answered_once_the_answers_cover_every_partition():
    """Audit: a query just after a worker was stopped (SIGSTOP) waited the 30 s HTTP timeout for it,
    though the group had moved its partitions to the others: the answers that cover every partition
    are enough. One worker answers for every partition, one never answers."""
    import time

    workers = _Workers()
    client = Client("127.0.0.1:1")
    client._registry = (time.monotonic(), [workers.start(list(range(8)), stall=20), workers.start(list(range(8)))])
    began = time.monotonic()
    try:
        rows = client.query("orders")
    finally:
        workers.stop()
    assert [row.record for row in rows] == [{"order_id": 1}] and client.last_query_source == "workers"
    assert time.monotonic() - began < 5


def test_a_worker_silent_past_its_query_limit_is_given_up_and_its_partitions_asked_again(monkeypatch):
    """Audit: a query asked just after a worker stalled waited the client's 30 s HTTP timeout for
    it, though the worker answers within KSOW_QUERY_MAX_SECONDS or not at all; the group had moved
    its partitions after ~10 s. Now the client gives up on it 5 s past that limit and asks again."""
    import time

    monkeypatch.setenv("KSOW_QUERY_MAX_SECONDS", "0.2")
    workers = _Workers()
    stalled, half, every = workers.start([0, 1, 2, 3], stall=30), workers.start([4, 5, 6, 7]), workers.start(list(range(8)))
    client = Client("127.0.0.1:1")
    # The registry first lists the stalled worker beside one serving the other half; read again, the
    # group has moved the stalled worker's partitions.
    monkeypatch.setattr(client, "_workers", lambda fresh=False: [every] if fresh else [stalled, half])
    began = time.monotonic()
    try:
        rows = client.query("orders")
    finally:
        workers.stop()
    assert [row.record for row in rows] == [{"order_id": 1}]
    assert time.monotonic() - began < 12  # 5.2 s for the stalled worker, then the fresh registry's answer


def test_a_registry_cached_before_the_workers_announced_is_read_again(monkeypatch):
    """A query that found no worker in the registry it had cached (read before they announced the
    topic, up to REGISTRY_CACHE_S ago) fell back to reading `.sow` without reading the registry
    again (a flaky integration test: answered from the changelog right after the workers started)."""
    workers = _Workers()
    every = workers.start(list(range(8)))
    client = Client("127.0.0.1:1")
    monkeypatch.setattr(client, "_workers", lambda fresh=False: [every] if fresh else [])
    try:
        rows = client.query("orders")
    finally:
        workers.stop()
    assert [row.record for row in rows] == [{"order_id": 1}] and client.last_query_source == "workers"


def test_a_worker_certificate_the_client_does_not_trust_is_an_error_not_a_quiet_fallback(tmp_path):
    """Audit: without KSOW_WEB_CA a query of HTTPS workers read the changelog instead, saying
    nothing; with the CA it is answered by the worker."""
    import http.server
    import ssl
    import threading

    from processor.client.sow_client import _http_json, _tls_context
    from processor.kafka.certs import make_server_tls

    tls = make_server_tls(tmp_path)

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"partitions": [], "results": []}')

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.keystore)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"https://127.0.0.1:{server.server_address[1]}/sow/orders"
        refused = _http_json(url, timeout=10)
        assert "its HTTPS certificate is not trusted" in refused["error"] and "KSOW_WEB_CA" in refused["error"]
        assert _http_json(url, tls=_tls_context(str(tls.ca)), timeout=10) == {"partitions": [], "results": []}
        assert _http_json("https://127.0.0.1:1/sow/orders", timeout=5) is None  # a worker gone: its partitions are asked again
    finally:
        server.shutdown()


class _Unanswered:
    """A Kafka handle whose metadata calls time out; its error callbacks are told `errors` one per
    poll (what librdkafka serves them from)."""

    def __init__(self, client: Client, errors: list):
        self.client, self.errors, self.tries = client, errors, 0

    def list_topics(self, topic, timeout=None):
        from confluent_kafka import KafkaException

        self.tries += 1
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Local: Broker transport failure"))

    def poll(self, timeout=None):
        if self.errors:
            self.client._remember_error(self.errors.pop(0))


def test_a_refused_login_ends_the_wait_for_a_topics_metadata_at_once():
    """The first look at a topic's metadata waited its whole 10 s before it read the error callbacks.
    A refusal is KafkaRefused, as a query's: one exception for a refused login, whatever the call."""
    import time

    import pytest

    from processor.kafka.clients import KafkaRefused

    client = Client("127.0.0.1:1")
    handle = _Unanswered(client, [KafkaError(KafkaError._TRANSPORT, "Connection refused"),
                                  KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error: Authentication failed")])
    began = time.monotonic()
    with pytest.raises(KafkaRefused, match="Kafka at 127.0.0.1:1 refused this client: SASL authentication error: Authentication failed"):
        client._require(handle, "orders")
    assert handle.tries == 2 and time.monotonic() - began < 1  # a connection refused is not a refusal: tried again


def test_a_cluster_that_does_not_answer_is_waited_for_then_named_with_its_last_error(monkeypatch):
    import time

    import pytest
    from confluent_kafka import KafkaException

    import processor.client.sow_client as sow_client

    monkeypatch.setattr(sow_client, "METADATA_S", 0.3)
    client = Client("127.0.0.1:1")
    handle = _Unanswered(client, [KafkaError(KafkaError._TRANSPORT, "Connection refused")])
    began = time.monotonic()
    with pytest.raises(KafkaException, match="cannot read the metadata of orders: Connection refused"):
        client._require(handle, "orders")
    assert time.monotonic() - began >= 0.3


def test_a_record_too_large_for_one_kafka_message_is_the_callers_error(monkeypatch):
    """librdkafka refuses it in produce(): the KafkaException ended `ksow publish -` without naming
    the line or delivering the lines before it ("Producer terminating with 2 messages still in queue")."""
    import pytest
    from click.testing import CliRunner

    from processor.cli.commands import main
    from processor.client.sow_client import ClientError

    monkeypatch.setattr(Client, "_require", lambda self, handle, name: None)  # no broker: the size is checked locally
    record = {"order_id": 1, "v": "x" * 1_100_000}
    client = Client("127.0.0.1:1")
    with pytest.raises(ClientError, match=r"record of 1,100,0\d\d bytes is too large for one Kafka message"):
        client.publish("orders", record)
    with pytest.raises(ClientError, match="too large for one Kafka message"):
        client.delete("orders", data=record)
    with pytest.raises(ClientError, match=r"sow_delete \(its headers\) is too large for one Kafka message"):
        client.delete("orders", keys=[f"K{i:04}" + "x" * 1000 for i in range(2000)])
    import orjson

    result = CliRunner().invoke(main, ["publish", "orders", "--bootstrap", "127.0.0.1:1", "-"], input=orjson.dumps(record) + b"\n")
    assert result.exit_code == 1 and "line 1: record of" in result.output and "nothing was published" in result.output


@pytest.mark.parametrize("expiration, ms", [(1e-5, 1), (2e-7, 1), (1.5, 1500), (7, 7000), ("30s", 30_000)])
def test_a_lifetime_given_as_a_number_reaches_the_worker_as_one_it_reads(monkeypatch, expiration, ms):
    """str(1e-05) is '1e-05', which is no duration: the client accepted expiration=1e-5 and the worker
    put the record on .errors ("bad sow-expiration header")."""
    from processor.contract.types import Command
    from processor.core.commands import header_map, parse_command

    sent = []
    monkeypatch.setattr(Client, "_require", lambda self, handle, name: None)
    monkeypatch.setattr(Client, "_send", lambda self, topic, value, key, headers: sent.append((value, headers)))
    client = Client("127.0.0.1:1")
    client.publish("orders", {"order_id": 1}, expiration=expiration)
    spec = client.spec("orders")
    value, headers = sent[0]
    assert parse_command(spec.key_spec, client.codec(spec), Command.PUBLISH, value, header_map(headers)).expiration_ms == ms


def _sending_deletes(monkeypatch) -> tuple[Client, list]:
    """A client whose deletes are kept in a list as (topic, value, key, headers) instead of sent."""
    sent = []
    monkeypatch.setattr(Client, "_require", lambda self, handle, name: None)
    monkeypatch.setattr(Client, "_send", lambda self, topic, value, key, headers: sent.append((topic, value, key, headers)))
    monkeypatch.setattr(Client, "_workers", lambda self, fresh=False: [])
    return Client("127.0.0.1:1"), sent


def test_more_keys_than_a_worker_takes_in_one_delete_go_as_several_deletes(monkeypatch):
    """A delete of more SowKeys than KSOW_MAX_DELETE_KEYS was refused by the client (a worker puts
    such a sow_delete on .errors): a user asking to delete 20,000 keys expects them deleted. They go
    as several sow_deletes of at most the limit each, in the order given, as one delete by keys
    goes (no Kafka key, no value), each one a worker with that limit accepts."""
    from processor.contract.types import Command
    from processor.core.commands import header_map, parse_command

    monkeypatch.setenv("KSOW_MAX_DELETE_KEYS", "3")
    client, sent = _sending_deletes(monkeypatch)
    assert client.delete("orders", keys=["a", "b", "c", "d", "b", "e", "f", "g"]) is None
    spec = client.spec("orders")
    parsed = [parse_command(spec.key_spec, client.codec(spec), Command.PUBLISH, value, header_map(headers))
              for _, value, _, headers in sent]
    assert [c.keys for c in parsed] == [("a", "b", "c"), ("d", "e", "f"), ("g",)]
    assert {(topic, value, key) for topic, value, key, _ in sent} == {("orders", None, None)}
    assert all(c.command is Command.SOW_DELETE for c in parsed)
    sent.clear()
    client.delete("orders", keys=["a", "b", "c"])  # at the limit: one message, as before
    assert len(sent) == 1


def test_a_delete_by_keys_goes_in_sow_deletes_that_every_worker_of_the_topic_takes(monkeypatch):
    """The client splits a delete by the lowest KSOW_MAX_DELETE_KEYS of its own and of the topic's live
    workers' (each announces its own): a client whose limit is higher than a worker's no longer sends
    a sow_delete that worker puts on `.errors`. Workers of other topics, or that announce no limit
    (earlier releases), do not lower it; with no registry to read, the client's own limit holds."""
    from confluent_kafka import KafkaError, KafkaException

    monkeypatch.setenv("KSOW_MAX_DELETE_KEYS", "4")
    client, sent = _sending_deletes(monkeypatch)
    workers = [{"url": "http://a:1", "topics": {"orders": [0]}, "max_delete_keys": 2},
               {"url": "http://b:1", "topics": {"trades": [0]}, "max_delete_keys": 1},
               {"url": "http://c:1", "topics": {"orders": [1]}}]
    monkeypatch.setattr(Client, "_workers", lambda self, fresh=False: workers)
    client.delete("orders", keys=["a", "b", "c", "d", "e"])
    assert [dict(h)["sow-keys"] for _, _, _, h in sent] == [b"a,b", b"c,d", b"e"]
    sent.clear()
    workers[0]["max_delete_keys"] = 9
    client.delete("orders", keys=["a", "b", "c", "d", "e"])
    assert [dict(h)["sow-keys"] for _, _, _, h in sent] == [b"a,b,c,d", b"e"]

    def unreadable(self, fresh=False):
        raise KafkaException(KafkaError(KafkaError._TRANSPORT))

    sent.clear()
    monkeypatch.setattr(Client, "_workers", unreadable)
    client.delete("orders", keys=["a", "b", "c", "d", "e"])
    assert len(sent) == 2


def test_a_chunked_delete_counts_and_reports_pending_over_all_its_messages(monkeypatch):
    """With a wait, the count and `last_delete_pending` cover every message of the delete: here the
    workers applied the first two of three, so the last one's key is pending."""
    from types import SimpleNamespace

    from processor.client import sow_client
    from processor.contract.types import Op

    from .fake_clients import Message

    monkeypatch.setenv("KSOW_MAX_DELETE_KEYS", "2")
    client, sent = _sending_deletes(monkeypatch)
    keys = ["a", "b", "c", "d", "e"]
    monkeypatch.setattr(client, "query", lambda topic, **kw: [SowEntry(k, 1, None, {}) for k in kw["keys"]])
    monkeypatch.setattr(client, "flush", lambda timeout=30.0: None)
    monkeypatch.setattr(client, "_parse", lambda codec, msg: SimpleNamespace(op=Op.DELETE, key=msg.key().decode()))
    monkeypatch.setattr(sow_client, "end_offsets", lambda consumer, topic, partitions: {})

    class Consumer:
        def assign(self, partitions):
            pass

        def consume(self, n, timeout):
            applied = [k for _, _, _, headers in sent[:2] for k in dict(headers)["sow-keys"].decode().split(",")]
            return [Message("orders.sow", 0, key=k.encode()) for k in applied]

        def close(self):
            pass

    monkeypatch.setattr(sow_client, "make_consumer", lambda *a, **kw: Consumer())
    assert client.delete("orders", keys=keys, wait=0.3) == 4
    assert len(sent) == 3 and client.last_delete_pending == 1


def test_a_chunked_delete_that_fails_midway_says_how_many_messages_went(monkeypatch):
    from processor.client.sow_client import ClientError

    monkeypatch.setenv("KSOW_MAX_DELETE_KEYS", "1")
    client, sent = _sending_deletes(monkeypatch)

    def send(topic, value, key, headers):
        if len(sent) == 2:
            raise ClientError("sow_delete (its headers) is too large for one Kafka message")
        sent.append(headers)

    monkeypatch.setattr(client, "_send", send)
    with pytest.raises(ClientError, match=r"sow_delete 3 of 4 was not sent \(sow_delete \(its headers\) is too large .*\); the 2 before it were"):
        client.delete("orders", keys=["a", "b", "c", "d"])


def test_a_query_ordered_by_a_field_it_does_not_select_is_ordered_by_that_field(monkeypatch):
    """Audit: `query(select=['/s'], order_by='/q DESC', top=2)` read from `.sow` came back in the
    changelog's order (the client ordered the selected records, which lack /q), and two workers'
    answers merged the same way; one worker answered the two records of highest /q. Every path now
    orders by the field and leaves it out of the records."""
    from processor.client import sow_client
    from processor.contract.types import SowRecord
    from processor.query.engine import SowQuery, order_and_cut, result, selection
    from processor.topology import Topology

    topology = Topology.model_validate({"sow": [{"topic": "t", "key": ["/id"], "partitions": 2}]})
    records = {f"k{i}": {"id": i, "s": f"s{i}", "n": {"q": q}} for i, q in enumerate([1, 5, None, 3, 4, 2])}
    client = Client("127.0.0.1:1", topology)
    monkeypatch.setattr(client, "_workers", lambda fresh=False: [])

    class Consumer:
        def close(self):
            pass

    state = {key: (record, i + 1, None) for i, (key, record) in enumerate(records.items())}
    monkeypatch.setattr(client, "_snapshot", lambda spec: (state, {}, Consumer(), [], None))
    wanted = [{"id": 1, "s": "s1"}, {"id": 4, "s": "s4"}]
    rows = client.query("t", select=["/s"], order_by="/n/q DESC", top=2)
    assert client.last_query_source == "changelog" and [row.record for row in rows] == wanted

    def answer(url, token, tls, timeout, body):
        """A worker's answer for its half of the records, as run_query makes it."""
        import orjson

        query, half = SowQuery.from_params(orjson.loads(body)), int(url.split("/")[2][1:])
        mine = [(k, SowRecord(r, 1, None)) for k, r in records.items() if r["id"] % 2 == half]
        rows = order_and_cut(mine, query, lambda row: row[1].data, lambda row: row[0])
        select = selection(query, topology.topic("t").key_spec.split)
        return {"partitions": [half], "results": [result(k, r, select) for k, r in rows]}

    monkeypatch.setattr(sow_client, "_http_json", answer)
    monkeypatch.setattr(client, "_workers", lambda fresh=False: [{"url": f"http://w{p}", "topics": {"t": [p]}} for p in (0, 1)])
    rows = client.query("t", select=["/s"], order_by="/n/q DESC", top=2)
    assert client.last_query_source == "workers" and [row.record for row in rows] == wanted
