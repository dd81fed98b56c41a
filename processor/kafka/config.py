"""The deployment's Kafka client settings, shared by every client ksow makes.

Producers, consumers and admin clients (librdkafka) and Spark's Kafka source and sink (the Java
client) all need the same connection settings on a secured cluster: SASL, TLS, client ids. They
come from two places, in this order (a later one wins per property):

1. a librdkafka properties file: `--kafka-config FILE` on the command line, or `KSOW_KAFKA_CONFIG`;
   one `name=value` a line (or `name: value`, `name value`, as Java reads them), `#` or `!` starts
   a comment;
2. environment variables `KAFKA_<PROPERTY>` in the style of the Confluent images: upper case,
   `_` for `.`, `__` for `_`, `___` for `-` (`KAFKA_SASL_MECHANISM` -> `sasl.mechanism`).
   `KAFKA_BOOTSTRAP` is ksow's bootstrap address, not a property; other `KAFKA_*` variables that
   name no librdkafka property (`KAFKA_HOME`, `KAFKA_HEAP_OPTS`, ...) belong to other tools and are
   ignored, except under `security.`, `sasl.` and `ssl.`, where a misspelt name is an error.

Properties are validated by librdkafka itself, so a name or value it would refuse is a
ConfigError naming the line or variable. `bootstrap.servers` is taken as the bootstrap address
when neither `--bootstrap` nor `KAFKA_BOOTSTRAP` gives one. Properties that ksow sets per client
because its guarantees depend on them (group ids, transactions, idempotence, the partitioner)
cannot be set here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from confluent_kafka import KafkaException, Producer

from processor.contract.errors import ConfigError

CONFIG_FILE_ENV = "KSOW_KAFKA_CONFIG"
ENV_PREFIX = "KAFKA_"
NOT_PROPERTIES = frozenset({"KAFKA_BOOTSTRAP"})
STRICT_FAMILIES = ("security.", "sasl.", "ssl.")
BOOTSTRAP = "bootstrap.servers"

# Chosen by ksow for each client: exactly-once, ownership of partitions and reading to the end
# of a partition rely on them.
RESERVED = frozenset({
    "group.id", "group.instance.id", "transactional.id", "enable.idempotence", "acks",
    "request.required.acks", "enable.auto.commit", "enable.auto.offset.store",
    "enable.partition.eof", "isolation.level", "partitioner",
})  # fmt: skip

# Properties whose values are masked wherever settings are shown.
_SECRET = re.compile(r"password|passphrase|secret|\.pem$|jaas|token(?!\.endpoint\.url)|oauthbearer\.config|credentials", re.IGNORECASE)


@dataclass(frozen=True)
class KafkaConfig:
    """Validated librdkafka properties (without bootstrap.servers) and where each came from."""

    properties: Mapping[str, str] = field(default_factory=dict)
    bootstrap: str | None = None
    origins: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One line per property with secrets masked, for logs and `--help`-style output."""
        return "\n".join(
            f"{name}={'***' if _SECRET.search(name) else value}  ({self.origins.get(name, '?')})"
            for name, value in sorted(self.properties.items())
        )


_LINE = re.compile(r"([A-Za-z0-9._-]+)(?:\s*[=:]\s*|\s+|$)(.*)", re.DOTALL)  # Java's separators: '=', ':' or blanks
_PROPERTY_SHAPED = re.compile(r"[a-z0-9_]+(\.[a-z0-9_-]+)+")  # as every librdkafka property name is
_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # Java's, not str.splitlines()'s (which also breaks at \x0b, \x85, ...)


def parse_properties(text: str, origin: str) -> list[tuple[str, str, str]]:
    """(name, value, "origin:line") of each setting of a properties file, in file order. As in a
    Java client's properties file, a name ends at '=', ':' or a blank, and a line ending in an odd
    number of backslashes goes on on the next line (other escapes are kept as written). An error
    never shows a value: a line that is not a setting, or a continuation read on its own, may be
    a password."""
    settings = []
    lines = _LINE_BREAK.split(text)
    number = 0
    while number < len(lines):
        raw = lines[number]
        number += 1
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        where = f"{origin}:{number}"
        while (len(line) - len(line.rstrip("\\"))) % 2 and number < len(lines):
            line = line[:-1] + lines[number].lstrip()
            number += 1
        match = _LINE.fullmatch(line)
        if match is None:
            raise ConfigError(f"{where}: expected name=value, with a property name (letters, digits, '.', '_', '-') first; "
                              "the line is not shown, as it may hold a secret")
        settings.append((match.group(1), match.group(2).strip(), where))
    return settings


