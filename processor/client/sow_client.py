"""The Python client: publish, delta publish, sow_delete, SOW queries and subscriptions.

Queries and subscriptions read `<topic>.sow`, the compacted changelog the workers write: the SOW
snapshot is read up to the end offsets captured when the call starts, and a subscription goes on
from exactly those offsets, so the snapshot and the live part meet with no gap and no duplicate.
Delta subscriptions compute each delta from consecutive versions of a record with the core's diff.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import orjson
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from processor.contract.errors import InputError
from processor.contract.limits import QUERY_SPAN, max_delete_keys, query_max_seconds
from processor.contract.types import Op, SowRecord
from processor.contract import headers as H
from processor.core.bookmarks import Bookmark, BookmarkError, join_topics, partition_of, split_topics
from processor.core.changelog import MalformedSowMessage, SowMessage, parse_sow_message
from processor.core.codec import Codec, check_integers, check_nesting
from processor.core.durations import parse_duration_ms
from processor.core.expiry import ExpiryPolicy
from processor.core.keys import KeyError_, owner_partition, validate_user_keys
from processor.core.paths import within
from processor.core.subscription import SubscriptionSpec, conflate_event
from processor.kafka.clients import READER_NOISE, answered_metadata, end_offsets, message_headers, make_consumer, make_producer, produce, raise_if_refused, read_until, resolve_bootstrap
from processor.query.engine import QueryError, SowQuery, order_and_cut, order_results, result, selection, through_view
from processor.topology import Persistence, SowTopic, Topology, load_topology, schema_base, topology_path


log = logging.getLogger("ksow.client")

REGISTRY_CACHE_S = 2.0  # how long a client trusts its list of workers (a miss re-reads it at once)
METADATA_S = 10.0  # how long the first look at a topic's metadata waits for a cluster that does not answer


class ClientError(ValueError):
    """A request the client refuses before anything is sent (bad JSON, missing key field...)."""


class TooManyRecords(ClientError):
    """A query that matched more records than a worker answers with (KSOW_QUERY_MAX_ROWS)."""


@dataclass
class SowEntry:
    sow_key: str
    seq: int | None
    expires_at: int | None
    record: dict
    topic: str | None = None  # the SOW topic or view it came from, when the query named its topics by a pattern

    def as_dict(self) -> dict:
        entry = {"sow_key": self.sow_key, "seq": self.seq, "expires_at": self.expires_at, "record": self.record}
        return entry if self.topic is None else {"topic": self.topic, **entry}


class Client:
    def __init__(self, bootstrap: str | None = None, topology: Topology | str | None = None, group: str | None = None,
                 web_token: str | None = None):
        resolved = resolve_bootstrap(bootstrap)
        if not resolved:
            raise ClientError("no Kafka bootstrap: pass --bootstrap or set KAFKA_BOOTSTRAP")
        self.bootstrap = resolved
        self.topology_file = None if isinstance(topology, Topology) else topology_path(topology)  # named in errors
        self.topology = topology if isinstance(topology, Topology) else load_topology(self.topology_file)
        self._codecs: dict[str, Codec] = {}
        self._schemas = schema_base(self.topology_file)  # relative schema paths, as the workers read them
        self._producer = None
        self.group = group or os.environ.get("KSOW_GROUP") or "ksow"
        self.web_token = web_token or os.environ.get("KSOW_WEB_TOKEN") or None  # sent to workers as a bearer token
        self._tls = _tls_context(os.environ.get("KSOW_WEB_CA"))
        self.last_query_source: str | None = None
        self.last_delete_pending = 0  # see delete(wait=...)
        self.last_delete_uncounted: str | None = None
        self.skipped = 0  # malformed `<topic>.sow` records passed over by snapshots and subscriptions
        self._registry: tuple[float, list[dict]] | None = None
        self._kafka_error: KafkaError | None = None
        self._existing: set[str] = set()  # Kafka topics seen to exist (see `_require`)

    # helpers ------------------------------------------------------------------------------
    def spec(self, topic: str) -> SowTopic:
        try:
            return self.topology.topic(topic)
        except ValueError as exc:
            read = f" (topology file {self.topology_file})" if self.topology_file is not None and "not a SOW topic" in str(exc) else ""
            raise ClientError(f"{exc}{read}") from None

    def _through_view(self, name: str, filter: str | None, select: list[str] | None,
                      order_by: str | None = None) -> tuple[str, str | None, list[str] | None]:
        """(SOW topic, filter, select list) that read `name` (a view, or a SOW topic as it is):
        processor.query.engine.through_view, with its refusals as the client's."""
        try:
            return through_view(self.topology, name, filter, select, order_by)
        except QueryError as exc:
            raise ClientError(str(exc)) from None

    def codec(self, spec: SowTopic) -> Codec:
        if spec.topic not in self._codecs:
            self._codecs[spec.topic] = spec.codec(self._schemas)
        return self._codecs[spec.topic]

    @property
    def producer(self):
        if self._producer is None:
            self._producer = make_producer(self.bootstrap, error_cb=self._remember_error)  # it never creates a topic
        return self._producer

    def _require(self, handle, name: str) -> None:
        """Fail at once, naming the topic, when a Kafka topic of the topology does not exist yet:
        otherwise a publish or a read waits 30 s and then reports an unknown partition."""
        if name in self._existing:
            return

        def unanswered(exc: KafkaException, over: bool) -> None:
            error = self._kafka_error  # what the handle's error callbacks were told last
            if error is not None:
                raise_if_refused(self.bootstrap, [error])  # KafkaRefused, as a query's first read raises
                if over:
                    raise KafkaException(KafkaError(exc.args[0].code(), f"cannot read the metadata of {name}: {error.str()}")) from None

        found = answered_metadata(handle, name, METADATA_S, unanswered).topics.get(name)
        if found is None or (found.error is not None and found.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
            raise ClientError(f"Kafka topic {name} does not exist: the workers of this topology create their topics "
                              "when they start (ksow up --topology ...)")
        if found.error is not None and found.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            # else reading its offsets fails only with "unknown partition", after 30 s of retries
            raise ClientError(f"this client is not authorized to use Kafka topic {name} ({found.error.str()}): "
                              "grant its user access to the topic (Kafka ACLs)")
        self._existing.add(name)

    def _remember_error(self, error: KafkaError) -> None:
        """Keep the last error told to the producer's or a reader's error callback: a flush or a
        metadata call that times out says why (refused login, ...).
        "All brokers are down" follows its cause (a refused login, a refused connection) and does
        not replace it (librdkafka before 2.13 reports it after an authentication failure)."""
        if error.code() == KafkaError._ALL_BROKERS_DOWN and self._kafka_error is not None:
            return
        self._kafka_error = error

    def _send(self, topic: str, value: bytes | None, key: bytes | None, headers: list) -> None:
        """produce(), a value librdkafka refuses at once for its size told as the caller's error, as
        a bad record is: `ksow publish -` then names the line and delivers the lines before it."""
        try:
            produce(self.producer, topic, value, key, headers=headers)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                raise
            what = f"record of {len(value):,} bytes" if value else "sow_delete (its headers)"
            raise ClientError(f"{what} is too large for one Kafka message (the producer's message.max.bytes)") from None
        self.producer.poll(0)

    def _encode(self, spec: SowTopic, record: Any) -> tuple[bytes, dict]:
        codec = self.codec(spec)
        if isinstance(record, (bytes, str)):
            raw = record.encode() if isinstance(record, str) else record
            try:
                data = orjson.loads(raw)
                check_integers(raw)
            except orjson.JSONDecodeError as exc:
                raise ClientError(f"not valid JSON: {exc}") from None
            except InputError as exc:
                raise ClientError(str(exc)) from None
        else:
            data = record
            _check_finite(data)
        if not isinstance(data, dict):
            raise ClientError(f"a record must be a JSON object, got {type(data).__name__}")
        try:
            check_nesting(data)  # as the worker's decoding: it would park the record on `.errors`
        except InputError as exc:
            raise ClientError(str(exc)) from None
        if unknown := codec.unknown_fields(data):
            raise ClientError(f"{', '.join(unknown)} not in the Avro schema of {spec.topic} (it would be dropped)")
        try:
            if codec.name == "avro":
                codec.check(data)
            value = codec.encode(data)
            # The SowKey is made from the record as a worker reads it (Avro: logical types as plain values).
            return value, codec.decode(value) if codec.name == "avro" else data
        except (InputError, ValueError, TypeError) as exc:
            raise ClientError(f"record does not fit the {spec.message_type.value} type of {spec.topic}: {exc}") from None

    # publishing ---------------------------------------------------------------------------
    def publish(self, topic: str, record: Any, *, delta: bool = False, expiration: str | int | None = None, sow_key: str | None = None) -> str:
        """Publish a full record (or with delta=True a partial one, a delta publish). Returns its SowKey."""
        spec = self.spec(topic)
        value, data = self._encode(spec, record)
        headers = []
        if expiration is not None:
            try:
                ms = parse_duration_ms(expiration)
            except ValueError as exc:
                raise ClientError(str(exc)) from None
            # A number in milliseconds: str(1e-05) is '1e-05', which no worker reads as a duration.
            text = expiration if isinstance(expiration, str) else f"{ms}ms"
            headers.append((H.EXPIRATION, text.encode()))
        if sow_key:
            if not spec.key_spec.user_keys:  # the worker would ignore it: say so rather than publish
                raise ClientError(f"{topic} makes each SowKey from the record's key fields "
                                  f"({', '.join(spec.key_spec.paths)}); a sow-key is for topics without key fields")
            headers.append((H.KEY, sow_key.encode()))
        elif spec.key_spec.user_keys:
            raise ClientError(f"{topic} has no key fields: give each record's SowKey (sow_key=, --key in the CLI)")
        try:
            key = spec.key_spec.sow_key(data, sow_key)
        except KeyError_ as exc:
            raise ClientError(str(exc)) from None
        if delta:
            # Deltas go to `<topic>` with sow-command, not to `<topic>.delta`: in the same partition as
            # this publisher's full publishes of the record, they are applied in the order sent,
            # whatever the timestamps (README "Ordering").
            headers.append((H.COMMAND, b"delta_publish"))
        self._require(self.producer, spec.topic)
        self._send(spec.topic, value, key.encode(), headers)
        return key

    def delete(self, topic: str, *, filter: str | None = None, keys: list[str] | None = None, data: Any = None, wait: float | None = None) -> int | None:
        """sow_delete by filter, by SowKeys or by data (the record the data would have updated).

        With `wait` (seconds), also returns how many records the workers deleted: the records that
        matched when the delete was sent and whose delete events then appeared on `<topic>.sow`;
        `last_delete_pending` says how many of them had not when the wait ended (no worker running,
        or one behind: the delete stays on the input topic and is applied when one gets to it).
        When more records match than a worker answers a query with (KSOW_QUERY_MAX_ROWS), the
        delete is sent without being counted: it returns None and `last_delete_uncounted` says why.

        More `keys` than KSOW_MAX_DELETE_KEYS (the lowest of this client's and the topic's live
        workers', `_delete_keys_cap`) go as several sow_delete messages of at most that many each, in the order given
        (a SowKey named twice is sent once), each sent and routed as one delete by keys is; the
        count and `last_delete_pending` cover them all.
        """
        if sum(x is not None for x in (filter, keys, data)) != 1:
            raise ClientError("give exactly one of filter, keys or data")
        spec = self.spec(topic)
        command = (H.COMMAND, b"sow_delete")
        messages = [[command]]  # the headers of each message the delete is sent as
        value = None
        key = None
        self.last_delete_pending = 0
        self.last_delete_uncounted = None
        if filter is not None:
            from processor.core.filters import compile_filter

            if not filter.strip():
                raise ClientError("a blank filter would delete every record: say '1=1' to mean that")
            compile_filter(filter)  # raises FilterError pointing at the position
            messages[0].append((H.FILTER, filter.encode()))
        elif keys is not None:
            if not keys:
                raise ClientError("an empty key list deletes nothing: give at least one SowKey")
            _check_keys(keys)
            keys = list(dict.fromkeys(keys))
            # A worker puts a sow_delete listing more than its limit on `.errors`: send several.
            cap = self._delete_keys_cap(spec) if len(keys) > 1 else 1
            messages = [[command, (H.KEYS, ",".join(keys[i:i + cap]).encode())] for i in range(0, len(keys), cap)]
        else:
            value, record = self._encode(spec, data)
            try:
                key = spec.key_spec.sow_key(record).encode()
            except KeyError_ as exc:
                raise ClientError(str(exc)) from None
        self._require(self.producer, spec.topic)
        if wait is None:
            self._send_each(spec.topic, value, key, messages)
            return None
        try:
            targets = {e.sow_key for e in self.query(topic, filter=filter, keys=keys or ([key.decode()] if key else None))}
        except TooManyRecords as exc:
            self._send_each(spec.topic, value, key, messages)
            self.flush()
            self.last_delete_uncounted = str(exc)
            return None
        consumer = make_consumer(self.bootstrap)
        try:
            ends = end_offsets(consumer, spec.sow_topic, range(spec.partitions))
            consumer.assign([TopicPartition(spec.sow_topic, p, high) for p, (_, high) in ends.items()])
            self._send_each(spec.topic, value, key, messages)
            self.flush()
            deleted: set[str] = set()
            deadline = time.monotonic() + wait
            while deleted < targets and time.monotonic() < deadline:
                for msg in consumer.consume(500, 0.2):
                    if msg.error() is None and msg.value() is None:
                        change = self._parse(self.codec(spec), msg)
                        if change is not None and change.op is Op.DELETE and change.key in targets:
                            deleted.add(change.key)
            self.last_delete_pending = len(targets - deleted)
            return len(deleted)
        finally:
            consumer.close()

    def status(self) -> list[dict]:
        """The group's live workers (from the registry) and what each says of itself at `/status`:
        its `url`, and by SOW topic its `partitions`, `records` and `input_lag` (inputs not applied
        and committed yet); its `rss_bytes`, `rocksdb_bytes` and `cached_records`. A worker that
        does not answer comes with an `error` instead. Ordered by URL."""
        workers = self._workers(fresh=True)
        ask = lambda w: _http_json(f"{w['url']}/status", self.web_token, self._tls, timeout=10)  # noqa: E731
        found = []
        for worker, answer in _as_answered(workers, ask):
            if isinstance(answer, dict) and isinstance(answer.get("topics"), dict) and "error" not in answer:
                found.append({**answer, "url": worker["url"]})
            else:
                error = answer.get("error") if isinstance(answer, dict) else None
                found.append({"url": worker["url"], "error": error or "no answer", "topics": {}})
        return sorted(found, key=lambda w: w["url"])

    def _delete_keys_cap(self, spec: SowTopic) -> int:
        """SowKeys one sow_delete may list: this client's KSOW_MAX_DELETE_KEYS, or less when a live
        worker of the topic announced a lower limit of its own (none found: the client's)."""
        cap = max_delete_keys()
        try:
            workers = self._workers()
        except KafkaException as exc:  # the delete's own send says whether the cluster can be reached
            log.debug("no worker limits read (%s): sow_deletes of at most %d SowKeys", exc, cap)
            return cap
        return min([cap, *(w["max_delete_keys"] for w in workers if spec.topic in w["topics"] and "max_delete_keys" in w)])

    def _send_each(self, topic: str, value: bytes | None, key: bytes | None, messages: list[list]) -> None:
        """One message a header list, in order; when one fails after others went, the error says how
        many went (they are applied: a caller may send the rest again)."""
        for sent, headers in enumerate(messages):
            try:
                self._send(topic, value, key, headers)
            except (ClientError, KafkaException) as exc:
                if not sent:
                    raise
                raise ClientError(f"sow_delete {sent + 1} of {len(messages)} was not sent ({exc}); the {sent} before it were") from exc

    def flush(self, timeout: float = 30.0) -> None:
        if self._producer is not None and self._producer.flush(timeout) > 0:
            cause = f" (last error: {self._kafka_error.str()})" if self._kafka_error is not None else ""
            raise KafkaException(KafkaError(KafkaError._MSG_TIMED_OUT, f"messages not delivered in {timeout:g}s{cause}"))

    def close(self) -> None:
        """Deliver what was published, then let the producer go: its threads end now, not at
        interpreter exit (by when a broker the caller started may be gone, and librdkafka logs
        failed reconnections). A later publish makes a new one."""
        try:
            self.flush()
        finally:
            self._producer = None

    # reading the SOW ----------------------------------------------------------------------
    def _parse(self, codec: Codec, msg) -> SowMessage | None:
        """One `.sow` message as a change, or None (logged, counted in `skipped`) when malformed:
        anything may write to the topic, and one bad record must not stop a read of the SOW."""
        try:
            return parse_sow_message(codec, msg.key(), msg.value(), message_headers(msg))
        except MalformedSowMessage as exc:
            self.skipped += 1
            log.warning("skipped malformed record %s[%d]@%d: %s", msg.topic(), msg.partition(), msg.offset(), exc)
            return None

    def _snapshot(self, spec: SowTopic, after: Bookmark | None = None, consumer=None) -> tuple[dict, dict[int, int], Any, list[tuple], Bookmark]:
        """The SOW as of now: SowKey -> (record, seq, expires_at), the end offsets, the consumer,
        (with `after`) the last change of every record that came after that bookmark, in order of
        event ID, and the bookmark of everything read (the position the live stream starts at).
        Read with `consumer` when given (the caller's: it reads several topics' in turn), else with
        a new one.

        Records past their instant are left out (see `_decode_change`), swept or not."""
        mine = consumer is None
        if mine:
            consumer = make_consumer(self.bootstrap, error_cb=self._remember_error)
        topic = _live_topic(spec)
        try:
            self._require(consumer, topic)
        except Exception:  # a missing topic, a refused login: the consumer is not handed out
            if mine:
                consumer.close()
            raise
        read = Bookmark.start(spec.partitions)
        ends = {p: high for p, (_, high) in end_offsets(consumer, topic, range(spec.partitions)).items()}
        if topic != spec.sow_topic:  # a transient topic keeps no SOW: nothing to read before the live stream
            return {}, ends, consumer, [], read
        consumer.assign([TopicPartition(topic, p, 0) for p in range(spec.partitions)])
        state: dict[str, tuple[Any, ...]] = {}
        since: dict[str, tuple] = {}
        codec = self.codec(spec)
        for msg in read_until(consumer, {(topic, p): e for p, e in ends.items()}):
            parsed = self._parse(codec, msg)
            if parsed is None:
                continue
            change = _apply_change(state, parsed, spec.expiry)
            seq = change[2]
            if seq is not None and partition_of(seq) == msg.partition():
                read.advance(seq)
                if after is None:
                    continue
                if parsed.record is not None and change[4] is None:
                    # A version past its instant with no worker's expiry on `.sow` yet: the
                    # subscriber may hold it (given before the bookmark), and is told it expired.
                    since[change[1]] = (*change[:3], parsed.record, *change[4:])
                elif after.is_new(seq):
                    if change[3] is None and change[4] is None and change[1] in since:
                        # The worker's removal of a version read past its instant: that version says which record went.
                        change = (*change[:3], since[change[1]][3], *change[4:])
                    since[change[1]] = change
                else:  # a later version before the bookmark: the subscriber has it
                    since.pop(change[1], None)
        now = _now_ms()
        for key in [k for k, (_, _, expires) in state.items() if not spec.expiry.is_live(expires, now)]:
            record, seq, expires = state.pop(key)
            if after is not None:  # the subscriber may hold it (changed before the bookmark or after): it expired
                since[key] = (Op.EXPIRE, key, seq, record, None, expires)
        return state, ends, consumer, sorted(since.values(), key=lambda c: c[2]), read

    def query(
        self,
        topic: str,
        *,
        filter: str | None = None,
        keys: list[str] | None = None,
        select: list[str] | None = None,
        top: int | None = None,
        order_by: str | None = None,
    ) -> list[SowEntry]:
        """The current records of a SOW topic (or of a view: its topic through its filter and select
        list) that match the filter and keys.

        Answered by the running workers over HTTP (each for its partitions; key fields and hash
        indexes used where the filter allows; only the owners of the SowKeys that `keys`, or a
        filter with string literals on every key field, names are asked); when no set of live
        workers covers those partitions, the client reads `<topic>.sow` itself.
        `self.last_query_source` says which ("workers" or "changelog").

        A `topic` that is no SOW topic or view of the topology may be a regular expression over
        their names (matched whole, RE2's syntax as LIKE's): the records of every one it matches,
        each entry naming its topic, ordered and cut to `top` together.

        Every path gives the same order (processor.core.sortorder): by `order_by`, ties in SowKey
        order (then topic name), or in SowKey order without it; `top` keeps the first.
        """
        if names := self._pattern(topic):
            return self._query_each(names, filter, keys, select, top, order_by)
        entries, hidden = self._query_one(topic, filter, keys, select, top, order_by)
        return [_hide(entry, hidden) for entry in entries]

    def _pattern(self, topic: str) -> list[str]:
        """The SOW topics and views `topic` names as a regular expression over their names: none
        when it is one of those names (or matches none: then it is read as a name, and refused)."""
        return [] if topic in self.topology.names() else self.topology.matching(topic)

    def _query_one(self, topic: str, filter: str | None, keys: list[str] | None, select: list[str] | None,
                   top: int | None, order_by: str | None) -> tuple[list[SowEntry], tuple[str, ...] | None]:
        """A query of one topic or view, and the `order_by` path its entries hold beyond the select
        list (None when they hold no more): the merge of the workers' answers, the changelog's read
        and a pattern's merge order the selected records, so a field they order by is asked for too
        and taken out by the caller (`_hide`) once ordered."""
        topic, filter, select = self._through_view(topic, filter, select, order_by)
        spec = self.spec(topic)
        if keys is not None:
            _check_keys(keys)  # one that is no SowKey would match nothing, without a word
            if not keys:  # and none at all is no key filter, which would return every record
                raise ClientError("keys names no SowKey: give at least one, or no keys to match every record")
        query = SowQuery(filter, tuple(keys or ()), tuple(select or ()), top, order_by)
        if filter:
            from processor.core.filters import compile_filter

            compile_filter(filter)  # a bad filter is the caller's error, with its position
        hidden = None
        if query.select and query.ordering and not within(query.ordering[0], selection(query, spec.key_spec.split)):
            hidden = query.ordering[0]
            query = SowQuery(query.filter, query.keys, (*query.select, order_by.split()[0]), top, order_by)
        rows = self._query_workers(spec, query)
        self.last_query_source = "workers"
        if rows is None:
            rows = self._query_changelog(spec, query)
            self.last_query_source = "changelog"
        return [SowEntry(r["sow_key"], r.get("seq"), r.get("expires_at"), r["record"]) for r in rows], hidden

    def _query_each(self, names: list[str], filter: str | None, keys: list[str] | None, select: list[str] | None,
                    top: int | None, order_by: str | None) -> list[SowEntry]:
        """A query of several topics (a pattern's): each asked as if named alone, the entries tagged
        with their topic, then ordered and cut together. The source is "changelog" if any was."""
        entries, sources = [], set()
        for name in names:
            found, hidden = self._query_one(name, filter, keys, select, top, order_by)
            for entry in found:
                entry.topic = name
                entries.append((entry, hidden))
            sources.add(self.last_query_source)
        self.last_query_source = "changelog" if "changelog" in sources else "workers"
        ordered = order_and_cut(entries, SowQuery(top=top, order_by=order_by), lambda pair: pair[0].record,
                                lambda pair: (pair[0].sow_key, pair[0].topic))
        return [_hide(entry, hidden) for entry, hidden in ordered]

    def _query_workers(self, spec: SowTopic, query: SowQuery, attempts: int = 3) -> list[dict] | None:
        params = orjson.dumps(query.to_params())
        everything = _partitions_asked(spec, query)
        if not everything:
            return []  # it names no SowKey: nothing can match (a filter `/id = NULL`)
        for attempt in range(attempts):
            workers = [w for w in self._workers(fresh=attempt > 0) if everything.intersection(w["topics"].get(spec.topic) or ())]
            if not workers:
                if attempt == 0:  # the list may be from before they announced this topic: read it again
                    continue
                return None
            # A worker answers within QUERY_SPAN times its query time limit (a wait for one of its
            # query threads, then the query and the turns it gave the worker's loop) or says it ran
            # out (HTTP 503): one silent past that, and a margin, has stopped, and its partitions
            # are asked for again.
            wait = QUERY_SPAN * query_max_seconds() + 5
            ask = lambda w: _http_json(f"{w['url']}/sow/{spec.topic}", self.web_token, self._tls, timeout=wait, body=params)  # noqa: E731
            covered: set[int] = set()
            rows: dict[str, dict] = {}
            # Answers are taken as they come, and once they cover every partition the query is
            # answered: a worker that stopped (SIGSTOP, a stall) while the group moved its
            # partitions to the others does not hold it up for the HTTP timeout.
            for worker, answer in _as_answered(workers, ask):
                if isinstance(answer, dict) and isinstance(answer.get("error"), str):
                    refused = TooManyRecords if answer.get("status") == 413 else ClientError
                    raise refused(f"worker {worker['url']}: {answer['error']}")
                if not _valid_answer(answer):
                    if answer is not None:
                        log.warning("ignored a malformed answer from worker %s", worker["url"])
                    continue
                fresh = set(answer["partitions"]) - covered
                covered |= fresh
                for row in answer["results"]:
                    rows.setdefault(row["sow_key"], row)
                if covered >= everything:
                    return order_results(list(rows.values()), query)
            time.sleep(0.5 * (attempt + 1))  # a rebalance is moving partitions: ask again
        return None

    def _workers(self, fresh: bool = False) -> list[dict]:
        """The group's live workers, re-read from the registry at most every REGISTRY_CACHE_S."""
        from processor.kafka.registry import live_workers

        now = time.monotonic()
        if fresh or self._registry is None or now - self._registry[0] > REGISTRY_CACHE_S:
            self._registry = (now, live_workers(self.bootstrap, self.group, self.web_token))
        return self._registry[1]

    def _query_changelog(self, spec: SowTopic, query: SowQuery) -> list[dict]:
        sub = self._subscription_spec(spec, query.filter)
        state, _, consumer, _, _ = self._snapshot(spec)
        consumer.close()
        wanted = set(query.keys) if query.keys else None
        select = selection(query, spec.key_spec.split)
        rows = [
            result(key, SowRecord(record, seq or 0, expires), select)
            for key, (record, seq, expires) in state.items()
            if (wanted is None or key in wanted) and sub.matches(record)
        ]
        return order_results(rows, query)

    def _subscription_spec(self, spec: SowTopic, filter: str | None, **options) -> SubscriptionSpec:
        predicate = None
        if filter:
            from processor.core.filters import compile_filter

            predicate = compile_filter(filter).matches
        kwargs = {k: v for k, v in options.items() if v is not None}
        if "keys" in kwargs:
            _check_keys(kwargs["keys"])
            if not kwargs["keys"]:  # none at all would be no key limit, which subscribes to every record
                raise ClientError("keys names no SowKey: give at least one, or no keys to subscribe to every record")
            kwargs["keys"] = frozenset(kwargs["keys"])
        if "select" in kwargs:
            kwargs["select"] = tuple(kwargs["select"])
        if predicate is not None:
            kwargs["filter"] = predicate
        return SubscriptionSpec(key_paths=spec.key_spec.split, **kwargs)

    def subscribe(
        self,
        topic: str,
        *,
        filter: str | None = None,
        sow: bool = True,
        delta: bool = False,
        oof: bool = False,
        no_empties: bool = False,
        no_sowkey: bool = False,
        select: list[str] | None = None,
        conflation: str | int | None = None,
        timeout: float | None = None,
        after: str | int | None = None,
        after_seq: str | int | None = None,
        keys: list[str] | None = None,
    ) -> Iterator[dict]:
        """sow_and_subscribe (or with sow=False just subscribe); with delta=True, deltas after the SOW.

        Yields event dicts: {"op", "sow_key", "seq", "expires_at", "record", "bookmark"} (op "sow" for
        the snapshot, "oof" with a "reason" when a record leaves the subscription; "bookmark" is where
        to resume after this event). Stops after `timeout` seconds of no messages, if given. `after`
        (or its old name `after_seq`) resumes after a bookmark (see subscribe_many). `keys` (a list
        of SowKeys) limits the subscription to those records, the snapshot and the live changes.

        A `topic` that is no SOW topic or view of the topology may be a regular expression over
        their names, as in `query`: see subscribe_many.
        """
        options = dict(filter=filter, delta=delta, oof=oof, no_empties=no_empties, no_sowkey=no_sowkey, select=select, conflation=conflation,
                       keys=keys)
        return _only_events(self.subscribe_many(topic, [options], sow=sow, timeout=timeout, after=after if after is not None else after_seq))

    def subscribe_many(
        self, topic: str, subscriptions: list[dict], *, sow: bool = True, timeout: float | None = None,
        after: str | int | None = None, after_seq: str | int | None = None,
    ) -> Iterator[tuple[int, dict]]:
        """Several subscriptions to one topic over one consumer and one copy of the SOW state.

        Each entry of `subscriptions` takes the keyword options of `subscribe` (filter, delta, oof,
        no_empties, no_sowkey, select, conflation, keys). Yields (index of the subscription, event).

        Every event carries a "bookmark" (processor.core.bookmarks): one event ID per partition,
        how far this subscription got in each. With `after` (the bookmark of the last event a
        subscriber took), instead of the snapshot: the current version of every record changed
        after it (full records as op "sow", oldest change first; with oof, an oof event for one that no longer
        matches, as it may have left the subscription meanwhile) and the records removed after it
        (op of the removal, record null), then the live stream. An event ID alone is a bookmark of
        its own partition only: the other partitions' records then come again, as changed since
        their start (a warning says so).

        A `topic` that is no SOW topic or view of the topology may be a regular expression over
        their names (matched whole, RE2's syntax, as `query` takes it): each subscription is then
        one to every topic and view it matches, each read as if named alone (its options, a view's
        filter and select list), over the same one consumer. With `sow`, the snapshots of all of
        them come first (one topic's after another), then their live events as they come. Each
        event names the topic or view it came from ("topic"), and its bookmark names each SOW
        topic's part (`orders=1024,2049;trades=3072`, bookmarks.join_topics): `after` takes one
        such, and a SOW topic it does not name comes again from its start (a warning says so).
        """
        if after is None:
            after = after_seq
        pattern = self._pattern(topic)
        sources: dict[str, _Source] = {}
        for name in pattern or [topic]:
            base = self._through_view(name, None, None)[0]
            if base not in sources:
                sources[base] = _Source(self.spec(base))
            source = sources[base]
            for index, options in enumerate(subscriptions):
                source.feeds.append(self._feed(source.spec, name, options, index, name if pattern else None))
        if after is not None:
            self._resume_points(list(sources.values()), after, bool(pattern))
        # The snapshots are taken now, not at the first next(): the subscription starts at this call.
        consumer = None
        try:
            for source in sources.values():
                source.state, source.ends, consumer, source.since, source.read = self._snapshot(source.spec, source.after, consumer)
        except BaseException:
            if consumer is not None:
                consumer.close()
            raise
        return self._events(list(sources.values()), consumer, sow and after is None, timeout, bool(pattern))

    def _feed(self, spec: SowTopic, name: str, options: dict, index: int, tag: str | None) -> "_Feed":
        """Subscription `index` to `name` (a SOW topic, or a view of `spec`) with `options`."""
        options = dict(options)
        _, options["filter"], options["select"] = self._through_view(name, options.get("filter"), options.get("select"))
        conflation = options.pop("conflation", None)
        sub = self._subscription_spec(spec, options.pop("filter", None), **options)
        return _Feed(sub, parse_duration_ms(conflation) / 1000 if conflation else 0.0, index=index, topic=tag)

    def _resume_points(self, sources: list["_Source"], after: str | int, pattern: bool) -> None:
        """Where each source resumes, from `after`: one topic's bookmark, or with a pattern one that
        names each SOW topic's part (see subscribe_many). Raises ClientError."""
        try:
            parts = split_topics(after) if pattern else {sources[0].spec.topic: after}
        except BookmarkError as exc:
            raise ClientError(str(exc)) from None
        if unknown := sorted(set(parts) - {source.spec.topic for source in sources}):
            raise ClientError(f"the bookmark names {', '.join(unknown)}, which the pattern does not match: "
                              "resume with the bookmark of an event of this pattern's subscription")
        for source in sources:
            spec = source.spec
            if spec.topic not in parts:
                log.warning("the bookmark names no part of %s: its records come again, as changed since its start", spec.topic)
                source.resume(Bookmark.start(spec.partitions))
                continue
            try:
                bookmark, missing = Bookmark.parse(parts[spec.topic], spec.partitions)
            except BookmarkError as exc:
                raise ClientError(f"{spec.topic}: {exc}" if pattern else str(exc)) from None
            source.resume(bookmark)
            if missing:
                log.warning("the bookmark names no event ID of partition(s) %s of %s: their records come again, as changed since "
                            "their start (resume with the bookmark of the last event, not its event ID)", ", ".join(map(str, missing)), spec.topic)

    def _events(self, sources: list["_Source"], consumer, sow: bool, timeout: float | None, tagged: bool) -> Iterator[tuple[int, dict]]:
        """The events of the sources' feeds, read with `consumer` (left after their snapshots): the
        changes after each one's bookmark (those with `after`), else with `sow` the snapshots, then
        the live changes of all of them. With `tagged` (a pattern's), each event names its topic
        and its bookmark every source's part."""

        def mark(source: _Source, index: int, at: Bookmark | None = None) -> str:
            """The bookmark of an event of subscription `index` from `source` (at `at` there, else
            at its position): in each source short of the events its feeds still hold."""
            own = source.held_back(index, at or source.position)
            if not tagged:
                return str(own)
            return join_topics({s.spec.topic: str(own if s is source else s.held_back(index, s.position)) for s in sources})

        try:
            for source in sources:
                for op, key, seq, before, record, expires in source.since:
                    source.position.advance(seq)
                    for feed in source.feeds:
                        event = feed.sub.resumed(op, key, seq, record, expires, before)
                        if event is not None:
                            yield feed.index, feed.out(event, mark(source, feed.index))
            for source in sources if sow else ():  # oldest change first, so that each event's bookmark covers what came before it
                items = sorted(source.state.items(), key=_by_seq)
                # All that was read of `.sow` (removals before the snapshot too), short of its records still to come.
                for (key, (record, seq, expires)), later in zip(items, _still_to_come([item[1][1] for item in items])):
                    source.position = source.read.short_of(later)
                    for feed in source.feeds:
                        event = feed.sub.snapshot(key, seq, record, expires)
                        if event is not None:
                            yield feed.index, feed.out(event, mark(source, feed.index))
            by_topic = {}
            for source in sources:
                for seq in source.after.positions if source.after is not None else ():
                    source.read.advance(seq)
                source.position = source.read
                by_topic[_live_topic(source.spec)] = source
            consumer.assign([TopicPartition(topic, p, end) for topic, source in by_topic.items() for p, end in source.ends.items()])
            feeds = [feed for source in sources for feed in source.feeds]
            idle_since = time.monotonic()
            for feed in feeds:
                feed.flush_at = idle_since + feed.interval
            while True:
                msgs = consumer.consume(500, 0.1)
                now = time.monotonic()
                for msg in msgs:
                    if msg.error():
                        if msg.error().code() == KafkaError._PARTITION_EOF or msg.error().code() in READER_NOISE:
                            continue
                        raise KafkaException(msg.error())
                    idle_since = now
                    source = by_topic[msg.topic()]
                    parsed = self._parse(self.codec(source.spec), msg)
                    if parsed is None:
                        continue
                    # A transient topic's messages come whole, each as if new (a delta subscriber too).
                    change = _apply_change(source.state if source.stored else {}, parsed, source.spec.expiry)
                    seq = change[2]
                    if seq is not None and partition_of(seq) == msg.partition():
                        source.position.advance(seq)
                    for feed in source.feeds:
                        event = feed.sub.change(*change)
                        if event is None:
                            continue
                        if feed.interval:
                            key = change[1]
                            now_sent, held = conflate_event(feed.pending.get(key), event, feed.sub.delta)
                            if held is None:  # in and out within the interval: the subscriber never had it
                                del feed.pending[key]
                            else:
                                feed.pending[key] = held
                            if now_sent is not None:  # it left and is back: the leave goes at once
                                yield feed.index, feed.out(now_sent, mark(source, feed.index))
                        else:
                            yield feed.index, feed.out(event, mark(source, feed.index))
                idle = timeout is not None and now - idle_since > timeout
                for source in sources:
                    for feed in source.feeds:
                        if feed.pending and (idle or now >= feed.flush_at):
                            at = lambda own, source=source, feed=feed: mark(source, feed.index, own)  # noqa: E731
                            for event in _released(feed.pending, source.position, at):
                                yield feed.index, feed.out(event, event["bookmark"])
                        if feed.interval and now >= feed.flush_at:
                            feed.flush_at = now + feed.interval
                if idle:
                    return
        finally:
            consumer.close()


def _check_keys(keys: list[str]) -> None:
    """SowKeys a caller gave (a delete's, a query's): a list of Base64 texts; raises ClientError."""
    if isinstance(keys, str):
        raise ClientError("keys must be a list of SowKeys, not one string")
    try:
        validate_user_keys(keys)
    except KeyError_ as exc:
        raise ClientError(str(exc)) from None


def _by_seq(item: tuple) -> int:
    return item[1][1] or 0


def _released(pending: dict, position: Bookmark, mark: Callable[[Bookmark], str] = str) -> Iterator[dict]:
    """A conflation interval's events, oldest change first (and `pending` emptied), each with a
    bookmark that stops short of the events of its partition still to come after it: a subscriber
    that stops in the middle resumes with the rest. `mark` writes it (a pattern's names each topic's part)."""
    events = sorted(pending.values(), key=lambda e: e.get("seq") or 0)
    pending.clear()
    for event, later in zip(events, _still_to_come([e.get("seq") for e in events])):
        event["bookmark"] = mark(position.short_of(later))
        yield event


def _still_to_come(seqs: list[int | None]) -> list[list[int]]:
    """For each of these event IDs (in the order given to a subscriber), the event IDs of the next
    one of each partition after it: what a bookmark after it must stop short of."""
    to_come: list[list[int]] = []
    upcoming: dict[int, int] = {}  # partition -> event ID of its next event still to come
    for seq in reversed(seqs):
        to_come.append(list(upcoming.values()))
        if seq is not None:
            upcoming[partition_of(seq)] = seq
    to_come.reverse()
    return to_come


def _hide(entry: SowEntry, parts: tuple[str, ...] | None) -> SowEntry:
    """The entry without the field at `parts` (and the objects it leaves empty): the order_by
    field a query asked for beyond its select list (`Client._query_one`)."""
    if parts is None:
        return entry
    trail = [entry.record]
    for part in parts[:-1]:
        trail.append(trail[-1].get(part))
        if not isinstance(trail[-1], dict):
            return entry
    trail[-1].pop(parts[-1], None)
    for node, part in zip(reversed(trail[:-1]), reversed(parts[:-1])):
        if node[part]:
            break
        del node[part]
    return entry


def _check_finite(value: Any, path: str = "") -> None:
    """NaN and infinities are no JSON numbers (orjson would write them as null, without a word)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ClientError(f"field {path or '/'} is {value}, which JSON cannot carry")
    if isinstance(value, dict):
        for name, inner in value.items():
            _check_finite(inner, f"{path}/{name}")
    elif isinstance(value, (list, tuple)):
        for i, inner in enumerate(value):
            _check_finite(inner, f"{path}/{i}")


def _live_topic(spec: SowTopic) -> str:
    """Where a subscription's changes come from: `.sow`, or for a transient topic (no SOW) `.diff`,
    where the workers relay each message whole."""
    return spec.diff_topic if spec.persistence is Persistence.TRANSIENT else spec.sow_topic


@dataclass
class _Feed:
    """One subscription of a shared consumer, with its conflation buffer."""

    sub: SubscriptionSpec
    interval: float = 0.0
    flush_at: float = 0.0
    pending: dict = field(default_factory=dict)
    index: int = 0  # the subscription's, in subscribe_many's list
    topic: str | None = None  # the topic or view its events name (a pattern's subscription)

    def out(self, event: dict, bookmark: str) -> dict:
        event["bookmark"] = bookmark
        return event if self.topic is None else {"topic": self.topic, **event}


@dataclass
class _Source:
    """One SOW topic a subscription reads (a pattern's, each it matches): its feeds (one per
    subscription and name, the topic's or a view's), its SOW state and how far its events got."""

    spec: SowTopic
    feeds: list[_Feed] = field(default_factory=list)
    after: Bookmark | None = None  # where it resumes (see `resume`)
    state: dict = field(default_factory=dict)
    ends: dict[int, int] = field(default_factory=dict)
    since: list[tuple] = field(default_factory=list)
    read: Bookmark | None = None

    def __post_init__(self) -> None:
        self.stored = self.spec.persistence is not Persistence.TRANSIENT
        self.position = Bookmark.start(self.spec.partitions)  # the bookmark of the events given so far, conflation aside
        self._by_index: dict[int, list[_Feed]] = {}

    def resume(self, after: Bookmark) -> None:
        self.after, self.position = after, after.copy()

    def held_back(self, index: int, at: Bookmark) -> Bookmark:
        """`at` stopped short of the events subscription `index`'s feeds still hold (conflation)."""
        if not self._by_index:
            for feed in self.feeds:
                self._by_index.setdefault(feed.index, []).append(feed)
        return at.short_of(e.get("seq") for feed in self._by_index.get(index, ()) for e in feed.pending.values())


def _only_events(feed: Iterator[tuple[int, dict]]) -> Iterator[dict]:
    try:
        for _, event in feed:
            yield event
    finally:
        feed.close()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _apply_change(state: dict, change: SowMessage, policy: ExpiryPolicy) -> tuple:
    """(op, key, seq, record before, record after, expires_at) of one `.sow` change; updates `state`.

    A version already past its instant when it is read (a reader behind, a sweep behind) is never
    delivered: it is read as the record expiring, so a subscriber that held the record is told it
    left (op expire) and the worker's own expire event, when it comes, finds nothing to remove.
    """
    key, after, op = change.key, change.record, change.op
    before = state.get(key)
    if after is not None and not policy.is_live(change.expires_at, _now_ms()):
        after, op = None, Op.EXPIRE
    if after is None:
        state.pop(key, None)
    else:
        state[key] = (after, change.seq, change.expires_at)
    return op, key, change.seq, before[0] if before else None, after, change.expires_at


def _partitions_asked(spec: SowTopic, query: SowQuery) -> set[int]:
    """The partitions whose workers a query asks: the owners of the SowKeys it names (its keys, or
    those its filter names in every partition: `choose_keys`), else all of them."""
    named = query.keys or None
    if not named and query.filter:
        from processor.core.filters import compile_filter
        from processor.core.keyplan import choose_keys

        named = choose_keys(compile_filter(query.filter), spec.key_spec, False)
    if named is None:
        return set(range(spec.partitions))
    return {owner_partition(key, spec.partitions) for key in named}


def _as_answered(workers: list[dict], ask: Callable[[dict], Any]) -> Iterator[tuple[dict, Any]]:
    """(worker, answer) as each worker answers. The askers are daemon threads: one left waiting on a
    worker that does not answer keeps no process from exiting."""
    answers: queue.SimpleQueue = queue.SimpleQueue()
    for worker in workers:
        threading.Thread(target=lambda w=worker: answers.put((w, ask(w))), daemon=True, name="ksow-query").start()
    for _ in workers:
        yield answers.get()


def _http_json(url: str, token: str | None = None, tls: ssl.SSLContext | None = None, timeout: float = 30.0, body: bytes | None = None) -> Any:
    """GET a worker's JSON answer (POST `body`, a JSON object, when given); None when the worker is
    gone or answers no JSON (its partitions will be missing, and another worker or the changelog
    answers for them); an error answer carries its HTTP status as "status". Never raises: it runs
    on an asker thread (`_as_answered`)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if body is not None:
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=tls) as response:
            return orjson.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            answer = orjson.loads(exc.read())
        except orjson.JSONDecodeError:
            log.warning("worker %s answered HTTP %d without a JSON error: its partitions are read from the changelog", url, exc.code)
            return None
        if isinstance(answer, dict):
            answer.setdefault("status", exc.code)
        return answer
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ssl.SSLCertVerificationError):
            # Not a worker that is gone: every answer would be refused alike, and the query would
            # quietly read the changelog instead. Told as the worker's error (the caller raises it).
            return {"error": f"its HTTPS certificate is not trusted ({exc.reason.verify_message}): set KSOW_WEB_CA to the CA that signed it"}
        return None
    except (OSError, orjson.JSONDecodeError):
        return None


def _valid_answer(answer: Any) -> bool:
    """Whether a worker's answer has the shape /sow/{topic} gives (anything else is ignored)."""
    if not isinstance(answer, dict):
        return False
    partitions, results = answer.get("partitions"), answer.get("results")
    return (
        isinstance(partitions, list) and all(isinstance(p, int) for p in partitions)
        and isinstance(results, list)
        and all(isinstance(r, dict) and isinstance(r.get("sow_key"), str) and isinstance(r.get("record"), dict) for r in results)
    )


def _tls_context(ca_file: str | None) -> ssl.SSLContext | None:
    """Verification of workers' HTTPS certificates against KSOW_WEB_CA (else the system's CAs)."""
    if not ca_file:
        return None
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ClientError(f"cannot use KSOW_WEB_CA {ca_file}: {exc}") from None


# The same operations as plain functions, for scripts (each opens a Client for the call).
def publish(topic: str, record: Any, *, bootstrap: str | None = None, topology: Topology | str | None = None, **options) -> str:
    client = Client(bootstrap, topology)
    try:
        return client.publish(topic, record, **options)
    finally:
        client.close()


def delete(topic: str, *, bootstrap: str | None = None, topology: Topology | str | None = None, group: str | None = None, **options) -> int | None:
    client = Client(bootstrap, topology, group)
    try:
        return client.delete(topic, **options)
    finally:
        client.close()


def query(topic: str, *, bootstrap: str | None = None, topology: Topology | str | None = None, group: str | None = None, **options) -> list[SowEntry]:
    return Client(bootstrap, topology, group).query(topic, **options)


def subscribe(topic: str, *, bootstrap: str | None = None, topology: Topology | str | None = None, group: str | None = None, **options) -> Iterator[dict]:
    return Client(bootstrap, topology, group).subscribe(topic, **options)
