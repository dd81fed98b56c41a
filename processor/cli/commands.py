"""The `ksow` command line."""

from __future__ import annotations

import contextlib
import os
import sys
from functools import partial
from pathlib import Path
from typing import NoReturn

import click
import orjson

from processor.cli.options import SECONDS, connection
from processor.topology import TopologyError, load_topology, schema_base



def _print(obj) -> None:
    sys.stdout.buffer.write(orjson.dumps(obj) + b"\n")
    sys.stdout.flush()


def _fail(message: str) -> None:
    raise click.ClickException(message)


def _client(bootstrap: str | None, topology: str | None, group: str | None = None, web_token: str | None = None):
    from processor.client.sow_client import Client, ClientError

    try:
        client = Client(bootstrap, topology, group, web_token)
    except (ClientError, TopologyError) as exc:
        _fail(str(exc))
    click.get_current_context().find_root().obj = {"bootstrap": client.bootstrap}  # named if Kafka cannot be reached
    return client


@contextlib.contextmanager
def _client_errors():
    from processor.client.sow_client import ClientError
    from processor.core.durations import DurationError
    from processor.core.paths import PathError

    try:
        from processor.core.filters import FilterError
    except ImportError:  # pragma: no cover - the filter module ships with the package
        FilterError = ValueError  # type: ignore[misc,assignment]
    try:
        yield
    except (ClientError, TopologyError, DurationError, FilterError, PathError) as exc:
        _fail(str(exc))


GROUP = click.option("--group", envvar="KSOW_GROUP", default="ksow", show_default=True, help="Consumer group of the workers to ask (env KSOW_GROUP).")
WEB_TOKEN = click.option("--web-token", envvar="KSOW_WEB_TOKEN", default=None, help="Bearer token the workers' HTTP endpoints require.")


def _split(text: str | None) -> list[str] | None:
    return [x.strip() for x in text.split(",") if x.strip()] if text else None


DIAGNOSE_S = 3.0  # after a command failed to reach Kafka, how long a fresh client may take to say why


class _Commands(click.Group):
    """Errors meant for the user (bad settings, a cluster that refuses us) end the command with
    one line and exit status 1, not a traceback."""

    def invoke(self, ctx: click.Context):
        from processor.contract.errors import KsowError

        try:
            return super().invoke(ctx)
        except KsowError as exc:
            raise click.ClickException(str(exc)) from None
        except Exception as exc:
            # Not imported here: `ksow up` executes itself again before librdkafka loads
            # (_faust_allocator). A KafkaException comes only from a command that loaded it.
            kafka = sys.modules.get("confluent_kafka")
            if kafka is None or not isinstance(exc, kafka.KafkaException):
                raise
            err = exc.args[0] if exc.args else None
            reason = err.str() if err is not None and hasattr(err, "str") else str(exc)
            if err is not None and hasattr(err, "code") and err.code() in (kafka.KafkaError._TRANSPORT, kafka.KafkaError._ALL_BROKERS_DOWN, kafka.KafkaError._TIMED_OUT):
                address = (ctx.obj or {}).get("bootstrap")
                if address:
                    # The failed call only says "transport failure": a refused login or certificate is
                    # told to error callbacks, which a fresh client asks for.
                    from processor.kafka.clients import KafkaRefused, KafkaUnreachable, reach

                    try:
                        reach(address, DIAGNOSE_S)
                    except KafkaRefused as why:
                        raise click.ClickException(str(why)) from None
                    except KafkaUnreachable as why:
                        if why.cause:
                            reason += f" ({why.cause})"
                    reason += f" (Kafka at {address}: are --bootstrap (KAFKA_BOOTSTRAP) and --kafka-config right, and is it up?)"
            raise click.ClickException(f"Kafka: {reason}") from None


@click.group(cls=_Commands)
@click.version_option(package_name="ksow")
def main() -> None:
    """ksow: State of the World for Kafka."""


@main.command()
@click.option("--port", type=int, default=None, help="Port to listen on (default: a free one).")
@click.option("--secured", is_flag=True,
              help="SASL/SCRAM-SHA-512 over TLS with an authorizer; the second line of output is the client "
              "properties file to pass as --kafka-config.")