def _shown_name(name: str) -> str:
    """A name as an error may show it: one not shaped like a property may be a pasted secret."""
    return name if _PROPERTY_SHAPED.fullmatch(name) else "a name not shaped like a property (not shown: it may be a secret)"


def env_property(variable: str) -> str:
    """The librdkafka property a `KAFKA_*` variable sets (Confluent image convention)."""
    body = variable[len(ENV_PREFIX) :].lower()
    return body.replace("___", "\0").replace("__", "\1").replace("_", ".").replace("\0", "-").replace("\1", "_")


def load_kafka_config(path: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> KafkaConfig:
    """The settings of a properties file (if any) overlaid with `KAFKA_*` variables of `environ`."""
    environ = os.environ if environ is None else environ
    settings: list[tuple[str, str, str]] = []
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8-sig")  # an editor's byte order mark is not part of line 1
        except OSError as exc:
            raise ConfigError(f"Kafka config file {path}: {exc.strerror or exc}") from None
        settings += parse_properties(text, str(path))
    for variable in sorted(environ):
        if variable.startswith(ENV_PREFIX) and variable not in NOT_PROPERTIES:
            name = env_property(variable)
            if _is_property(name):
                settings.append((name, environ[variable], f"env {variable}"))
            elif name.startswith(STRICT_FAMILIES):
                raise ConfigError(f"env {variable}: No such configuration property: {name!r}")
    return _validated(settings)


def _validated(settings: list[tuple[str, str, str]]) -> KafkaConfig:
    properties: dict[str, str] = {}
    origins: dict[str, str] = {}
    bootstrap = None
    for name, value, where in settings:
        if name in RESERVED:
            raise ConfigError(f"{where}: {name} is set by ksow for each client and cannot be configured")
        if name == BOOTSTRAP:
            bootstrap = value or None
            continue
        problem = _check_one(name, value)
        if problem is not None and problem.startswith("No such configuration property"):
            shown = _shown_name(name)
            problem = problem if shown == name else "No such configuration property"
            raise ConfigError(f"{where}: {shown}: {problem} (its value is not shown: a misspelt name may hold a secret)")
        if problem is not None and problem.startswith("Invalid value"):
            raise ConfigError(f"{where}: {name}={_masked(name, value)}: {problem}")
        if name.endswith(".location") and value and value != "probe" and not os.access(value, os.R_OK):
            # librdkafka's own complaint names neither the property nor the file (an OpenSSL code)
            reason = "cannot be read" if os.path.exists(value) else "does not exist"
            raise ConfigError(f"{where}: {name}={value}: the file {reason}")
        properties[name], origins[name] = value, where
    _check_protocol(properties, origins)
    if properties:
        problem = _check(properties)
        if problem is not None:
            sources = ", ".join(sorted(set(origins.values()), key=str))
            raise ConfigError(f"Kafka client settings ({sources}) are not usable together: {problem}")
    return KafkaConfig(properties, bootstrap, origins)


def security_protocol(properties: Mapping[str, str]) -> str:
    """The security.protocol these properties connect with, upper case (librdkafka's default: PLAINTEXT)."""
    return properties.get("security.protocol", "plaintext").strip().upper()


def _check_protocol(properties: Mapping[str, str], origins: Mapping[str, str]) -> None:
    """SASL or TLS settings under a security.protocol that does not use them are a ConfigError:
    librdkafka would only warn, and connect in the clear without the credentials or the CA."""
    protocol = security_protocol(properties)
    for family, used, protocols in (("sasl.", protocol.startswith("SASL_"), "SASL_SSL or SASL_PLAINTEXT"),
                                    ("ssl.", protocol.endswith("SSL"), "SSL or SASL_SSL")):
        found = sorted(name for name in properties if name.startswith(family))
        if found and not used:
            where = origins.get("security.protocol")
            said = f"security.protocol={protocol.lower()} ({where})" if where else "no security.protocol (plaintext)"
            raise ConfigError(f"{', '.join(found)} ({', '.join(origins[n] for n in found)}) would be ignored with {said}: "
                              f"set security.protocol to {protocols}")


def _masked(name: str, value: str) -> str:
    return "***" if _SECRET.search(name) else value


def _check_one(name: str, value: str) -> str | None:
    return _check({name: value})


def _is_property(name: str) -> bool:
    problem = _check_one(name, "")
    return problem is None or not problem.startswith("No such configuration property")


def _check(properties: Mapping[str, str]) -> str | None:
    """librdkafka's objection to these properties, or None. Creating a client with no broker
    to talk to costs well under a millisecond and applies exactly librdkafka's own rules."""
    try:
        Producer({**properties, "log_level": 0})
    except KafkaException as exc:
        return exc.args[0].str().removeprefix("Failed to create producer: ")
    return None


# -------------------------------------------------------------- the configuration in force

_override: KafkaConfig | None = None


def use_kafka_config(config: KafkaConfig | None) -> None:
    """Make `config` the one every client gets (tests, embedding); None: back to the environment."""
    global _override
    _override = config


def kafka_config() -> KafkaConfig:
    """The configuration in force: the explicit one, else from `KSOW_KAFKA_CONFIG` and `KAFKA_*`
    (re-read when the file or those variables change)."""
    if _override is not None:
        return _override
    path = os.environ.get(CONFIG_FILE_ENV) or None
    try:
        stamp = Path(path).stat().st_mtime_ns if path else None
    except OSError:
        stamp = None  # load_kafka_config reports the missing file
    variables = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIX)))
    return _load_cached(path, stamp, variables)


