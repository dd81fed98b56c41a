"""Stores written under an older SowKey rule, or another key definition: found at start, never
mixed with the current ones.

Key format 2 (`processor.core.keys.KEY_FORMAT`) makes the SowKey from the text of the key values,
so SowKeys of records keyed by numbers or booleans changed. A store, or the `<topic>.sow` changelog
it was rebuilt from, may still hold SowKeys of format 1: a worker that went on with it would keep
two records for what is now one key. `check_key_format` is run for each partition once its
store has caught up with the changelog, before any input is applied.

A store of format 1 is refused only if one of its records has a SowKey the current rule does not
give it: topics keyed by strings only, and topics whose publishers send `sow-key`, have the same
SowKeys under both rules and are simply stamped.

The same holds for the topology's key definition (`key` paths, `key_domain`): a store is stamped
with a fingerprint of the one its records follow, and a worker started with another one scans the
store and refuses it if a record's SowKey changed (where it kept the old records beside the new
ones: two records for one key, and updates that never find the record they update).

And for the encoding of its records on `<topic>.sow` (`message_type`, the Avro schema's canonical
form): after a change, the changelog holds values the worker can no longer read, and a store rebuilt
from it would pass them over. `check_encoding` has the partition write its records back in the new
encoding (a re-seed), so that each record's last version on `.sow` is one the topology reads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Generator

from processor.contract.errors import ConfigError, InputError
from processor.contract.types import SowRecord
from processor.core.codec import Codec
from processor.core.keys import KEY_FORMAT, KeyError_
from processor.state.base import PartitionStore
from processor.topology import SowTopic


class KeyFormatError(ConfigError):
    """A SOW partition holds SowKeys of an older rule; the message tells the operator how to rebuild."""


SCAN_STEP = 5_000  # records a scan reads between two steps


def stale_key(store: PartitionStore, spec: SowTopic) -> Generator[None, None, tuple[str, str | None] | None]:
    """Scan the store's records, a step every SCAN_STEP (a worker runs it in slices, between its
    other partitions' work: a million records take seconds). Its value: the first record whose
    stored SowKey differs from the one the current rule gives its data, as (stored key, current key
    or None when the data has no valid key any more); None if none does."""
    if spec.key_spec.user_keys:
        return None
    for n, (key, record) in enumerate(store.records(), 1):
        try:
            current = spec.key_spec.sow_key(record.data)
        except KeyError_:
            return key, None
        if current != key:
            return key, current
        if n % SCAN_STEP == 0:
            yield
    return None


_KEY_DEFINITION = "key_definition"  # store metadata: `key_definition` of the topology its records follow


def key_definition(spec: SowTopic) -> int:
    """A fingerprint of what makes `spec`'s SowKeys: the SowKey rule, the key paths and the key domain."""
    text = repr((KEY_FORMAT, spec.key_spec.domain, spec.key_spec.paths)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "big")


def check_key_format(store: PartitionStore, spec: SowTopic, partition: int, group: str) -> Generator[None, None, None]:
    """Raise KeyFormatError if partition `partition` of `spec` holds SowKeys of an older rule or of
    another key definition; otherwise stamp the store with both (committed with its next commit),
    so the records are scanned only once. Run it (a step every SCAN_STEP records) with nothing
    staged, after the changelog restore."""
    definition = key_definition(spec)
    if store.key_format() == KEY_FORMAT and store.meta(_KEY_DEFINITION) == definition:
        return
    found = yield from stale_key(store, spec)
    if found is not None:
        raise KeyFormatError(rebuild_message(spec, partition, group, *found, older_rule=store.key_format() != KEY_FORMAT))
    store.set_key_format(KEY_FORMAT)
    store.set_meta(_KEY_DEFINITION, definition)


_ENCODING = "encoding"  # store metadata: `encoding_definition` of the codec its `.sow` records were written with


def encoding_definition(codec: Codec) -> int:
    """A fingerprint of how `codec` writes records (`Codec.encoding`)."""
    return int.from_bytes(hashlib.blake2b(codec.encoding.encode(), digest_size=7).digest(), "big")


class EncodingChangeError(ConfigError):
    """A record of the SOW cannot be written in the topology's new encoding."""