def broker(port: int | None, secured: bool) -> None:
    """Run the embedded Kafka broker in the foreground; first line: its bootstrap address."""
    from processor.kafka.embedded import BrokerError, run_foreground

    try:
        run_foreground(port, secured=secured)
    except BrokerError as exc:
        _fail(str(exc))


@contextlib.contextmanager
def _bootstrap_or_embedded(bootstrap: str | None):
    """Yield a bootstrap address; without one, start the embedded broker for the duration."""
    from processor.kafka.clients import resolve_bootstrap

    bootstrap = resolve_bootstrap(bootstrap)
    if bootstrap:
        yield bootstrap
        return
    from processor.kafka.config import kafka_config, security_protocol
    from processor.kafka.embedded import EmbeddedKafka

    protocol = security_protocol(kafka_config().properties)
    if protocol != "PLAINTEXT":  # meant for a secured cluster: the embedded broker is plaintext, and not that cluster
        _fail(f"no Kafka bootstrap (--bootstrap, KAFKA_BOOTSTRAP or bootstrap.servers in the client settings), but the "
              f"client settings are for a secured cluster (security.protocol={protocol}): give its address rather than "
              "starting the embedded broker")
    click.echo("no --bootstrap or KAFKA_BOOTSTRAP: starting the embedded Kafka broker...", err=True)
    with EmbeddedKafka() as kafka:
        click.echo(f"embedded Kafka broker at {kafka.bootstrap}", err=True)
        yield kafka.bootstrap


def _topology_for_worker(topology: str | None):
    """The topology a worker runs, its warnings told to the operator at start."""
    try:
        topo = load_topology(topology)
    except TopologyError as exc:
        _fail(str(exc))
    for warning in topo.warnings():
        click.echo(f"warning: {warning}", err=True)
    return topo


def _check_schemas(topology: str | None) -> None:
    """Exit 1 when the topology cannot be read, or a SOW topic's Avro schema cannot."""
    from processor.contract.errors import ConfigError

    try:
        for spec in load_topology(topology).sow:
            spec.codec(schema_base(topology))
    except ConfigError as exc:
        _fail(str(exc))


def _loop_settings(guarantee: str | None, static: bool):
    """The worker loop's settings from the options and the environment (exit 1 on a bad one)."""
    from processor.contract.errors import ConfigError
    from processor.runners.faust.loop import Guarantee, LoopSettings

    try:
        return LoopSettings.from_env(guarantee=Guarantee(guarantee) if guarantee else None, static_membership=static or None)
    except ConfigError as exc:
        _fail(str(exc))


def _worker(bootstrap: str, topology: str | None, group: str, data_dir: str | None, web, guarantee: str | None = None, static: bool = False,
            stores_dir: str | None = None):
    from processor.runners.faust.worker import SowWorker

    topo = _topology_for_worker(topology)
    topology_dir = schema_base(topology)
    settings = _loop_settings(guarantee, static)
    return SowWorker(topo, bootstrap, group=group, data_dir=Path(data_dir) if data_dir else None, topology_dir=topology_dir,
                     settings=settings, web=web, stores_dir=Path(stores_dir) if stores_dir else None)


WORKER_OPTIONS = [
    click.option("--group", envvar="KSOW_GROUP", default="ksow", show_default=True, help="Consumer group (and Faust app id) of the workers."),
    click.option("--data-dir", envvar="KSOW_DATA_DIR", default=None, help="Folder for this worker's RocksDB stores."),
    click.option("--web-port", type=click.IntRange(0, 65535), default=None, help="Port of this worker's HTTP endpoint (default or 0: a free one)."),
    click.option("--web-host", envvar="KSOW_WEB_HOST", default=None, help="Host name clients use to reach this worker, and the address bound (default 127.0.0.1)."),
    click.option("--web-bind", envvar="KSOW_WEB_BIND", default=None, help="Address to listen on when it differs from --web-host (e.g. 0.0.0.0 in a container)."),
    click.option("--web-token", envvar="KSOW_WEB_TOKEN", default=None, help="Bearer token every HTTP request must carry."),
    click.option("--web-cert", envvar="KSOW_WEB_CERT", default=None, type=click.Path(dir_okay=False), help="PEM certificate (chain): serve HTTPS."),
    click.option("--web-key", envvar="KSOW_WEB_KEY", default=None, type=click.Path(dir_okay=False), help="PEM private key of --web-cert."),
    click.option("--processing-guarantee", "guarantee", envvar="KSOW_PROCESSING_GUARANTEE", type=click.Choice(["exactly_once", "at_least_once"]),
                 default="exactly_once", show_default=True,
                 help="exactly_once: outputs and input offsets commit in one Kafka transaction; at_least_once: no transactions."),
    click.option("--workers", type=click.IntRange(1, 256), envvar="KSOW_WORKERS", default=1, show_default=True,
                 help="Worker processes to run on this host, each a member of the group with its HTTP port (--web-port + i); "
                      "they share the stores of --data-dir, so a partition moving between them, or from N workers to M, "
                      "replays only what changed: a worker's loop uses one core."),
    click.option("--static-membership", "static", is_flag=True, envvar="KSOW_STATIC_MEMBERSHIP",
                 help="Join the group as this worker's stable identity (host and data folder): a restart within the "
                      "session timeout takes its partitions back without a rebalance; a stopped worker's partitions "
                      "move only when its session times out."),
]


