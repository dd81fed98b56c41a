"""The topology file: SOW topics and views, validated at start with pydantic.

Errors name the topic (or view) and the field, e.g. `sow[orders].expiration: not a duration`.
"""

from __future__ import annotations

import os
import re
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Literal, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from processor.contract.errors import ConfigError
from processor.core.codec import Codec, codec_for
from processor.core.durations import DurationError, parse_duration_ms
from processor.core.expiry import ExpirationMode, ExpiryPolicy
from processor.core.keys import KeySpec
from processor.core.paths import PathError, split_path
from processor.core.regex import RegexError, regex

DEFAULT_TOPOLOGY = Path(__file__).resolve().parent.parent / "topology" / "default.yaml"
MAX_VIEWS_PER_TOPIC = 256  # the views' mark (engine.views.views_mark) fits brokers' default offset.metadata.max.bytes (4,096)


class TopologyError(ConfigError):
    """A topology that cannot be used; the message names the topic and the field."""


class Persistence(str, Enum):
    PERSISTENT = "persistent"  # RocksDB + changelog
    MEMORY = "memory"  # memory, rebuilt from the changelog on start
    SIMPLE = "simple"  # memory, no changelog: lost on restart
    TRANSIENT = "transient"  # no SOW: records relayed, deltas not merged


class CapacityPolicy(str, Enum):
    EVICT_OLDEST = "evict_oldest"
    REJECT = "reject"


class MessageType(str, Enum):
    JSON = "json"
    AVRO = "avro"


def _no_boolean(value: Any) -> Any:
    """A YAML boolean (true/false, on/off, yes/no) where a number or a duration goes: pydantic would
    take it as 1 or 0."""
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} is a YAML boolean (true/false, on/off, yes/no), not a number or a duration")
    return value


