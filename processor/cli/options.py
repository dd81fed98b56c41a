"""Options that every `ksow` command shares: where Kafka is, how to reach it, which topology."""

from __future__ import annotations

import os
from pathlib import Path

import click

BOOTSTRAP = click.option(
    "--bootstrap", envvar="KAFKA_BOOTSTRAP", default=None,
    help="Kafka bootstrap servers (env KAFKA_BOOTSTRAP; else bootstrap.servers of the Kafka client config).",
)  # fmt: skip
TOPOLOGY = click.option(
    "--topology", envvar="KSOW_TOPOLOGY", default=None, type=click.Path(dir_okay=False),
    help="Topology file (env KSOW_TOPOLOGY; default: the topology/default.yaml ksow ships with).",
)  # fmt: skip


def _use_kafka_config(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """Check the Kafka client settings before anything connects, and put the file in the
    environment so that every client of this process, and every process it starts, uses it."""
    from processor.contract.errors import ConfigError
    from processor.kafka.config import CONFIG_FILE_ENV, kafka_config

    if value:
        os.environ[CONFIG_FILE_ENV] = str(Path(value).resolve())
    try:
        kafka_config()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


KAFKA_CONFIG = click.option(
    "--kafka-config", envvar="KSOW_KAFKA_CONFIG", default=None, type=click.Path(dir_okay=False),
    expose_value=False, callback=_use_kafka_config,
    help="librdkafka properties file (SASL, TLS, ...) for every Kafka client (env KSOW_KAFKA_CONFIG); "
    "KAFKA_<PROPERTY> variables (KAFKA_SASL_USERNAME -> sasl.username) override it.",
)  # fmt: skip


def connection(fn):
    """--bootstrap, --kafka-config and --topology."""
    return BOOTSTRAP(KAFKA_CONFIG(TOPOLOGY(fn)))


class Seconds(click.ParamType):
    """A number of seconds, zero or more: click's FloatRange lets `nan` through (no comparison
    refuses it), and a wait or a run of NaN seconds never ends."""

    name = "seconds"

    def convert(self, value, param, ctx) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not 0 <= seconds < float("inf"):
            self.fail(f"{value!r} is not a number of seconds, zero or more", param, ctx)
        return seconds


SECONDS = Seconds()