def _web_settings(web_port, web_host, web_bind, web_token, web_cert, web_key):
    """The worker's HTTP settings, checked now (exit 1 on a bad one, before anything starts)."""
    from processor.contract.errors import ConfigError
    from processor.contract.limits import check_environment
    from processor.runners.faust.web import WebSettings
    from processor.runners.faust.worker import free_port

    try:
        check_environment()
        settings = WebSettings.from_env(web_port or free_port(), web_host, web_bind, web_token, web_cert, web_key)
        settings.ssl_context()
        settings.check_port()
    except ConfigError as exc:
        _fail(str(exc))
    return settings


def _ports_free(web, ports) -> None:
    """Exit 1 unless the worker's HTTP address is free on each of these ports too."""
    from dataclasses import replace

    from processor.contract.errors import ConfigError

    try:
        for port in ports:
            replace(web, port=port).check_port()
    except ConfigError as exc:
        _fail(str(exc))


def _worker_options(fn):
    for option in reversed(WORKER_OPTIONS):
        fn = option(fn)
    return fn


def _faust_allocator(ctx: click.Context, param: click.Parameter, engine: str) -> str:
    """A Faust worker executes itself again with its allocator preloaded (processor/runners/faust/
    allocator.py). `--engine` is eager so this comes before any other option is read: checking
    --kafka-config loads librdkafka, which the process executed again would load once more."""
    if engine == "faust" and not ctx.resilient_parsing:
        from processor.contract.errors import ConfigError
        from processor.runners.faust.allocator import run_with_allocator

        try:
            run_with_allocator()
        except ConfigError as exc:
            _fail(str(exc))
    return engine


@main.command()
@connection
@_worker_options
@click.option("--loglevel", default="info", show_default=True)
@click.option("--engine", type=click.Choice(["faust", "spark"]), default="faust", show_default=True, envvar="KSOW_ENGINE", is_eager=True,
              callback=_faust_allocator,
              help="faust: the Faust worker (RocksDB stores); spark: Spark Structured Streaming (transformWithState).")
@click.option("--checkpoint-dir", envvar="KSOW_SPARK_CHECKPOINT_DIR", default=None,
              help="spark engine: offsets and state (default ~/.cache/ksow/spark-checkpoints/<group>); restart with the same one to carry on.")
