"""Where the workers are: each worker announces its HTTP address and the SOW partitions it serves
on the compacted topic `__ksow_workers`, so clients can fan a query out to all of them.

An entry is refreshed every few seconds and removed (tombstone) when the worker stops; readers
ignore entries older than STALE_MS, which covers workers that died without saying so.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from urllib.parse import urlsplit

import orjson
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from processor.kafka.clients import answered_metadata, end_offsets, make_consumer, raise_if_refused, read_until, topic_refused

log = logging.getLogger("ksow.registry")

# One per cluster; KSOW_REGISTRY_TOPIC gives a deployment (or a test run) a registry of its own.
REGISTRY_TOPIC = os.environ.get("KSOW_REGISTRY_TOPIC") or "__ksow_workers"
REFRESH_S = 3.0
REGISTRY_WAIT_S = 3.0  # for the cluster to answer a reader of the registry
STALE_MS = 12_000


REGISTRY_TOPICS = {REGISTRY_TOPIC: (1, {"cleanup.policy": "compact", "min.compaction.lag.ms": "0"})}  # as ensure_topics takes them


def announcement(group: str, url: str, served: dict[str, list[int]], token: str | None = None,
                 max_delete_keys: int | None = None) -> tuple[bytes, bytes]:
    """A worker's registry entry; with its web token, signed (`signature`), so that a client holding
    the token sends it only to workers that hold it too. `max_delete_keys` is the worker's
    KSOW_MAX_DELETE_KEYS: a client splits a delete by keys into sow_deletes its workers all take."""
    key = f"{group}|{url}".encode()
    entry: dict = {"group": group, "url": url, "topics": served, "at": int(time.time() * 1000)}
    if max_delete_keys is not None:
        entry["max_delete_keys"] = max_delete_keys
    if token:
        entry["sig"] = signature(token, key, entry)
    return key, orjson.dumps(entry)


def signature(token: str, key: bytes | None, entry: dict) -> str:
    """HMAC-SHA256, keyed with the web token, of an entry's key and its fields but `sig`."""
    fields = orjson.dumps({k: v for k, v in entry.items() if k != "sig"}, option=orjson.OPT_SORT_KEYS)
    return hmac.new(token.encode(), (key or b"") + b"\n" + fields, hashlib.sha256).hexdigest()


def live_workers(bootstrap: str, group: str, token: str | None = None) -> list[dict]:
    """The workers of a group that announced themselves recently, with a valid entry.

    Anything can write to `__ksow_workers`: an entry that is not what a worker writes (see
    `entry_problem`) is skipped and logged once, so a junk entry cannot break queries. With a web
    token, an entry must be signed with it: the client sends the token to the URLs found here."""
    told: list[KafkaError] = []
    consumer = make_consumer(bootstrap, error_cb=told.append)
    try:
        try:
            # A refused login reaches only the error callback (reading the offsets would just time
            # out): the metadata wait stops at once on it.
            answered_metadata(consumer, REGISTRY_TOPIC, REGISTRY_WAIT_S, lambda exc, over: raise_if_refused(bootstrap, told))
            ((_, high),) = end_offsets(consumer, REGISTRY_TOPIC, [0], timeout=REGISTRY_WAIT_S).values()
        except KafkaException as exc:
            if exc.args[0].code() not in _NO_REGISTRY:
                raise  # the cluster cannot be read at all: the caller's read of the SOW would fail too
            refused = topic_refused(consumer, REGISTRY_TOPIC)
            if refused is not None and REGISTRY_TOPIC not in _reported_refusal:
                _reported_refusal.add(REGISTRY_TOPIC)
                log.warning("cannot read %s, where the workers announce themselves (%s): queries read the SOW topics' "
                            "changelogs instead, which is slower; grant this client's user Read on it", REGISTRY_TOPIC, refused.str())
            return []  # else no worker ever announced itself on this cluster
        consumer.assign([TopicPartition(REGISTRY_TOPIC, 0, 0)])
        latest: dict[bytes | None, bytes | None] = {}
        for msg in read_until(consumer, {(REGISTRY_TOPIC, 0): high}):
            latest[msg.key()] = msg.value()
    finally:
        consumer.close()
    now = time.time() * 1000
    workers = []
    for key, value in latest.items():
        if value is None:
            continue
        try:
            entry = orjson.loads(value)
        except orjson.JSONDecodeError:
            entry = None
        problem = entry_problem(key, entry)
        if problem is not None:
            _report(key, value, problem)
        elif entry["group"] == group and now - entry["at"] < STALE_MS:
            if token and not signed(token, key, entry):
                _report(key, b"", "not signed with this client's web token (KSOW_WEB_TOKEN): the token is not sent to its url")
            else:
                workers.append(entry)
    return workers


_MAX_PARTITION = 2**31 - 1
_reported: set[tuple] = set()
_reported_refusal: set[str] = set()
# What reading the registry's offsets fails with when it does not exist (or may not be seen).
_NO_REGISTRY = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                          KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.TOPIC_AUTHORIZATION_FAILED})


def signed(token: str, key: bytes | None, entry: dict) -> bool:
    """Whether a registry entry carries the signature (`sig`) a worker with this web token makes."""
    sig = entry.get("sig")
    if not isinstance(sig, str):
        return False
    try:
        return hmac.compare_digest(sig.encode(), signature(token, key, entry).encode())
    except (orjson.JSONEncodeError, UnicodeEncodeError):  # fields nested deeper than orjson writes, a lone surrogate
        return False


def entry_problem(key: bytes | None, entry: object) -> str | None:
    """Why a registry entry is not one a worker writes (None when it is): a JSON object with a
    string `group`, an http(s) `url` of host and port only, `topics` mapping names to partition
    numbers, an integer `at`, a positive integer `max_delete_keys` if any, and the key
    `<group>|<url>` (see `announcement`)."""
    if not isinstance(entry, dict):
        return "not a JSON object"
    if not isinstance(entry.get("group"), str):
        return "no group"
    at = entry.get("at")
    if not isinstance(at, int) or isinstance(at, bool):
        return "no integer 'at'"
    url = entry.get("url")
    if not isinstance(url, str) or len(url) > 2048:
        return "no url"
    problem = _url_problem(url)
    if problem is not None:
        return f"url {url[:100]!r}: {problem}"
    topics = entry.get("topics")
    if not isinstance(topics, dict):
        return "no topics"
    for name, partitions in topics.items():
        if not isinstance(partitions, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= _MAX_PARTITION for p in partitions
        ):
            return f"topic {str(name)[:100]!r}: partitions are not a list of partition numbers"
    limit = entry.get("max_delete_keys", 1)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        return "max_delete_keys is not a positive integer"
    if key != f"{entry['group']}|{url}".encode():
        return "key is not <group>|<url>"
    return None


def _url_problem(url: str) -> str | None:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port out of range or not a number, a bad IPv6 literal
        return str(exc)
    if parts.scheme not in ("http", "https"):
        return "scheme is not http or https"
    if not parts.hostname or port is None:
        return "no host and port"
    if parts.username is not None or parts.password is not None or parts.path not in ("", "/") or parts.query or parts.fragment:
        return "more than scheme, host and port"
    if not port:
        return "port 0"
    return None


def _report(key: bytes | None, value: bytes, problem: str) -> None:
    """Log a bad entry once per process (clients re-read the registry every few seconds)."""
    seen = (key, value)
    if seen not in _reported:
        _reported.add(seen)
        log.warning("skipped a bad %s entry (key %r): %s", REGISTRY_TOPIC, (key or b"")[:100], problem)