def _duration_or_none(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return parse_duration_ms(value)
    except DurationError as exc:
        raise ValueError(str(exc)) from None


def _check_paths(paths: list[str]) -> list[str]:
    for path in paths:
        try:
            split_path(path)
        except PathError as exc:
            raise ValueError(str(exc)) from None
    return paths


class SowTopic(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    topic: str = Field(pattern=r"^[A-Za-z0-9._-]+$")
    key: list[str] = Field(default_factory=list)
    key_domain: str | None = None
    message_type: MessageType = MessageType.JSON
    schema_: str | None = Field(default=None, alias="schema")
    expiration: str | int | float | None = None
    min_expiration: str | int | float | None = None
    max_expiration: str | int | float | None = None
    persistence: Persistence = Persistence.PERSISTENT
    capacity: int = Field(default=0, ge=0)
    capacity_policy: CapacityPolicy = CapacityPolicy.EVICT_OLDEST
    expiry_topic: str | None = Field(default=None, min_length=1)  # "" would silently mean the default
    dead_event_topic: str | None = Field(default=None, min_length=1)
    hash_indexes: list[list[str]] = Field(default_factory=list)
    partitions: int = Field(default=8, ge=1, le=1024)
    # Which clock a lifetime counts from and inputs are ordered by, for the input topics the workers
    # create: `arrival` (the broker's, LogAppendTime) or `publisher` (CreateTime). Existing topics
    # keep the timestamp type they were created with.
    timestamps: Literal["arrival", "publisher"] = "arrival"

    @field_validator("key")
    @classmethod
    def _key_paths(cls, value: list[str]) -> list[str]:
        """Key values are scalars: a path inside another (/a and /a/b) leaves every record without
        a SowKey, so every input would land on `.errors`."""
        _check_paths(value)
        split = [split_path(p) for p in value]
        for i, parts in enumerate(split):
            for j, other in enumerate(split):
                if i != j and other[: len(parts)] == parts and (len(other) > len(parts) or i < j):
                    raise ValueError(f"{value[j]} is named twice" if other == parts else
                                     f"{value[j]} lies inside {value[i]}: key values are scalars, so no record has both")
        return value

    @field_validator("hash_indexes")
    @classmethod
    def _index_paths(cls, value: list[list[str]]) -> list[list[str]]:
        for index in value:
            if not index:
                raise ValueError("an index needs at least one field path")
            _check_paths(index)
        return value

    @field_validator("expiration", mode="before")
    @classmethod
    def _expiration_switch(cls, value: Any) -> Any:
        """YAML reads `on`, `yes`, `true` (and `off`, `no`, `false`) as booleans, which would pass
        for the numbers 1 and 0 (a 1-second lifetime for every record): they mean enabled, disabled."""
        if isinstance(value, bool):
            return "enabled" if value else "disabled"
        return value

    @field_validator("min_expiration", "max_expiration", "capacity", "partitions", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: Any) -> Any:
        return _no_boolean(value)

    @field_validator("expiration")
    @classmethod
    def _expiration(cls, value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("disabled", "enabled")):
            return value
        _duration_or_none(value)
        return value

    @field_validator("min_expiration", "max_expiration")
    @classmethod
    def _clamp(cls, value: Any) -> Any:
        if _duration_or_none(value) == 0:  # negative ones do not parse as durations
            raise ValueError("must be a positive duration (leave it out for no bound)")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "SowTopic":
        lo, hi = _duration_or_none(self.min_expiration), _duration_or_none(self.max_expiration)
        if lo is not None and hi is not None and lo > hi:
            raise ValueError("min_expiration is greater than max_expiration")
        if 0 < self.capacity < self.partitions:
            raise ValueError(f"capacity {self.capacity} is below partitions {self.partitions}: capacity is split over the partitions")
        if self.message_type is MessageType.AVRO and not self.schema_:
            raise ValueError("message_type avro needs schema: schemas/<file>.avsc")
        if self.capacity and self.persistence is Persistence.TRANSIENT:
            raise ValueError("capacity: a transient topic keeps no records to count (make it memory or persistent)")
        if self.dead_event_topic and self.dead_event_topic.lower() == "none":
            raise ValueError("dead_event_topic: records removed by capacity always go to a dead event topic "
                             f"(omit it for {self.topic}.dead); 'none' would be a Kafka topic of that name")
        return self

    @cached_property
    def key_spec(self) -> KeySpec:
        return KeySpec(domain=self.key_domain or self.topic, paths=tuple(self.key))

    @cached_property
    def expiry(self) -> ExpiryPolicy:
        """`expiration: 0` is no default lifetime (as a TTL of 0 in Universal Messaging): expiration
        is on for per-message lifetimes only, the same as `enabled`."""
        raw = self.expiration
        lo, hi = _duration_or_none(self.min_expiration), _duration_or_none(self.max_expiration)
        if raw is None or (isinstance(raw, str) and raw.strip().lower() == "disabled"):
            return ExpiryPolicy(ExpirationMode.DISABLED, None, lo, hi)
        default = None if isinstance(raw, str) and raw.strip().lower() == "enabled" else _duration_or_none(raw)
        if not default:
            return ExpiryPolicy(ExpirationMode.ENABLED, None, lo, hi)
        return ExpiryPolicy(ExpirationMode.DEFAULT, default, lo, hi)

    def codec(self, base: Path | None) -> Codec:
        """The codec of this topic's records, a relative schema path read from `base` (`schema_base`);
        ConfigError naming the topic and the field."""
        try:
            return codec_for(self.message_type.value, self.schema_, base)
        except ConfigError as exc:
            raise ConfigError(f"sow[{self.topic}].schema: {exc}") from None

    def warnings(self) -> list[str]:
        """Settings that are valid but probably not what the operator meant (logged at start)."""
        policy = self.expiry
        clamps = ", ".join(n for n, v in (("min_expiration", policy.min_ms), ("max_expiration", policy.max_ms)) if v is not None)
        if clamps and policy.default_ms is not None:
            return [
                f"sow[{self.topic}]: expiration {self.expiration} is a topic default lifetime, which overrides {clamps} "
                "(as Artemis expiry-delay overrides min/max-expiry-delay): no lifetime of this topic is clamped"
            ]
        if clamps and not policy.active:
            return [
                f"sow[{self.topic}]: expiration is disabled, so {clamps} only stamps this topic's records with instants "
                "(sow-expires-at) that never expire: set expiration: enabled for the clamped lifetimes to expire"
            ]
        return []

    # Derived topic names (contract: "Topics").
    @property
    def delta_topic(self) -> str:
        return f"{self.topic}.delta"

    @property
    def sow_topic(self) -> str:
        return f"{self.topic}.sow"

    @property
    def diff_topic(self) -> str:
        return f"{self.topic}.diff"

    @property
    def errors_topic(self) -> str:
        return f"{self.topic}.errors"

    @property
    def repartition_topic(self) -> str:
        """Internal: inputs whose Kafka key did not route them to their SowKey's partition."""
        return f"{self.topic}.repartition"

    @property
    def holds_topic(self) -> str:
        """Internal: conflated view events held until their interval ends (a compacted changelog)."""
        return f"{self.topic}.holds"

    @property
    def expired_topic(self) -> str | None:
        if self.expiry_topic and self.expiry_topic.lower() == "none":
            return None
        return self.expiry_topic or f"EXP.{self.topic}"

    @property
    def dead_topic(self) -> str:
        return self.dead_event_topic or f"{self.topic}.dead"

    def kafka_topics(self, views: Iterable["View"] = ()) -> list["KafkaTopic"]:
        """Every Kafka topic this SOW topic reads or writes (its views' own topics not included):
        what creates them and what checks that no two share a name both read this one list."""
        conflated = any(view.conflation for view in views)
        named = (
            (self.topic, "input", "topic"),
            (self.delta_topic, "delta input", "topic"),
            (self.repartition_topic, "repartition topic", "topic"),
            (self.sow_topic, "changelog", "topic"),
            (self.diff_topic, "diff topic", "topic"),
            (self.errors_topic, "errors topic", "topic"),
            (self.dead_topic, "dead event topic", "dead_event_topic" if self.dead_event_topic else "topic"),
            (self.expired_topic, "expiry topic", "expiry_topic" if self.expiry_topic else "topic"),
            (self.holds_topic if conflated else None, "holds topic", "topic"),
        )
        return [KafkaTopic(name, role, field) for name, role, field in named if name is not None]


_KAFKA_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")  # what Kafka accepts (org.apache.kafka.common.internals.Topic)
_SHAREABLE = ("expiry topic", "dead event topic")  # roles several SOW topics may give one Kafka topic


class KafkaTopic(NamedTuple):
    """One Kafka topic of a topology: its name, its role and the topology field that names it."""

    name: str
    role: str  # input, delta input, repartition topic, changelog, diff topic, errors topic, ...
    field: str

    @property
    def compacted(self) -> bool:
        """Changelogs keep the latest record per key; so do the held conflated view events."""
        return self.role in ("changelog", "holds topic")


class View(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9._-]+$")
    topic: str
    filter: str = "1=1"
    select: list[str] = Field(default_factory=list)
    options: list[str] = Field(default_factory=list)
    conflation: str | int | float | None = None

    @field_validator("conflation", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: Any) -> Any:
        return _no_boolean(value)

    @field_validator("select")
    @classmethod
    def _select(cls, value: list[str]) -> list[str]:
        return _check_paths(value)

    @field_validator("filter")
    @classmethod
    def _filter(cls, value: str) -> str:
        from processor.core.filters import FilterError, compile_filter

        try:
            compile_filter(value)
        except FilterError as exc:  # a ValueError pydantic reports with the view and the field
            raise ValueError(str(exc)) from None
        return value

    @field_validator("options")
    @classmethod
    def _options(cls, value: list[str]) -> list[str]:
        allowed = {"oof", "no_empties", "no_sowkey", "send_keys"}
        for option in value:
            if option not in allowed:
                raise ValueError(f"unknown option {option!r} (allowed: {', '.join(sorted(allowed))})")
        return value

    @field_validator("conflation")
    @classmethod
    def _conflation(cls, value: Any) -> Any:
        _duration_or_none(value)
        return value

    def kafka_topics(self) -> list[KafkaTopic]:
        """The view's own topics: its records and its changes."""
        return [KafkaTopic(f"{self.name}.sow", "changelog", "name"), KafkaTopic(f"{self.name}.diff", "diff topic", "name")]


class Topology(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sow: list[SowTopic] = Field(default_factory=list)
    views: list[View] = Field(default_factory=list)
    # For the topics ksow creates; None: min(3, brokers) and min(2, replication_factor).
    # KSOW_REPLICATION_FACTOR / KSOW_MIN_INSYNC_REPLICAS override them (processor.kafka.clients).
    replication_factor: int | None = Field(default=None, ge=1)
    min_insync_replicas: int | None = Field(default=None, ge=1)

    @field_validator("replication_factor", "min_insync_replicas", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: Any) -> Any:
        return _no_boolean(value)

    @model_validator(mode="after")
    def _references(self) -> "Topology":
        # Raised from here a ValueError has no location: each message starts with its own.
        names = [t.topic for t in self.sow]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ValueError(f"sow[{i}].topic: {name!r} is defined twice")
        view_names = [v.name for v in self.views]
        for i, view in enumerate(self.views):
            if view.topic not in names:
                raise ValueError(f"views[{view.name}].topic: unknown SOW topic {view.topic!r} (known: {', '.join(names) or 'none'})")
            if view.name in view_names[:i]:
                raise ValueError(f"views[{i}].name: {view.name!r} is defined twice")
            if view.name in names:
                raise ValueError(f"views[{view.name}].name: {view.name!r} is also a SOW topic (view names must differ from SOW topic names)")
            if self.sow[names.index(view.topic)].persistence is Persistence.TRANSIENT:
                raise ValueError(f"views[{view.name}].topic: {view.topic!r} is transient: it keeps no SOW, and a view needs "
                                 "the record before a change to tell when it leaves the filter (make the topic memory or persistent)")
        for name in names:
            count = sum(v.topic == name for v in self.views)
            if count > MAX_VIEWS_PER_TOPIC:
                raise ValueError(f"views: {count} views of SOW topic {name!r}, over the limit of {MAX_VIEWS_PER_TOPIC} a topic "
                                 "(which definitions a partition's view topics follow is kept in its committed offsets' metadata)")
        self._check_topic_roles()
        if self.replication_factor and self.min_insync_replicas and self.min_insync_replicas > self.replication_factor:
            raise ValueError(f"min_insync_replicas {self.min_insync_replicas} is above replication_factor {self.replication_factor}")
        return self

    def _check_topic_roles(self) -> None:
        """Every Kafka topic the topology reads or writes has one role: no topic is written by two
        SOW topics or views, and none that is written is also read as an input (`expiry_topic: t`
        on topic t would read every expired record back as a publish). The one sharing allowed is
        of expired and dead records: any SOW topics may send them to one topic (as Artemis queues
        share an expiry address and UM channels a dead event store; each message there names its
        SOW topic in `sow-topic`), and one SOW topic both kinds (as with `expiry_topic: none`)."""
        roles: dict[str, tuple[str, str]] = {}  # topic -> (owner, what it is to the owner)

        def claim(topics: list[KafkaTopic], where: str, owner: str) -> None:
            for name, what, field in topics:
                if not _KAFKA_TOPIC_NAME.fullmatch(name) or name in (".", ".."):  # else `ksow up` fails creating it, naming no field
                    raise ValueError(f"{where}.{field}: {what} {name!r} is no Kafka topic name "
                                     "(1 to 249 letters, digits, '.', '_' or '-', not . or ..)")
                if name in roles:
                    other_owner, other_what = roles[name]
                    if what in _SHAREABLE and other_what in _SHAREABLE:
                        continue
                    raise ValueError(f"{where}.{field}: {what} {name!r} is also the {other_what} of {other_owner}")
                roles[name] = (owner, what)

        for t in self.sow:
            claim(t.kafka_topics(self.views_of(t.topic)), f"sow[{t.topic}]", f"SOW topic {t.topic!r}")
        for v in self.views:
            claim(v.kafka_topics(), f"views[{v.name}]", f"view {v.name!r}")

    def warnings(self) -> list[str]:
        return [w for spec in self.sow for w in spec.warnings()]

    def views_of(self, topic: str) -> list["View"]:
        return [v for v in self.views if v.topic == topic]

    def topic(self, name: str) -> SowTopic:
        for spec in self.sow:
            if spec.topic == name:
                return spec
        if (view := self.view(name)) is not None:
            raise TopologyError(f"{name!r} is a view of the SOW topic {view.topic!r}: query or subscribe to the view, "
                                f"publish to or delete from {view.topic!r}")
        views = f"; views: {', '.join(v.name for v in self.views)}" if self.views else ""
        raise TopologyError(f"topic {name!r} is not a SOW topic of this topology (known: {', '.join(t.topic for t in self.sow)}{views})")

    def view(self, name: str) -> "View | None":
        return next((view for view in self.views if view.name == name), None)

    def names(self) -> list[str]:
        """What a query may name: the SOW topics, then the views."""
        return [spec.topic for spec in self.sow] + [view.name for view in self.views]

    def matching(self, pattern: str) -> list[str]:
        """The SOW topics and views whose whole name the regular expression `pattern` matches (RE2's
        syntax, as LIKE): a query may name its topics so, as in AMPS. Empty when it matches none or
        is no regular expression."""
        try:
            compiled = regex(pattern)
        except RegexError:
            return []
        return [name for name in self.names() if compiled.fullmatch(name)]


def _describe(exc: ValidationError, raw: dict) -> str:
    lines = []
    for error in exc.errors():
        loc = list(error["loc"])
        where = []
        if len(loc) >= 2 and loc[0] in ("sow", "views") and isinstance(loc[1], int):
            section, index = loc[0], loc[1]
            entries = raw.get(section) or []
            entry = entries[index] if index < len(entries) and isinstance(entries[index], dict) else {}
            label = entry.get("topic" if section == "sow" else "name", f"#{index}")
            where.append(f"{section}[{label}]")
            loc = loc[2:]
        where.append(".".join(str(p) for p in loc))
        location, msg = ".".join(w for w in where if w), error["msg"]
        if not location:  # a check of the whole topology: its message names the topic and the field
            msg = msg.removeprefix("Value error, ")
        lines.append(f"{location}: {msg}" if location else msg)
    return "invalid topology: " + "; ".join(lines)


def parse_topology(raw: Any) -> Topology:
    if not isinstance(raw, dict):
        raise TopologyError("invalid topology: the file must be a mapping with 'sow' and 'views'")
    try:
        return Topology.model_validate(raw)
    except ValidationError as exc:
        raise TopologyError(_describe(exc, raw)) from None


def topology_path(path: str | os.PathLike | None = None) -> Path:
    """The topology file a command reads: `path`, else $KSOW_TOPOLOGY, else the topology/default.yaml
    ksow ships with (not one in the working folder)."""
    return Path(path or os.environ.get("KSOW_TOPOLOGY") or DEFAULT_TOPOLOGY)


def schema_base(path: str | os.PathLike | None = None) -> Path:
    """The folder a topology's relative `schema:` paths start from, for every command: the parent of
    the topology file's folder (`topology/x.yaml` names `schemas/x.avsc`), whatever the working folder."""
    return topology_path(path).resolve().parent.parent


def load_topology(path: str | os.PathLike | None = None) -> Topology:
    """Read a topology file (`topology_path`)."""
    path = topology_path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise TopologyError(f"topology file not found: {path}") from None
    except UnicodeDecodeError as exc:
        raise TopologyError(f"topology file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise TopologyError(f"cannot read the topology file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise TopologyError(f"topology file {path} is not valid YAML: {exc}") from None
    return parse_topology(raw)