@click.option("--master", envvar="KSOW_SPARK_MASTER", default="local[*]", show_default=True, help="spark engine: the Spark master.")
@click.option("--trigger", default="1 second", show_default=True, help="spark engine: micro-batch interval (a Spark processing-time trigger).")
@click.option("--stores-dir", hidden=True, default=None)  # a pool's worker: the pool's folder, whose stores its workers share
def up(bootstrap, topology, group, data_dir, web_port, web_host, web_bind, web_token, web_cert, web_key, guarantee, workers, static, loglevel, engine, checkpoint_dir, master, trigger,
       stores_dir) -> None:
    """Run a worker for the topology (starting the embedded broker when no bootstrap is given).

    `--engine spark` maintains the same SOW topics with Spark Structured Streaming instead of Faust
    (see docs/spark.md); `--data-dir`, `--web-port`, `--web-host` and `--workers` are for the Faust
    engine only.
    """
    from processor.kafka.config import kafka_config

    settings = kafka_config().describe()
    if settings:  # what a worker connects with belongs in its log (secrets masked)
        click.echo(f"Kafka client settings:\n{settings}", err=True)
    if engine == "spark":
        if workers > 1:
            _fail("--workers is for the faust engine (Spark runs its own executors: --master)")
        _up_spark(bootstrap, topology, group, checkpoint_dir, master, trigger)
        return
    _check_schemas(topology)  # a schema a worker could not read stops it (or the pool) before it connects
    web = _web_settings(web_port, web_host, web_bind, web_token, web_cert, web_key)
    if web_port and workers > 1:  # worker i of a pool serves at web_port + i: each port is checked now
        if web_port + workers - 1 > 65535:
            _fail(f"--web-port {web_port} with --workers {workers} needs ports up to {web_port + workers - 1}, past 65535")
        _ports_free(web, range(web_port + 1, web_port + workers))
    _loop_settings(guarantee, static)  # what a worker would refuse stops it (or the pool) before it connects
    if workers > 1:
        from processor.contract.errors import ConfigError
        from processor.runners.faust.stores import adopt_worker_stores, hold_data_dir
        from processor.runners.faust.worker import default_data_dir

        base = Path(data_dir) if data_dir else default_data_dir(group, _topology_for_worker(topology))
        _usable_folder(base)
        try:
            pool_lock = hold_data_dir(base)  # for the pool's life: no single worker on its stores beside it
        except ConfigError as exc:
            _fail(str(exc))
        adopt_worker_stores(base)
    elif data_dir:
        _usable_folder(Path(data_dir))
    with _bootstrap_or_embedded(bootstrap) as address:
        if workers > 1:
            argv = partial(_pool_worker_argv, address, topology, group, base, web_port, web_host, web_bind, guarantee, static, loglevel)
            # Secrets go to the workers through their environment, not their command lines (`ps`).
            env = {**os.environ, **{k: v for k, v in (("KSOW_WEB_TOKEN", web_token), ("KSOW_WEB_CERT", web_cert), ("KSOW_WEB_KEY", web_key)) if v}}
            from processor.runners.faust.pool import WorkerPool

            click.echo(f"ksow: {workers} worker processes, group {group}, bootstrap {address}, {guarantee}", err=True)
            try:
                status = WorkerPool(workers, argv, env, say=lambda line: click.echo(f"ksow: {line}", err=True)).run()
            finally:
                pool_lock.close()
            if status:
                sys.exit(status)
            return
        from confluent_kafka import KafkaException

        from processor.contract.errors import ConfigError

        _reachable_or_exit(address)
        try:
            worker = _worker(address, topology, group, data_dir, web, guarantee, static, stores_dir)
        except KafkaException as exc:  # the transactional producer's start: the cluster did not answer in time
            _startup_failed(f"Kafka at {address}: {exc.args[0].str() if exc.args else exc}")
        except ConfigError as exc:
            _startup_failed(str(exc))
        from processor.runners.faust.allocator import allocator_in_use

        click.echo(f"ksow worker: group {group}, topics {', '.join(worker.topics)}, bootstrap {address}, {guarantee}, allocator {allocator_in_use()}; "
                   f"queries at {worker.web.url}/sow/<topic>, metrics at {worker.web.url}/metrics", err=True)
        try:
            worker.run(loglevel)
        except SystemExit as exc:  # Faust exits when stopped; a failure (the loop failed) keeps its status
            if exc.code not in (None, 0):
                raise