def check_encoding(store: PartitionStore, spec: SowTopic, codec: Codec, partition: int, project: bool = True) -> Generator[None, None, bool]:
    """Whether partition `partition`'s records must be written back to `.sow` because the topology
    changed how they are encoded since they were written there (its value); the store is stamped
    with the new encoding (committed with its next commit, after the re-seed's transaction: a crash
    before it re-seeds again). A store stamped with none (an earlier release, a store rebuilt from
    the changelog) is stamped. EncodingChangeError, before anything is written, when a record does
    not fit the new encoding. Then, with `project`, each record is made what the new encoding reads
    back (`_project`). Run it (a step every SCAN_STEP records) after `check_key_format`."""
    definition, stamped = encoding_definition(codec), store.meta(_ENCODING)
    if stamped == definition:
        return False
    if stamped:
        for n, (key, record) in enumerate(store.latest(), 1):  # what the re-seed writes
            try:
                codec.encode(record.data)
            except InputError as exc:
                raise EncodingChangeError(
                    f"{spec.topic} partition {partition}: the topic's encoding changed ({spec.message_type.value}"
                    f"{', schema ' + spec.schema_ if spec.schema_ else ''}) since its records were written to {spec.sow_topic}, "
                    f"and its record {key} cannot be written in the new one: {exc}. The worker writes every record back in "
                    "the new encoding (a rebuild reads no other); put the former schema back, or make the new schema take "
                    "the records it has (a field added with a default, a field made a union with null)"
                ) from None
            if n % SCAN_STEP == 0:
                yield
        if project:
            yield from _project(store, codec)
    store.set_meta(_ENCODING, definition)
    return bool(stamped) and store.count() > 0


def _project(store: PartitionStore, codec: Codec) -> Generator[None, None, None]:
    """Each record as the new encoding reads it back: a field the schema dropped is gone, one it
    added has its default. The re-seed writes that to `.sow` whatever the store holds, so without
    this a query to the worker, a merge and `EXP.` kept the old shape where `.sow` and a store
    rebuilt from it had the new one. Committed a step at a time (a million records would not fit
    in memory staged): nothing staged here must wait for the re-seed (`project` is false while a
    recreated changelog's replay is; key stamps may go at once), and the new stamp is staged only
    after the last step, so a crash before the re-seed ends projects again, which changes nothing
    more, and re-seeds again."""
    for n, (key, record) in enumerate(store.records(), 1):  # a point-in-time scan: the commits below do not move it
        try:
            data = codec.decode(codec.encode(record.data))
        except InputError:  # what the codec writes, it reads (a value too deep for its reader aside): kept as it is
            data = record.data
        if data != record.data:
            store.put(key, SowRecord(data, record.seq, record.expires_at, record.updated_at))
        if n % SCAN_STEP == 0:
            store.commit()
            yield
    store.commit()


def rebuild_message(spec: SowTopic, partition: int, group: str, stored: str, current: str | None, older_rule: bool = True) -> str:
    """What the operator reads when a worker refuses a store of an older SowKey rule, or of
    another key definition than the topology's."""
    now = f"now has SowKey {current}" if current is not None else "has no valid SowKey now"
    reset = f"kafka-consumer-groups.sh --bootstrap-server <bootstrap> --group {group} --reset-offsets"
    if older_rule:
        why = (f"the SOW was written under an older SowKey rule (key format 1, where 5 and \"5\" were two records; "
               f"this ksow uses key format {KEY_FORMAT}). Its record {stored} {now}. The worker will not mix both rules. "
               "To rebuild the SOW under the new rule: ")
    else:
        key = ", ".join(spec.key_spec.paths)
        why = (f"the SOW was written under another key definition than the topology's (key [{key}], key_domain "
               f"{spec.key_spec.domain}): its record {stored} {now}. The worker will not mix both. Put the former key "
               "back in the topology, name a new topic, or rebuild the SOW under the new key: ")
    return (
        f"{spec.topic} partition {partition}: {why}"
        f"(1) stop every worker of group {group}; "
        f"(2) delete the SOW: the folder sow/{spec.topic} in each worker's --data-dir, and the topics {spec.sow_topic} "
        "and <view>.sow of the views of this topic; "
        f"(3) make the workers read the inputs again from the start, and skip the copies already rerouted: "
        f"`{reset} --to-earliest --topic {spec.topic} --topic {spec.delta_topic} --execute` and "
        f"`{reset} --to-latest --topic {spec.repartition_topic} --execute` "
        f"(the SOW is complete only if {spec.topic} and {spec.delta_topic} still hold every message since it began: check their retention.ms); "
        "(4) start the workers. Clients that kept SowKeys (sow-keys deletes, --keys queries, --after-seq) must fetch them again."
    )


__all__ = ["EncodingChangeError", "KeyFormatError", "check_encoding", "check_key_format", "encoding_definition", "rebuild_message", "stale_key"]
