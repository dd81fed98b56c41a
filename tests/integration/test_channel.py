"""Channel attributes on a real broker: persistence modes across restarts, capacity, event IDs."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from processor.client.sow_client import Client
from processor.core.keys import owner_partition
from processor.topology import load_topology

from .workers import Worker, headers_of, read_all, wait_until, write_topology

pytestmark = pytest.mark.integration


def start(kafka_bootstrap, tmp_path, topic, data="d1", name="w", **options):
    path = write_topology(tmp_path, topic, **options)
    worker = Worker(kafka_bootstrap, path, f"g-{topic}", tmp_path / data, name).start()
    return worker, Client(kafka_bootstrap, load_topology(path))


def ids(client, topic):
    return sorted(e.record["id"] for e in client.query(topic))


def load(client, topic, n):
    """Records 0..n-1 (v 0) in the SOW."""
    for i in range(n):
        client.publish(topic, {"id": i, "v": 0})
    client.flush()
    wait_until(lambda: len(ids(client, topic)) == n)


@pytest.mark.parametrize("mode,survives", [("persistent", True), ("memory", True), ("simple", False)])
def test_persistence_across_restart(kafka_bootstrap, unique_name, tmp_path, mode, survives):
    topic = unique_name
    w, client = start(kafka_bootstrap, tmp_path, topic, persistence=mode)
    for i in range(10):
        client.publish(topic, {"id": i, "a": i})
    client.flush()
    wait_until(lambda: ids(client, topic) == list(range(10)))
    w.stop()
    w2, _ = start(kafka_bootstrap, tmp_path, topic, name="w2", persistence=mode)
    try:
        client.publish(topic, {"id": 0, "b": 1}, delta=True)
        client.flush()
        if survives:
            wait_until(lambda: client.query(topic, keys=[client.spec(topic).key_spec.sow_key({"id": 0})])[0].record == {"id": 0, "a": 0, "b": 1})
            assert ids(client, topic) == list(range(10))
        else:  # a simple SOW starts empty; `.sow` is told with deletes, the delta becomes a new record
            wait_until(lambda: ids(client, topic) == [0])
            assert client.query(topic)[0].record == {"id": 0, "b": 1}
    finally:
        w2.kill()


def test_a_simple_sow_keeps_what_a_rebalance_leaves_with_its_worker(kafka_bootstrap, unique_name, tmp_path):
    """A second worker joins: the partition it takes starts empty (deletes on `.sow`), the one the
    first worker keeps is restored from the store it still holds, not purged."""
    topic = unique_name
    w1, client = start(kafka_bootstrap, tmp_path, topic, persistence="simple", partitions=2)
    w2 = Worker(kafka_bootstrap, tmp_path / f"{topic}.yaml", f"g-{topic}", tmp_path / "d2", "w2")
    try:
        load(client, topic, 20)
        wait_until(lambda: ids(client, topic) == list(range(20)))
        key_of = {i: client.spec(topic).key_spec.sow_key({"id": i}) for i in range(20)}
        owner = {i: owner_partition(key, 2) for i, key in key_of.items()}
        w2.start()
        restored = re.compile(rf"restored {re.escape(topic)} partition (\d+)")
        moved = {int(p) for p in wait_until(lambda: restored.findall(w2.log()), what="w2 restores a partition")}
        kept = {0, 1} - moved
        assert len(moved) == 1 and len(kept) == 1
        (p_kept,) = kept
        w1.wait_for(f"restored {topic} partition {p_kept}", 60, count=2)  # restored again after the rebalance
        expected = sorted(i for i in range(20) if owner[i] in kept)
        wait_until(lambda: ids(client, topic) == expected, what="the moved partition emptied, the kept one whole")
        deleted = {m.key().decode() for m in read_all(kafka_bootstrap, f"{topic}.sow", 2) if headers_of(m).get("sow-op") == "delete"}
        assert deleted == {key_of[i] for i in range(20) if owner[i] in moved}
    finally:
        w2.kill()
        w1.kill()


def test_transient_relays_without_merging(kafka_bootstrap, unique_name, tmp_path):
    topic = unique_name
    w, client = start(kafka_bootstrap, tmp_path, topic, persistence="transient")
    try:
        client.publish(topic, {"id": 1, "a": 1})
        client.flush()
        client.publish(topic, {"id": 1, "b": 2}, delta=True)
        client.flush()
        diffs = wait_until(lambda: (d := read_all(kafka_bootstrap, f"{topic}.diff")) and len(d) == 2 and d)
        assert [orjson.loads(m.value()) for m in diffs] == [{"id": 1, "a": 1}, {"id": 1, "b": 2}]
    finally:
        w.kill()


def test_capacity_evicts_the_least_recently_updated(kafka_bootstrap, unique_name, tmp_path):
    topic = unique_name
    w, client = start(kafka_bootstrap, tmp_path, topic, capacity=4, partitions=1)
    try:
        for i in range(4):
            client.publish(topic, {"id": i})
            client.flush()
        wait_until(lambda: ids(client, topic) == [0, 1, 2, 3])
        client.publish(topic, {"id": 0, "touched": True}, delta=True)  # 0 is now the most recent
        client.flush()
        wait_until(lambda: any(e.record.get("touched") for e in client.query(topic)))
        client.publish(topic, {"id": 9})
        client.flush()
        wait_until(lambda: ids(client, topic) == [0, 2, 3, 9])
        dead = read_all(kafka_bootstrap, f"{topic}.dead", 1)
        assert [orjson.loads(m.value()) for m in dead] == [{"id": 1}]
        assert headers_of(dead[0])["sow-op"] == "evict"
        evicts = [m for m in read_all(kafka_bootstrap, f"{topic}.diff", 1) if headers_of(m)["sow-op"] == "evict"]
        assert [orjson.loads(m.value()) for m in evicts] == [{"id": 1}]
    finally:
        w.kill()


def test_capacity_rejects_new_records_but_applies_updates(kafka_bootstrap, unique_name, tmp_path):
    topic = unique_name
    w, client = start(kafka_bootstrap, tmp_path, topic, capacity=2, partitions=1, capacity_policy="reject")
    try:
        for i in range(3):
            client.publish(topic, {"id": i})
        client.flush()
        errors = wait_until(lambda: read_all(kafka_bootstrap, f"{topic}.errors", 1))
        client.publish(topic, {"id": 1, "x": 1}, delta=True)  # <topic>.delta has no order with <topic>: send it after
        client.flush()
        assert len(errors) == 1 and orjson.loads(errors[0].value()) == {"id": 2}
        assert "capacity reached" in headers_of(errors[0])["sow-error"]
        wait_until(lambda: {e.record["id"]: e.record for e in client.query(topic)} == {0: {"id": 0}, 1: {"id": 1, "x": 1}})
    finally:
        w.kill()


def test_event_ids_across_restart_and_rebalance(kafka_bootstrap, unique_name, tmp_path):
    topic = unique_name
    w1, client = start(kafka_bootstrap, tmp_path, topic)
    spec = client.spec(topic)
    for v in range(5):
        for i in range(8):
            client.publish(topic, {"id": i, "v": v})
    client.flush()
    wait_until(lambda: len(read_all(kafka_bootstrap, f"{topic}.diff")) == 40)
    w1.stop()
    w2, _ = start(kafka_bootstrap, tmp_path, topic, data="d1", name="w2")
    w3, _ = start(kafka_bootstrap, tmp_path, topic, data="d3", name="w3")  # rebalance between two workers
    try:
        for v in range(5, 10):
            for i in range(8):
                client.publish(topic, {"id": i, "v": v})
        client.flush()
        diffs = wait_until(lambda: (d := read_all(kafka_bootstrap, f"{topic}.diff")) and len(d) == 80 and d, timeout=90)
        seqs = [int(headers_of(m)["sow-seq"]) for m in diffs]
        assert len(set(seqs)) == len(seqs)  # unique within the topic
        per_key: dict[bytes, list[int]] = {}
        for m in diffs:
            per_key.setdefault(m.key(), []).append(int(headers_of(m)["sow-seq"]))
        for key, values in per_key.items():
            assert values == sorted(values) and len(values) == 10  # increasing per key, across both restarts
            assert {v & 1023 for v in values} == {owner_partition(key.decode(), spec.partitions)}
    finally:
        w2.kill()
        w3.kill()


def test_subscriber_resumes_after_a_bookmark(kafka_bootstrap, unique_name, tmp_path):
    topic = unique_name
    w, client = start(kafka_bootstrap, tmp_path, topic)
    try:
        load(client, topic, 5)
        snapshot = list(client.subscribe(topic, sow=True, timeout=1))
        assert sorted(e["record"]["id"] for e in snapshot) == list(range(5))
        bookmark = snapshot[-1]["bookmark"]
        assert len(bookmark.split(",")) == 4  # one event ID per partition
        client.publish(topic, {"id": 1, "v": 1})
        client.publish(topic, {"id": 3, "v": 1}, delta=True)
        client.delete(topic, data={"id": 4})
        client.flush()
        wait_until(lambda: ids(client, topic) == [0, 1, 2, 3])
        events = list(client.subscribe(topic, after=bookmark, timeout=2))
        got = sorted((e["op"], orjson.dumps(e["record"])) for e in events)
        assert got == sorted([("sow", b'{"id":1,"v":1}'), ("sow", b'{"id":3,"v":1}'), ("delete", b"null")])
        assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    finally:
        w.kill()


def test_a_resume_tells_records_that_expired_unswept_as_expired(kafka_bootstrap, unique_name, tmp_path):
    """Audit: records past their instant that no worker had expired yet (here: none runs) were
    left out of a resume's state without a word: one changed after the bookmark came as op "sow",
    one the subscriber held from before it was never told gone, and the worker's expire tombstone
    later found nothing to tell. Each now comes as an expire; a live record as "sow".

    The lifetimes leave the worker 10 s to show all four records alive before it is killed (with
    3 s, a loaded CI machine let records 1 and 2 expire first)."""
    topic = unique_name
    w, client = start(kafka_bootstrap, tmp_path, topic, expiration="enabled")
    try:
        client.publish(topic, {"id": 0, "v": 0})  # never expires
        for i in (1, 2):
            client.publish(topic, {"id": i, "v": 0}, expiration="10s")
        client.flush()
        wait_until(lambda: ids(client, topic) == [0, 1, 2])
        bookmark = list(client.subscribe(topic, sow=True, timeout=1))[-1]["bookmark"]
        client.publish(topic, {"id": 3, "v": 0}, expiration="10s")
        client.flush()
        all_due = time.time() + 10.5  # record 3 reached Kafka before this
        client.publish(topic, {"id": 0, "v": 1})
        client.flush()
        wait_until(lambda: ids(client, topic) == [0, 1, 2, 3])
    finally:
        w.kill()  # nothing sweeps from here
    time.sleep(max(0.0, all_due - time.time()))
    events = list(client.subscribe(topic, after=bookmark, timeout=1))
    key_of = {client.spec(topic).key_spec.sow_key({"id": i}): i for i in range(4)}
    got = sorted((key_of[e["sow_key"]], e["op"], e["record"]) for e in events)
    assert got == [(0, "sow", {"id": 0, "v": 1}), (1, "expire", None), (2, "expire", None), (3, "expire", None)]
    quiet = list(client.subscribe(topic, after=bookmark, no_sowkey=True, oof=True, timeout=1))
    assert sorted((e["op"], orjson.dumps(e["record"])) for e in quiet if e["op"] == "expire") == [
        ("expire", b'{"id":1}'), ("expire", b'{"id":2}'), ("expire", b'{"id":3}')]  # no SowKey: the key fields say which


def test_a_delete_no_worker_applied_in_time_is_reported_pending(kafka_bootstrap, unique_name, tmp_path):
    """Newcomer audit: with no worker running, `ksow delete` printed {"deleted":0} after its wait,
    and the delete was applied when a worker started. It now says how many are pending."""
    import subprocess
    import sys

    topic = unique_name
    w, client = start(kafka_bootstrap, tmp_path, topic)
    load(client, topic, 3)
    wait_until(lambda: ids(client, topic) == [0, 1, 2])
    w.kill()
    assert client.delete(topic, data={"id": 1}, wait=2) == 0 and client.last_delete_pending == 1
    cli = subprocess.run([sys.executable, "-m", "processor.cli", "delete", topic, "--bootstrap", kafka_bootstrap, "--topology",
                          str(tmp_path / f"{topic}.yaml"), "--group", f"g-{topic}", "--filter", "/id >= 1", "--wait", "2"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and orjson.loads(cli.stdout) == {"deleted": 0, "pending": 2}, cli
    assert "not deleted within --wait 2s" in cli.stderr
    w2, _ = start(kafka_bootstrap, tmp_path, topic, name="w2")
    try:
        wait_until(lambda: ids(client, topic) == [0])  # applied once a worker runs
    finally:
        w2.kill()


def test_a_resume_misses_nothing_the_subscriber_was_not_given(kafka_bootstrap, unique_name, tmp_path):
    """Audit: a subscriber that resumed after the event ID it saw last lost records. Event IDs
    increase per partition, and the partitions' changes reach a subscriber interleaved: changes of
    other partitions with lower IDs came after it. Cut a live stream at several events: resuming
    after that event's bookmark gives exactly the records changed after it in the stream, and an
    event ID alone gives them all too (its other partitions start over). In a run here, resuming
    after the event ID as before (every change with a higher ID) missed 96 and 118 records at two
    of the three cuts, with one worker."""
    topic = unique_name
    w, client = start(kafka_bootstrap, tmp_path, topic)
    try:
        load(client, topic, 400)
        live = client.subscribe(topic, sow=False, timeout=3)
        for rnd in range(1, 4):
            for i in range(400):
                client.publish(topic, {"id": i, "v": rnd})
        client.flush()
        events = list(live)
        assert len(events) == 1200 and all(e["op"] == "update" for e in events)  # live: the SOW's op
        behind = sum(1 for a, b in zip(events, events[1:]) if b["seq"] < a["seq"])
        for cut in (150, 600, 1100):
            after = {e["record"]["id"] for e in events[cut + 1:]}
            resumed = list(client.subscribe(topic, after=events[cut]["bookmark"], timeout=1))
            assert {e["record"]["id"] for e in resumed} == after, (cut, behind)
            assert all(e["record"]["v"] == 3 for e in resumed)
            by_id = list(client.subscribe(topic, after_seq=events[cut]["seq"], timeout=1))
            assert {e["record"]["id"] for e in by_id} >= after
    finally:
        w.kill()


# The table of docs/topology.md that maps each UM channel type and AMPS SOW kind to ksow settings:
# every row is checked here, so the table cannot say what the workers do not do.
_TABLE = Path(__file__).resolve().parents[2] / "docs" / "topology.md"
_PENDING: dict[str, str] = {}  # rows whose behaviour the engine does not have yet (strict xfail: they fail once it does)


@dataclass(frozen=True)
class Row:
    source: str
    options: tuple[tuple[str, str], ...]
    after_restart: str  # kept | lost | nothing stored
    event_ids: str  # continue


def _rows() -> list[Row]:
    text = _TABLE.read_text()
    body = text[text.index("<!-- channel-types: begin -->") : text.index("<!-- channel-types: end -->")]
    rows = []
    for line in body.splitlines()[3:]:
        if line.startswith("|"):
            source, _, settings, after, ids = (c.strip() for c in line.strip("|").split("|"))
            rows.append(Row(source, tuple(re.findall(r"`(\w+): ([^`]+)`", settings)), after, ids))
    return rows


def _param(row: Row):
    persistence = dict(row.options)["persistence"]
    marks = [pytest.mark.xfail(strict=True, reason=_PENDING[persistence])] if persistence in _PENDING else []
    return pytest.param(row, id=row.source, marks=marks)


@dataclass
class Restarted:
    before: list[int]  # the ids a query returned before the restart
    query: list[int]  # ... and after it (one more record was published after the restart)
    snapshot: list[int]  # what `subscribe --sow` returned after it
    seqs_before: list[int]  # every sow-seq on <topic>.sow before the restart
    seqs_after: list[int]  # ... and the ones written after it


_runs: dict[tuple, Restarted] = {}


@pytest.fixture
def restarted(kafka_bootstrap, tmp_path_factory):
    """Run a topic with the given settings through a worker restart, once per distinct settings."""

    def run(options: tuple[tuple[str, str], ...]) -> Restarted:
        if options not in _runs:
            tmp = tmp_path_factory.mktemp("channel")
            topic = f"t_channel_{dict(options)['persistence']}_{uuid.uuid4().hex[:8]}"
            # Where the events are: `.sow`, or `.diff` for a transient topic (it keeps no SOW).
            events = f"{topic}.diff" if dict(options)["persistence"] == "transient" else f"{topic}.sow"
            w, client = start(kafka_bootstrap, tmp, topic, **dict(options))
            try:
                for i in range(5):
                    client.publish(topic, {"id": i, "v": i})
                client.flush()
                wait_until(lambda: len(read_all(kafka_bootstrap, events)) >= 5)
                before = ids(client, topic)
                w.stop()
            finally:
                w.kill()
            seqs_before = [int(headers_of(m)["sow-seq"]) for m in read_all(kafka_bootstrap, events)]
            w2, _ = start(kafka_bootstrap, tmp, topic, name="w2", **dict(options))
            try:
                client.publish(topic, {"id": 5, "v": 5})
                client.flush()
                key = client.spec(topic).key_spec.sow_key({"id": 5})
                wait_until(lambda: any(m.key().decode() == key for m in read_all(kafka_bootstrap, events)))
                after = read_all(kafka_bootstrap, events)
                seqs_after = [int(headers_of(m)["sow-seq"]) for m in after if int(headers_of(m)["sow-seq"]) not in set(seqs_before)]
                if dict(options)["persistence"] == "simple":
                    # The worker restores its partitions one after another and purges each as its
                    # restore ends: record 5 may be applied in one before another is purged (seen
                    # once on a loaded machine: `.sow` read [0, 4, 5], then [5]). The restart is over
                    # once every partition is purged; a purge that never comes fails here.
                    wait_until(lambda: not set(ids(client, topic)) & set(range(5)), 60, "the records from before the restart purged")
                snapshot = sorted(e["record"]["id"] for e in client.subscribe(topic, sow=True, timeout=1))
                _runs[options] = Restarted(before, ids(client, topic), snapshot, seqs_before, seqs_after)
            finally:
                w2.kill()
        return _runs[options]

    return run


@pytest.mark.parametrize("row", [_param(r) for r in _rows()])
def test_channel_type_row(restarted, row):
    """What survives a restart, and that event IDs go on, as docs/topology.md says for this row."""
    run = restarted(row.options)
    stored = {"kept": list(range(6)), "lost": [5], "nothing stored": []}[row.after_restart]
    assert run.before == (list(range(5)) if stored else [])
    assert (run.query, run.snapshot) == (stored, stored)
    assert row.event_ids == "continue"  # ksow never reuses an event ID, whatever the source did
    assert run.seqs_after and min(run.seqs_after) > max(run.seqs_before)


def test_the_table_has_every_source_of_the_seeds():
    sources = {r.source.split(",")[0] for r in _rows()}
    channels = {f"UM {t} channel" for t in ("Persistent", "Mixed", "Reliable", "Simple", "Transient", "Off-heap", "Paged")}
    assert channels | {"AMPS persistent SOW topic", "AMPS transient SOW topic", "AMPS topic without a SOW"} == sources


def test_a_transient_partitions_next_owner_numbers_its_events_after_the_last_owners(kafka_bootstrap, unique_name, tmp_path):
    """A transient topic keeps no changelog, so a new owner of a partition took its event counter from
    its own clock alone: IDs an owner whose clock ran ahead had handed out could come again (sow-seq
    is never reused). It now reads the last events of `.diff`; here one an hour ahead of the clock."""
    from .workers import producer, send

    topic = unique_name
    w1, client = start(kafka_bootstrap, tmp_path, topic, persistence="transient", partitions=1)
    try:
        client.publish(topic, {"id": 1})
        client.flush()
        wait_until(lambda: len(read_all(kafka_bootstrap, f"{topic}.diff", 1)) == 1)
    finally:
        w1.kill()
    ahead = (int(time.time() * 1000) + 3_600_000) * 1000 << 10  # partition 0's, as an owner with a clock an hour ahead numbers them
    p = producer(kafka_bootstrap)
    send(p, f"{topic}.diff", {"id": 2}, b"k2", headers=[("sow-key", b"k2"), ("sow-op", b"insert"), ("sow-seq", b"%d" % ahead)])
    p.flush(10)
    w2, _ = start(kafka_bootstrap, tmp_path, topic, data="d2", name="w2", persistence="transient", partitions=1)
    try:
        client.publish(topic, {"id": 3})
        client.flush()
        events = wait_until(lambda: (d := read_all(kafka_bootstrap, f"{topic}.diff", 1)) and len(d) == 3 and d)
        assert orjson.loads(events[2].value()) == {"id": 3}
        assert int(headers_of(events[2])["sow-seq"]) > ahead
    finally:
        w2.kill()