@lru_cache(maxsize=8)
def _load_cached(path: str | None, stamp: int | None, variables: tuple[tuple[str, str], ...]) -> KafkaConfig:
    return load_kafka_config(path, dict(variables))


# -------------------------------------------------------------- Spark (the Java client)

_LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


def spark_kafka_options(bootstrap: str, config: KafkaConfig | None = None) -> dict[str, str]:
    """The `kafka.*` options of Spark's Kafka source and sink that reach the same cluster.

    The Java client names the settings differently: SASL credentials become a JAAS line, and
    certificates and keys are passed inline as PEM (Kafka 2.7+), so executors need no files.
    librdkafka tuning properties have no Java counterpart and are left out. A security setting
    that cannot be carried over is a ConfigError rather than a Spark job that cannot connect.
    """
    config = kafka_config() if config is None else config
    props = config.properties
    options = {"kafka.bootstrap.servers": bootstrap}
    protocol = security_protocol(props)
    options["kafka.security.protocol"] = protocol
    if "client.id" in props:
        options["kafka.client.id"] = props["client.id"]
    if protocol.startswith("SASL"):
        mechanism = (props.get("sasl.mechanism") or props.get("sasl.mechanisms") or "GSSAPI").upper()
        if mechanism not in _LOGIN_MODULES:
            raise ConfigError(f"Spark jobs: SASL mechanism {mechanism} is not supported (use PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)")
        user, password = _jaas_quoted(props.get("sasl.username", "")), _jaas_quoted(props.get("sasl.password", ""))
        options["kafka.sasl.mechanism"] = mechanism
        options["kafka.sasl.jaas.config"] = f'{_LOGIN_MODULES[mechanism]} required username="{user}" password="{password}";'
    if protocol.endswith("SSL"):
        options.update(_spark_tls(props))
    return options


def _spark_tls(props: Mapping[str, str]) -> dict[str, str]:
    if props.get("enable.ssl.certificate.verification", "true").lower() in ("false", "0"):
        raise ConfigError("Spark jobs: enable.ssl.certificate.verification=false has no Java client equivalent; give the CA instead")
    options = {}
    ca = props.get("ssl.ca.pem") or _pem_file(props, "ssl.ca.location")
    if ca:
        options |= {"kafka.ssl.truststore.type": "PEM", "kafka.ssl.truststore.certificates": ca}
    chain = props.get("ssl.certificate.pem") or _pem_file(props, "ssl.certificate.location")
    key = props.get("ssl.key.pem") or _pem_file(props, "ssl.key.location")
    if chain and key:
        if "BEGIN RSA PRIVATE KEY" in key or "BEGIN EC PRIVATE KEY" in key:
            raise ConfigError("Spark jobs: the Java client reads PKCS#8 keys only (openssl pkcs8 -topk8 converts ssl.key.location)")
        options |= {"kafka.ssl.keystore.type": "PEM", "kafka.ssl.keystore.certificate.chain": chain, "kafka.ssl.keystore.key": key}
        if props.get("ssl.key.password"):
            options["kafka.ssl.key.password"] = props["ssl.key.password"]
    elif props.get("ssl.keystore.location"):  # librdkafka's PKCS#12 key store
        options |= {"kafka.ssl.keystore.type": "PKCS12", "kafka.ssl.keystore.location": props["ssl.keystore.location"]}
        if props.get("ssl.keystore.password"):
            options["kafka.ssl.keystore.password"] = props["ssl.keystore.password"]
    algorithm = props.get("ssl.endpoint.identification.algorithm", "https").lower()
    options["kafka.ssl.endpoint.identification.algorithm"] = "" if algorithm == "none" else algorithm
    return options


def _pem_file(props: Mapping[str, str], name: str) -> str | None:
    path = props.get(name)
    if not path:
        return None
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"Spark jobs: {name}={path} must be a readable PEM file: {exc.strerror or exc}") from None


def _jaas_quoted(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
