"""The HTTP endpoint's decisions: bind address, bearer token, TLS settings, registry entries."""

import asyncio
import shutil
import subprocess

import orjson
import pytest

from processor.contract.errors import ConfigError
from processor.kafka.registry import announcement, entry_problem
from processor.runners.faust.web import CallerTurns, WebSettings, authorized, web_bind_address


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "10.1.2.3", "worker-7.internal", "::1"])
def test_binds_exactly_the_host_asked(host):
    assert web_bind_address(WebSettings(8080, host)) == host


def test_bind_can_differ_from_the_announced_host():
    settings = WebSettings(8080, "worker-7.example.com", bind="0.0.0.0")
    assert web_bind_address(settings) == "0.0.0.0" and settings.url == "http://worker-7.example.com:8080"


def test_settings_from_environment_and_options(monkeypatch):
    monkeypatch.setenv("KSOW_WEB_HOST", "envhost")
    monkeypatch.setenv("KSOW_WEB_TOKEN", "s3cret")
    monkeypatch.setenv("KSOW_QUERY_MAX_ROWS", "5")
    settings = WebSettings.from_env(9000)
    assert (settings.host, settings.token, settings.limits.max_rows) == ("envhost", "s3cret", 5)
    assert WebSettings.from_env(9000, host="opt", token="t2").token == "t2"
    assert WebSettings(9000, "::1").url == "http://[::1]:9000"