def _usable_folder(path: Path) -> None:
    if path.exists() and not path.is_dir():
        _fail(f"cannot use --data-dir {path}: it is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _fail(f"cannot use --data-dir {path}: {exc.strerror or exc}")
    if not os.access(path, os.W_OK | os.X_OK):
        _fail(f"cannot use --data-dir {path}: not writable")


REACH_TIMEOUT_S = 15.0  # how long a starting worker waits for the cluster to answer before it gives up


def _reachable_or_exit(address: str) -> None:
    """A worker that cannot reach the cluster says so and exits at once, not after its clients'
    timeouts: with SETTINGS_REFUSED when the cluster refused its login or TLS handshake (`ksow up
    --workers N` then stops, as trying again cannot help), else with STARTUP_FAILED (it retries a
    few times)."""
    from processor.kafka.clients import KafkaRefused, KafkaUnreachable, reach
    from processor.runners.faust.pool import SETTINGS_REFUSED

    try:
        reach(address, REACH_TIMEOUT_S)
    except KafkaRefused as exc:
        _startup_failed(str(exc), SETTINGS_REFUSED)
    except KafkaUnreachable as exc:
        _startup_failed(str(exc))


def _startup_failed(message: str, status: int | None = None) -> NoReturn:
    from processor.runners.faust.pool import STARTUP_FAILED

    click.echo(f"Error: {message}", err=True)
    sys.exit(STARTUP_FAILED if status is None else status)


def _pool_worker_argv(address, topology, group, base: Path, web_port, web_host, web_bind, guarantee, static, loglevel, i: int) -> list[str]:
    """The command line of worker i of `ksow up --workers N`: one worker, its own folder in `base`
    (its lock and identity), the stores it shares with the others in `base`, its port."""
    argv = [sys.executable, "-m", "processor.cli", "up", "--bootstrap", address, "--group", group,
            "--data-dir", str(base / f"worker-{i}"), "--stores-dir", str(base), "--workers", "1", "--processing-guarantee", guarantee,
            "--loglevel", loglevel]
    if topology:
        argv += ["--topology", topology]
    if web_port:
        argv += ["--web-port", str(web_port + i)]
    for option, value in (("--web-host", web_host), ("--web-bind", web_bind)):
        if value:
            argv += [option, value]
    if static:
        argv.append("--static-membership")
    return argv


def _up_spark(bootstrap: str | None, topology: str | None, group: str, checkpoint_dir: str | None, master: str, trigger: str) -> None:
    """`ksow up --engine spark`: one streaming query per SOW topic until Ctrl-C or SIGTERM."""
    import signal

    topo = _topology_for_worker(topology)
    try:
        import pyspark  # noqa: F401
    except ImportError:
        _fail("the spark engine needs pyspark: pip install 'ksow[spark]'")
    checkpoints = Path(checkpoint_dir or Path.home() / ".cache" / "ksow" / "spark-checkpoints" / group).expanduser()
    from processor.runners.spark.stream import StreamError, run_stream, wait_for

    def stop(signum, frame):  # SIGTERM stops the queries cleanly, as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    with _bootstrap_or_embedded(bootstrap) as address:
        try:
            topology_dir = schema_base(topology)  # as for the Faust worker
            _, queries = run_stream(address, topo, checkpoints, master=master, trigger=trigger, block=False, topology_dir=topology_dir)
        except KeyboardInterrupt:
            return
        except Exception as exc:  # the JVM did not start, the connector could not be resolved, ...
            _fail(f"the spark engine could not start: {_first_line(exc)}")
        names = ", ".join(s.topic for s in topo.sow)
        click.echo(f"ksow spark engine: group {group}, topics {names}, bootstrap {address}, master {master}, checkpoints {checkpoints}", err=True)
        click.echo(f"ksow spark engine: running {len(queries)} streaming queries", err=True)
        try:
            wait_for(queries)
        except StreamError as exc:
            _fail(str(exc))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


@main.command()
@connection
@click.option("--duration", type=SECONDS, default=60.0, show_default=True, help="Seconds to run (0: until Ctrl-C).")
def demo(bootstrap, topology, duration) -> None:
    """`up` plus a sample publisher and a live subscriber: SOW, deltas and expiry at work."""
    from processor.cli.demo import run_demo

    with _bootstrap_or_embedded(bootstrap) as address:
        run_demo(address, topology, duration)


@main.command()
@connection
@click.argument("topic")
@click.argument("record", required=False)
@click.option("--delta", is_flag=True, help="delta_publish: merge into the existing record.")
@click.option("--expiration", default=None, help="This record's lifetime (e.g. 30s; 0 = never).")
@click.option("--key", "sow_key", default=None, help="Publisher-supplied SowKey (topics without key fields).")
def publish(bootstrap, topology, topic, record, delta, expiration, sow_key) -> None:
    """Publish a JSON record (or JSON lines from stdin with '-')."""
    from processor.client.sow_client import ClientError

    if record is None and sys.stdin.isatty():
        _fail("give the record as JSON, or '-' to read JSON lines from stdin")
    client = _client(bootstrap, topology)
    from_stdin = record in (None, "-")
    lines = sys.stdin.buffer if from_stdin else [record]  # bytes: each line is decoded (strictly) on its own
    count = 0
    with _client_errors():
        for n, line in enumerate(lines, 1):
            try:
                text = line.decode() if isinstance(line, bytes) else line.encode().decode()  # argv: no lone surrogates
            except UnicodeError as exc:
                problem = ClientError(f"not UTF-8 text ({exc.reason} at {'byte' if isinstance(line, bytes) else 'character'} {exc.start})")
            else:
                text = text.strip()
                if not text:
                    if not from_stdin:
                        _fail("the record is empty: give it as JSON, or '-' to read JSON lines from stdin")
                    continue
                try:
                    key = client.publish(topic, text, delta=delta, expiration=expiration, sow_key=sow_key)
                    count += 1
                    continue
                except ClientError as exc:
                    problem = exc
            if not from_stdin:
                raise problem
            # Lines are sent as they are read (stdin may never end): say what became of the ones before it.
            raise ClientError(f"line {n}: {problem} ({_sent_before(client, count)})")
        client.flush()
    click.echo(f"published {count} record(s)" + (f", last SowKey {key}" if count else ""), err=True)


def _sent_before(client, count: int) -> str:
    from confluent_kafka import KafkaException

    if not count:
        return "nothing was published"
    try:
        client.flush()
    except KafkaException as exc:
        return f"the {count} record(s) before it were not confirmed: {exc}"
    return f"the {count} record(s) before it were published"


@main.command()
@connection
@click.argument("topic")
@click.option("--filter", "filter_", default=None, help="Delete every record matching this filter.")
@click.option("--keys", default=None, help="Comma-separated SowKeys to delete, any number: more than KSOW_MAX_DELETE_KEYS "
              "(default 10000), or than a live worker's, are sent as several sow_delete messages of at most that many.")
@click.option("--data", default=None, help="Delete the record this JSON would have updated.")
@GROUP
@WEB_TOKEN
@click.option("--wait", type=SECONDS, default=30.0, show_default=True, help="Seconds to wait for the workers to report the deletes (0: just send).")
def delete(bootstrap, topology, group, web_token, topic, filter_, keys, data, wait) -> None:
    """sow_delete by filter, by SowKeys or by data; prints how many records were deleted."""
    client = _client(bootstrap, topology, group, web_token)
    with _client_errors():
        count = client.delete(topic, filter=filter_, keys=_split(keys), data=data, wait=wait or None)
        client.flush()
    if count is None:
        _print({"sent": True})
        if client.last_delete_uncounted:
            click.echo(f"warning: the delete was sent but not counted: {client.last_delete_uncounted}", err=True)
        return
    pending = client.last_delete_pending
    _print({"deleted": count, "pending": pending} if pending else {"deleted": count})
    if pending:
        click.echo(f"warning: {pending} matching records were not deleted within --wait {wait:g}s: no worker of group "
                   f"{client.group} applied the delete yet (it stays on {topic} and is applied when one does)", err=True)


@main.command()
@connection
@GROUP
@WEB_TOKEN
@click.option("--json", "as_json", is_flag=True, help="One JSON line a worker (its /status answer) instead of a table.")
def status(bootstrap, topology, group, web_token, as_json) -> None:
    """The group's live workers: by SOW topic the partitions each serves, its records and its input
    lag (inputs not applied and committed yet), and its memory. Exits 1 when no worker answers."""
    client = _client(bootstrap, topology, group, web_token)
    with _client_errors():
        workers = client.status()
    if as_json:
        for worker in workers:
            _print(worker)
    elif workers:
        _status_table(workers)
    if not any("error" not in w for w in workers):
        _fail(f"no worker of group {client.group} answered" if workers else
              f"no live worker in group {client.group}: none announced itself in the registry lately")


def _status_table(workers: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("worker", "SOW topic", "partitions", "records", "input lag", "RSS", "RocksDB", "cached records")
    table.columns[0].no_wrap = True
    for worker in workers:
        if "error" in worker:
            table.add_row(worker["url"], f"[red]{worker['error']}[/red]")
            continue
        memory = (_mib(worker.get("rss_bytes")), _mib((worker.get("rocksdb_bytes") or {}).get("cache")), f"{worker.get('cached_records', 0):,}")
        for n, (topic, figures) in enumerate(sorted(worker["topics"].items())):
            table.add_row(worker["url"] if n == 0 else "", topic, ",".join(map(str, figures["partitions"])) or "-",
                          f"{figures['records']:,}", f"{figures['input_lag']:,}", *(memory if n == 0 else ()))
    console = Console(soft_wrap=True)
    if not console.is_terminal:
        console.width = 160  # a pipe or a file: no terminal width to fit
    console.print(table)


def _mib(size: int | None) -> str:
    return "?" if size is None else f"{size / 2**20:,.0f} MiB"


@main.command()
@connection
@GROUP
@WEB_TOKEN
@click.argument("topic")
@click.option("--filter", "filter_", default=None, help="Content filter, e.g. \"/status = 'open' AND /qty > 10\".")
@click.option("--keys", default=None, help="Comma-separated SowKeys.")
@click.option("--select", default=None, help="Comma-separated field paths to return.")
@click.option("--top", type=int, default=None, help="At most this many records, the first in the query's order (SowKey order without --order-by).")
@click.option("--order-by", default=None, help="Field path to sort by, optionally followed by ASC or DESC; ties in SowKey order.")
def query(bootstrap, topology, group, web_token, topic, filter_, keys, select, top, order_by) -> None:
    """SOW query: the current records, as JSON lines (answered by the workers). TOPIC may also be a
    regular expression matching whole names of SOW topics and views: then each line names its topic."""
    client = _client(bootstrap, topology, group, web_token)
    with _client_errors():
        for entry in client.query(topic, filter=filter_, keys=None if keys is None else _split(keys) or [], select=_split(select), top=top, order_by=order_by):
            _print(entry.as_dict())


@main.command()
@connection
@click.argument("topic")
@click.option("--filter", "filter_", default=None, help="Content filter, e.g. \"/status = 'open' AND /qty > 10\".")
@click.option("--sow", is_flag=True, help="Start with the current SOW (sow_and_subscribe).")
@click.option("--delta", is_flag=True, help="Deltas instead of full records.")
@click.option("--oof", is_flag=True, help="Tell when a record leaves the subscription.")
@click.option("--no-empties", is_flag=True, help="With --delta: skip updates that change nothing selected.")
@click.option("--no-sowkey", is_flag=True, help="Leave the sow_key out of each event.")
@click.option("--select", default=None, help="Comma-separated field paths.")
@click.option("--keys", default=None, help="Comma-separated SowKeys: only these records.")
@click.option("--conflation", default=None, help="Merge updates per record over this interval (e.g. 250ms).")
@click.option("--timeout", type=SECONDS, default=None, help="Stop after this many idle seconds.")
@click.option("--after", "--after-seq", "after_seq", default=None,
              help="Resume after this bookmark (the \"bookmark\" of the last event taken: an event ID per partition; "
                   "a pattern's names each topic's part) instead of starting with the SOW.")
def subscribe(bootstrap, topology, topic, filter_, sow, delta, oof, no_empties, no_sowkey, select, keys, conflation, timeout, after_seq) -> None:
    """Subscribe (optionally sow_and_subscribe) to a SOW topic, printing JSON lines. TOPIC may also be
    a regular expression matching whole names of SOW topics and views: then it subscribes to every one
    it matches (with --sow, all their snapshots first), each option applying to each, and each line
    names its topic."""
    if no_empties and not delta:
        _fail("--no-empties applies to --delta subscriptions (a full record is never empty)")
    if after_seq is not None and sow:
        _fail("--after resumes after a bookmark instead of starting with the SOW: drop --sow")
    client = _client(bootstrap, topology)
    with _client_errors():
        events = client.subscribe(
            topic, filter=filter_, sow=sow, delta=delta, oof=oof, no_empties=no_empties, no_sowkey=no_sowkey,
            select=_split(select), conflation=conflation, timeout=timeout, after_seq=after_seq,
            keys=None if keys is None else _split(keys) or [],
        )
        try:
            for event in events:
                _print(event)
        except KeyboardInterrupt:
            pass


def _register_spark_commands() -> None:
    from processor.cli.spark import register

    register(main)


_register_spark_commands()


if __name__ == "__main__":  # pragma: no cover
    main()
