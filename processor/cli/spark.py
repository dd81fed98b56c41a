"""`ksow snapshot`, `ksow replay` and `ksow sql`: the Spark commands.

`register(main)` adds them to the `ksow` group; nothing here imports pyspark until a command
runs, so `ksow --help` and the other commands start without a JVM. Also runnable on its own:
`python -m processor.cli.spark snapshot ...`.
"""

from __future__ import annotations

import sys
import tempfile
from datetime import date, datetime
from decimal import Decimal

import click
import orjson

from processor.cli.options import connection

MASTER = click.option("--master", envvar="KSOW_SPARK_MASTER", default="local[*]", show_default=True, help="Spark master (env KSOW_SPARK_MASTER), e.g. local[2], spark://host:7077, yarn.")


def _write(line: bytes) -> None:
    sys.stdout.buffer.write(line + b"\n")


def _setup(bootstrap: str | None, topology: str | None, master: str, app: str):
    """Bootstrap, topology and a SparkSession, or a clear error before any JVM starts."""
    from processor.kafka.clients import resolve_bootstrap
    from processor.topology import TopologyError, load_topology

    resolved = resolve_bootstrap(bootstrap)
    if not resolved:
        raise click.ClickException("no Kafka bootstrap: pass --bootstrap or set KAFKA_BOOTSTRAP")
    try:
        topo = load_topology(topology)
    except TopologyError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise click.ClickException("the Spark commands need pyspark: pip install 'ksow[spark]'") from None
    from processor.batch.session import get_spark

    return resolved, topo, lambda: get_spark(master, app)


def _spec(topo, topic: str):
    """The topic a snapshot or a replay rebuilds, or a clear error before any JVM starts."""
    from processor.batch.snapshot import SnapshotError, check_batch_topic
    from processor.topology import TopologyError

    view = topo.view(topic)
    if view is not None:
        raise click.ClickException(f"{topic!r} is a view of the SOW topic {view.topic!r}: the Spark commands rebuild SOW topics, give {view.topic!r}")
    try:
        spec = topo.topic(topic)
        check_batch_topic(spec)
    except (TopologyError, SnapshotError) as exc:
        raise click.ClickException(str(exc)) from None
    return spec


def _instant(text: str, option: str) -> int:
    from processor.batch.snapshot import SnapshotError, parse_instant

    try:
        return parse_instant(text)
    except SnapshotError as exc:
        raise click.ClickException(f"{option}: {exc}") from None


def _json_default(value):
    if isinstance(value, Decimal):  # Spark reads JSON integers past 64 bits as decimal(20,0) and wider
        if value.as_tuple().exponent >= 0:  # a whole number (decimal(20,0)): exactly, not as a float
            whole = int(value)
            return whole if -(1 << 63) <= whole < 1 << 64 else str(whole)  # orjson writes 64-bit integers
        return float(value)
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return value.decode(errors="replace")
    raise TypeError


@click.command()
@connection
@MASTER
@click.argument("topic")
@click.option("--as-of", "as_of", required=True, help="The instant: epoch milliseconds or ISO-8601 (UTC unless a zone is given).")
@click.option("--filter", "filter_", default=None, help="Keep only the records matching this filter.")
@click.option("--out", default=None, type=click.Path(), help="Write Parquet here (sow_key, record, expires_at, updated_at) instead of JSON lines.")
def snapshot(bootstrap, topology, master, topic, as_of, filter_, out) -> None:
    """The SOW of TOPIC exactly as it stood at an instant, rebuilt from its input topics."""
    from processor.core.filters import FilterError, compile_filter
    from processor.batch.snapshot import SnapshotError, write_snapshot

    instant = _instant(as_of, "--as-of")
    if filter_:
        try:
            compile_filter(filter_)
        except FilterError as exc:
            raise click.ClickException(f"--filter: {exc}") from None
    resolved, topo, spark = _setup(bootstrap, topology, master, "ksow-snapshot")
    spec = _spec(topo, topic)
    try:
        if out:
            write_snapshot(spark(), resolved, spec, instant, out, filter_)
            click.echo(f"snapshot of {topic} at {instant} written to {out}", err=True)
            return
        with tempfile.TemporaryDirectory(prefix="ksow-snapshot-") as tmp:
            path = f"{tmp}/sow.parquet"
            write_snapshot(spark(), resolved, spec, instant, path, filter_)
            _print_parquet(path)
    except SnapshotError as exc:
        raise click.ClickException(str(exc)) from None


def _print_parquet(path: str) -> None:
    """JSON lines from a snapshot's Parquet: the record text is copied as Spark wrote it (as
    published, for a record of one write), unless it spans lines (then it is written compact)."""
    import pyarrow.parquet as pq

    for batch in pq.read_table(path).to_batches():
        for row in batch.to_pylist():
            head = orjson.dumps({"sow_key": row["sow_key"], "expires_at": row["expires_at"], "updated_at": row["updated_at"]})
            record = row["record"].encode()
            if b"\n" in record or b"\r" in record:
                record = orjson.dumps(orjson.loads(record))
            _write(head[:-1] + b',"record":' + record + b"}")


@click.command()
@connection
@MASTER
@click.argument("topic")
@click.option("--from", "start", required=True, help="Start instant: epoch milliseconds or ISO-8601.")
@click.option("--to", "end", default=None, help="End instant (default: everything so far).")
def replay(bootstrap, topology, master, topic, start, end) -> None:
    """The SOW of TOPIC at --from (op "sow"), then every change after it, as JSON lines."""
    from processor.batch.replay import replay as run
    from processor.batch.snapshot import SnapshotError

    first = _instant(start, "--from")
    last = _instant(end, "--to") if end else None
    if last is not None and last < first:
        raise click.ClickException(f"--to {end} ({last}) is before --from {start} ({first})")
    resolved, topo, spark = _setup(bootstrap, topology, master, "ksow-replay")
    spec = _spec(topo, topic)
    try:
        for item in run(spark(), resolved, spec, first, last):
            _write(orjson.dumps(item))
    except SnapshotError as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@connection
@MASTER
@click.argument("query")
@click.option("--out", default=None, type=click.Path(), help="Write the result as Parquet here instead of JSON lines.")
def sql(bootstrap, topology, master, query, out) -> None:
    """Spark SQL over the current SOW: each SOW topic is a view named like it (dots -> underscores)."""
    from processor.batch.sql import run_sql

    resolved, topo, spark = _setup(bootstrap, topology, master, "ksow-sql")
    session = spark()
    try:
        df = run_sql(session, resolved, topo, query)
        if out:
            df.write.parquet(out)
            return
        for row in df.toLocalIterator():
            _write(orjson.dumps(row.asDict(recursive=True), default=_json_default))
    except Exception as exc:  # ours, or Spark's ParseException, AnalysisException & co: a message, not a trace
        if isinstance(exc, ValueError) or type(exc).__module__.startswith(("pyspark", "py4j")):
            raise click.ClickException(error_message(exc)) from None
        raise


def error_message(exc: BaseException) -> str:
    """The first non-blank line of an error: Spark's messages start with a newline (a
    ParseException's first line is empty) and go on with the query and a plan."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def register(group: click.Group) -> None:
    """Add the Spark commands to the `ksow` group."""
    for command in (snapshot, replay, sql):
        group.add_command(command)


@click.group()
def main() -> None:
    """ksow's Spark commands (normally reached as `ksow snapshot|replay|sql`)."""


register(main)

if __name__ == "__main__":  # pragma: no cover
    main()