@pytest.mark.parametrize(
    "header,ok",
    [("Bearer s3cret", True), ("bearer s3cret", True), ("Bearer wrong", False), ("Bearer ", False),
     ("Basic s3cret", False), (None, False), ("s3cret", False)],
)
def test_token_is_required_when_set(header, ok):
    assert authorized("s3cret", header) is ok
    assert authorized(None, header) is True  # no token configured: open, as before


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_settings(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost"], check=True, capture_output=True)
    settings = WebSettings(8443, "localhost", cert=str(cert), key=str(key))
    assert settings.url == "https://localhost:8443" and settings.ssl_context() is not None
    assert WebSettings(8080).ssl_context() is None
    with pytest.raises(ConfigError, match="cannot use --web-cert"):
        WebSettings(8443, cert=str(tmp_path / "missing.pem")).ssl_context()
    with pytest.raises(ConfigError, match="needs --web-cert"):
        WebSettings.from_env(8443, key=str(key))


def _entry(**changes):
    key, value = announcement("g", "http://10.0.0.5:8080", {"orders": [0, 1]})
    entry = {**orjson.loads(value), **changes}
    return key, entry


def test_a_worker_written_entry_is_valid():
    assert entry_problem(*_entry()) is None
    key, value = announcement("g", "http://10.0.0.5:8080", {"orders": [0, 1]}, max_delete_keys=500)
    entry = orjson.loads(value)
    assert entry["max_delete_keys"] == 500 and entry_problem(key, entry) is None


@pytest.mark.parametrize(
    "changes,problem",
    [
        ({"url": "file:///etc/passwd"}, "scheme"),
        ({"url": "http://10.0.0.5"}, "no host and port"),
        ({"url": "http://10.0.0.5:99999"}, "out of range"),
        ({"url": "http://10.0.0.5:0"}, "port 0"),
        ({"url": "http://user:pw@10.0.0.5:8080"}, "more than scheme, host and port"),
        ({"url": "http://10.0.0.5:8080/evil?x=1"}, "more than scheme, host and port"),
        ({"url": 42}, "no url"),
        ({"group": None}, "no group"),
        ({"at": "now"}, "no integer 'at'"),
        ({"topics": ["orders"]}, "no topics"),
        ({"topics": {"orders": [0, -1]}}, "partitions"),
        ({"topics": {"orders": "all"}}, "partitions"),
        ({"group": "other"}, "key is not <group>|<url>"),
        ({"max_delete_keys": 0}, "max_delete_keys"),
        ({"max_delete_keys": "10"}, "max_delete_keys"),
        ({"max_delete_keys": True}, "max_delete_keys"),
    ],
)
def test_bad_entries_say_why(changes, problem):
    assert problem in entry_problem(*_entry(**changes))


@pytest.mark.parametrize("entry", [None, [], "x", 3])
def test_entries_that_are_not_objects(entry):
    assert entry_problem(b"k", entry) == "not a JSON object"


def test_a_request_aiohttp_cannot_parse_is_one_warning_line_not_a_traceback():
    """A GET over aiohttp's 8 KB request line was logged at ERROR with a traceback (any caller
    could fill a worker's log that way); a handler's own failure keeps its traceback."""
    import logging
    import sys

    from aiohttp.http_exceptions import LineTooLong

    from processor.runners.faust.web import MalformedRequests

    def record(exc):
        try:
            raise exc
        except Exception:
            info = sys.exc_info()
        return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s", ("127.0.0.1",), info)

    bad = record(LineTooLong("GET /sow/x?filter=aaaa", "8190"))
    assert MalformedRequests().filter(bad)
    assert (bad.levelno, bad.exc_info) == (logging.WARNING, None)
    assert bad.getMessage().startswith("refused a malformed HTTP request: Error handling request from 127.0.0.1: Got more than 8190 bytes")
    failed = record(TypeError("a bug"))
    assert MalformedRequests().filter(failed) and failed.levelno == logging.ERROR and failed.exc_info is not None


def test_accept_errors_are_told_once_a_minute_and_other_loop_errors_as_before(caplog):
    from processor.runners.faust.web import AcceptErrors

    class Loop:
        def __init__(self):
            self.default = []

        def default_exception_handler(self, context):
            self.default.append(context)

    handler, loop = AcceptErrors(), Loop()
    with caplog.at_level("ERROR", logger="processor.runners.faust.web"):
        for _ in range(1000):
            handler(loop, {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")})
    assert len(caplog.records) == 1 and "cannot accept connections" in caplog.records[0].getMessage()
    handler(loop, {"message": "Task exception was never retrieved"})
    assert loop.default == [{"message": "Task exception was never retrieved"}]


def test_idle_connections_are_closed_and_busy_ones_kept():
    from processor.runners.faust.web import IDLE_CLOSE_S, Connections

    class Handler:
        def __init__(self, count=0, busy=None):
            self._request_count, self._current_request, self.closed = count, busy, False

        def force_close(self):
            self.closed = True

    idle, working, served = Handler(), Handler(busy=object()), Handler(count=3)
    sweeper = Connections(max_request_s=5.0)
    assert sweeper.sweep([idle, working, served], 0.0) == 0
    served._request_count = 4  # it completed another request: its quiet time starts again
    assert sweeper.sweep([idle, working, served], IDLE_CLOSE_S - 1) == 0
    assert sweeper.sweep([idle, working, served], IDLE_CLOSE_S + 0.5) == 1 and idle.closed and not served.closed
    # a request in progress past the query limit and IDLE_CLOSE_S more: a body sent a byte at a time
    assert sweeper.sweep([working, served], 5.0 + IDLE_CLOSE_S + 1) == 1 and working.closed and not served.closed
    assert sweeper.sweep([served], 2 * IDLE_CLOSE_S) == 1 and served.closed  # idle since its last request


def test_a_new_connection_never_inherits_a_closed_ones_quiet_time():
    """Audit: keyed by id(), a new handler at a closed one's reused address took its record, and
    from 10 s on every new one-request connection was closed at once as idle."""
    from processor.runners.faust.web import Connections

    class Handler:
        def __init__(self):
            self._request_count, self._current_request, self.closed = 1, None, False

        def force_close(self):
            self.closed = True

    sweeper = Connections(max_request_s=5.0)
    for second in range(30):
        handler = Handler()  # one request each, gone by the next sweep
        sweeper.sweep([handler], float(second))
        assert not handler.closed, second
        del handler


def test_a_client_with_a_token_takes_only_entries_signed_with_it():
    """Audit: anyone who may write to `__ksow_workers` could announce their own URL for the
    workers' group, and every client sent its KSOW_WEB_TOKEN there (and took its answers). A worker
    with a token signs its entry with it; a client with a token skips any entry not so signed."""
    from processor.kafka.registry import signed

    key, value = announcement("g", "http://10.0.0.5:8080", {"orders": [0, 1]}, token="s3cret")
    entry = orjson.loads(value)
    assert entry_problem(key, entry) is None and signed("s3cret", key, entry)
    assert not signed("other", key, entry)
    _, forged = _entry(url="http://evil.example:80")
    assert entry_problem(b"g|http://evil.example:80", forged) is None  # well formed, but
    assert not signed("s3cret", b"g|http://evil.example:80", forged)  # not the workers'
    # the signature of a real entry does not carry over to another URL, group, partitions or time
    for changes in ({"url": "http://evil.example:80"}, {"group": "h"}, {"topics": {"orders": [0, 1, 2]}}, {"at": entry["at"] + 1}):
        moved = {**entry, **changes}
        assert not signed("s3cret", f"{moved['group']}|{moved['url']}".encode(), moved), changes
    assert not signed("s3cret", key, {**entry, "sig": 42})
    deep: object = 1
    for _ in range(400):
        deep = [deep]
    assert not signed("s3cret", key, {**entry, "extra": deep})  # junk makes no error either


def test_query_threads_go_to_the_waiting_callers_in_turn():
    """One thread, caller a asking four queries at once and b one after them: b has the second turn,
    not the fifth (a single line in arrival order put it behind all of a's)."""
    async def scenario() -> list[str]:
        turns, served = CallerTurns(1), []

        async def query(caller: str) -> None:
            assert await turns.acquire(caller, 5)
            served.append(caller)
            await asyncio.sleep(0.01)
            turns.release()

        tasks = [asyncio.create_task(query("a")) for _ in range(4)]
        await asyncio.sleep(0)  # a's first holds the thread, its other three wait
        tasks.append(asyncio.create_task(query("b")))
        await asyncio.gather(*tasks)
        return served

    assert asyncio.run(scenario()) == ["a", "a", "b", "a", "a"]


def test_a_query_that_waited_out_its_limit_leaves_the_line_and_a_thread_handed_to_a_gone_request_goes_on():
    async def scenario() -> None:
        turns = CallerTurns(1)
        assert await turns.acquire("a", 1)
        assert not await turns.acquire("b", 0.05)  # waited its limit: answered 503
        turns.release()
        assert await asyncio.wait_for(turns.acquire("c", 1), 0.1)  # free at once: b left no place behind
        gone = asyncio.create_task(turns.acquire("d", 5))
        await asyncio.sleep(0)
        turns.release()  # handed to d ...
        gone.cancel()  # ... whose request went away before it resumed
        try:
            if await gone:  # Python 3.11's wait_for hands the thread over all the same: the handler's finally releases it
                turns.release()
        except asyncio.CancelledError:  # later Pythons cancel: the thread goes on by itself
            pass
        assert await asyncio.wait_for(turns.acquire("e", 1), 0.1)

    asyncio.run(scenario())


def test_input_lag_is_each_owned_input_partitions_end_less_its_committed_offset():
    """`ksow_input_lag` by SOW topic: over the input partitions the worker owns (its `<topic>`,
    `.delta` and `.repartition`), the end of each as of its last fetch less its committed offset;
    a partition with nothing committed yet counts nothing. Measured on the loop thread, at most once
    a second; /metrics reads the last measure."""
    from types import SimpleNamespace

    from processor.runners.faust.loop import SowLoop

    ends = {("o", 0): 120, ("o.delta", 0): 7, ("o.repartition", 0): 3, ("t", 0): 9, ("t.delta", 0): 4}
    consumer = SimpleNamespace(get_watermark_offsets=lambda tp, cached: (0, ends[(tp.topic, tp.partition)]))
    task = lambda name, inputs: SimpleNamespace(engine=SimpleNamespace(spec=SimpleNamespace(topic=name)), inputs=inputs)  # noqa: E731
    loop = SimpleNamespace(consumer=consumer, _committed={("o", 0): 100, ("o.delta", 0): 7, ("t", 0): 4},
                           tasks={1: task("o", [("o", 0), ("o.delta", 0), ("o.repartition", 0)]), 2: task("t", [("t", 0), ("t.delta", 0)])},
                           _lag={}, _lag_at=0.0)
    SowLoop._measure_lag(loop)
    assert loop._lag == {"o": 20, "t": 5} and SowLoop.input_lag(loop) is loop._lag
    ends[("o", 0)] = 500
    SowLoop._measure_lag(loop)  # within the second: not measured again
    assert loop._lag == {"o": 20, "t": 5}
