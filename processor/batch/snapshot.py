"""`ksow snapshot`: the SOW of a topic exactly as it stood at an instant, rebuilt by Spark from the
input topics `<topic>` and `<topic>.delta` (the rules are those of `processor.engine.fold`).

How it stays mostly vectorized:
1. `classify`: every input is classified with Spark expressions: headers, command, lifetime and
   its key group (the key fields' JSON values, read from the VARIANT that `try_parse_json` makes).
   What the worker would reject is dropped, and that is decided by the core's `parse_command`
   (`accepted`, a pandas UDF: the one Python call per input), since Spark's JSON parser is laxer.
2. `aggregate`: one aggregation per key group keeps the latest full publish or delete (a max over
   the history order, packed into one DECIMAL) and the deltas.
3. `chains`: per group, the base and the deltas after it, cut at the last write whose predecessor
   had expired by then (a record whose lifetime ran out before a delta arrived starts anew).
4. `records`: a chain of one write is that value as published; longer chains fold
   `_merge_maps` (the core's merge as map/variant expressions) within the group's row.
5. SowKeys (the core's checksum, in Python) are computed once per surviving key, not per input.
Deletes by SowKey(s) become the group's base when they are its latest. Deletes by filter need each
record as it was at that moment, so key groups with any input before the last filter delete are
folded by the reference fold (`SowFold`), one pandas call per group, taken only for histories
that contain filter deletes. Records nested deeper than
MERGE_LEVELS also merge in Python (per key, with the core's merge).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from processor.contract import headers as H
from processor.core.durations import _DURATION, _UNITS_MS, MAX_DURATION_MS
from processor.core.keys import USER_KEY_JAVA_REGEX, checksum_key
from processor.topology import MessageType, Persistence, SowTopic

log = logging.getLogger("ksow.snapshot")

if TYPE_CHECKING:  # pyspark is imported lazily: the rest of ksow runs without a JVM
    from pyspark.sql import Column, DataFrame, SparkSession

ORDER = ("sort", "rank", "partition", "offset")  # the history order (see processor.engine.fold)


def history_columns(spec: SowTopic) -> list:
    """Timestamp (`ts`), rank (`<topic>` before `<topic>.delta`), partition, offset and topic of raw
    Kafka input rows, for the snapshot job and the streaming engine. With the sort time that
    `read_inputs` adds (`sort`), the batch jobs' history order is ORDER."""
    from pyspark.sql import functions as F

    return [
        F.unix_millis("timestamp").alias("ts"),
        (F.col("topic") == spec.delta_topic).cast("int").alias("rank"),
        "partition",
        "offset",
        "topic",
    ]
# Python's str.strip()/isspace() whitespace, as a Java regex class: Unicode White_Space + \x1c-\x1f.
_WS = r"[\s\x1c-\x1f]"
OUTPUT_SCHEMA = "sow_key string, record string, expires_at long, updated_at long"


class SnapshotError(ValueError):
    """A snapshot that cannot be made (unknown topic, unsupported message type, bad instant)."""


_LAST_INSTANT = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z in epoch ms


def check_batch_topic(spec: SowTopic) -> None:
    """Refuse, by name, the SOW topics whose history a snapshot or a replay cannot rebuild the way
    the workers kept it (they would give a SOW the workers never held)."""
    if spec.persistence is Persistence.TRANSIENT:
        raise SnapshotError(f"{spec.topic} is transient: it keeps no SOW to take a snapshot or a replay of")
    if spec.capacity:
        raise SnapshotError(f"{spec.topic} has a capacity: which records it evicted or refused depends on every write of "
                            "each partition in order, which a snapshot or a replay does not rebuild (query the workers instead)")


def parse_instant(text: str | int) -> int:
    """Epoch milliseconds from epoch ms (digits) or ISO-8601 (no zone means UTC)."""
    if isinstance(text, int):
        return text
    raw = text.strip()
    if re.fullmatch(r"-?\d+", raw):
        if len(raw.lstrip("-")) > 15 or abs(int(raw)) > _LAST_INSTANT:
            raise SnapshotError(f"not an instant: {text!r} (epoch milliseconds up to {_LAST_INSTANT}, the end of year 9999)")
        return int(raw)
    try:
        moment = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise SnapshotError(f"not an instant: {text!r} (epoch milliseconds or ISO-8601, e.g. 2026-01-31T12:00:00Z)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


# reading -----------------------------------------------------------------------------------------
def input_offsets(bootstrap: str, spec: SowTopic) -> dict[str, dict[str, int]]:
    """End offsets of the input partitions, as Spark's `endingOffsets` takes them (`pin_inputs`)."""
    from confluent_kafka import KafkaException

    from processor.kafka.clients import end_offsets, make_consumer

    consumer = make_consumer(bootstrap)
    try:
        meta = consumer.list_topics(timeout=30).topics
        ends: dict[str, dict[str, int]] = {}
        for topic in (spec.topic, spec.delta_topic):
            if topic not in meta or meta[topic].error is not None:
                raise SnapshotError(f"input topic {topic} does not exist on {bootstrap}")
            try:
                marks = end_offsets(consumer, topic, sorted(meta[topic].partitions))
            except KafkaException as exc:
                raise SnapshotError(f"cannot read the end offsets of {topic}: {exc}") from None
            ends[topic] = {str(p): high for p, (_, high) in marks.items()}
        return ends
    finally:
        consumer.close()


@dataclass(frozen=True)
class PinnedInputs:
    """What every pass of one job reads the same: where each input partition ends (inputs arriving
    meanwhile do not half-appear) and whether the broker stamps both input topics (`sort_time`)."""

    ends: dict[str, dict[str, int]]
    broker_stamped: bool


def pin_inputs(bootstrap: str, spec: SowTopic) -> PinnedInputs:
    """The inputs of one job, pinned once: a snapshot reads them up to five times."""
    return PinnedInputs(input_offsets(bootstrap, spec), broker_stamped(bootstrap, spec))


def read_inputs(spark: SparkSession, bootstrap: str, spec: SowTopic, pinned: PinnedInputs | None = None,
                starting_timestamp: int | None = None) -> DataFrame:
    """The raw input messages (Spark's Kafka batch source) up to the pinned ends, from the start or
    from the first offset whose timestamp is >= `starting_timestamp`, with big fetches: Spark's
    defaults (500 records per poll, 1 MB per partition) made reading 3x slower here."""
    from processor.kafka.config import spark_kafka_options

    pinned = pinned or pin_inputs(bootstrap, spec)
    reader = (
        spark.read.format("kafka")
        .options(**spark_kafka_options(bootstrap))
        .option("subscribe", f"{spec.topic},{spec.delta_topic}")
        .option("includeHeaders", "true")
        .option("startingOffsets", "earliest")
    )
    if starting_timestamp is not None:
        reader = reader.option("startingTimestamp", str(starting_timestamp)).option("startingOffsetsByTimestampStrategy", "latest")
    return (
        reader.option("endingOffsets", json.dumps(pinned.ends))
        .option("failOnDataLoss", "false")
        .option("kafka.max.partition.fetch.bytes", str(16 << 20))
        .option("kafka.fetch.max.bytes", str(64 << 20))
        .option("kafka.max.poll.records", "20000")
        .option("kafka.receive.buffer.bytes", str(4 << 20))
        .load()
        .withColumn("sort", sort_time(pinned.broker_stamped))
    )


def sort_time(stamped_by_broker: bool) -> Column:
    """The time an input row sorts by, as a worker sorts it: the largest timestamp so far in its
    partition (processor.engine.ordering), so that a timestamp that goes backwards keeps its
    offset's place. A window over each partition in offset order when the publishers stamp the
    inputs (CreateTime); the timestamp itself when the broker stamps both input topics
    (LogAppendTime, `timestamps: arrival`), whose timestamps do not go backwards, and the job is
    spared the window's shuffle. From a first offset found by timestamp (a replay) the running
    maximum is the partition's too: every offset before that one has an earlier timestamp."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    ts = F.unix_millis("timestamp")
    if stamped_by_broker:
        return ts
    return F.max(ts).over(Window.partitionBy("topic", "partition").orderBy("offset").rowsBetween(Window.unboundedPreceding, Window.currentRow))


def broker_stamped(bootstrap: str, spec: SowTopic) -> bool:
    """Whether both input topics take the broker's clock (message.timestamp.type LogAppendTime).
    False when their configuration cannot be read: the window is always right, only slower."""
    from confluent_kafka.admin import ConfigResource, ResourceType

    from processor.kafka.clients import make_admin

    admin = make_admin(bootstrap)
    try:
        futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, t) for t in (spec.topic, spec.delta_topic)], request_timeout=30)
        return all(f.result(timeout=30)["message.timestamp.type"].value == "LogAppendTime" for f in futures.values())
    except Exception:  # noqa: BLE001 - not allowed to read the configs, or an old broker: take the window
        log.info("cannot read the timestamp type of %s's input topics: ordering by partition time", spec.topic, exc_info=True)
        return False


# classifying -------------------------------------------------------------------------------------
def _header(name: str) -> Column:
    """The last value of an input header (later duplicates win, as in `header_map`)."""
    from pyspark.sql import functions as F

    # The size guard skips the (interpreted) lambda for the common message without headers.
    return F.when(F.size("headers") > 0, F.expr(f"try_element_at(filter(headers, h -> h.key = '{name}'), -1).value").cast("string"))


def _strip(col: Column) -> Column:
    """Python's str.strip()."""
    from pyspark.sql import functions as F

    return F.regexp_replace(col, rf"(?U)^{_WS}+|{_WS}+$", "")


def _lit(value: Any) -> Column:
    from pyspark.sql import functions as F

    return F.lit(value).cast("long") if value is None or isinstance(value, int) else F.lit(value)


def lifetime_expr(spec: SowTopic, raw: Column) -> tuple[Column, Column]:
    """(valid, lifetime ms or null) for a `sow-expiration` header value: Spark's rendering of
    `ExpiryPolicy.lifetime_ms(parse_duration_ms(raw))`, using the core's regex and units (checked
    against the core in tests/integration/test_spark.py)."""
    from pyspark.sql import functions as F

    pattern = "(?d)" + _DURATION.pattern  # as re.ASCII; (?d): only \n ends a line, as for `$` in Python
    number = F.regexp_extract(raw, pattern, 1)
    unit = F.regexp_extract(raw, pattern, 2)
    unit_ms = F.lit(_UNITS_MS["s"]).cast("long")
    for name, size in _UNITS_MS.items():
        unit_ms = F.when(unit == name, F.lit(size).cast("long")).otherwise(unit_ms)
    exact_ms = number.try_cast("double") * unit_ms
    header_ms = F.when(exact_ms <= MAX_DURATION_MS, F.bround(exact_ms, 0).cast("long"))  # the core's limit (and no overflow)
    # As the core: a positive lifetime under half a millisecond is 1 ms, not 0 (never expires).
    header_ms = F.when((header_ms == 0) & (exact_ms > 0), F.lit(1).cast("long")).otherwise(header_ms)
    valid = raw.isNull() | (F.regexp_like(raw, F.lit(pattern)) & header_ms.isNotNull())
    policy = spec.expiry
    # message_ms present: 0 means never; absent: the topic default (None unless mode "default").
    life = F.when(raw.isNull(), _lit(policy.default_ms)).otherwise(F.when(header_ms == 0, _lit(None)).otherwise(header_ms))
    if not policy.clamped:  # no clamps, or a topic default lifetime that overrides them
        return valid, life
    fallback = policy.max_ms if policy.max_ms is not None else policy.min_ms
    clamped = life
    if policy.max_ms is not None:
        clamped = F.least(clamped, _lit(policy.max_ms))
    if policy.min_ms is not None:
        clamped = F.greatest(clamped, _lit(policy.min_ms))
    return valid, F.when(life.isNull(), _lit(fallback)).otherwise(clamped)


def live_expr(spec: SowTopic, expires_at: Column, at: int) -> Column:
    """Spark's rendering of `ExpiryPolicy.is_live(expires_at, at)`: whether a record may be
    delivered at `at` (epoch ms). Every Spark read of the SOW filters with it."""
    from pyspark.sql import functions as F

    if not spec.expiry.active:
        return F.lit(True)
    return expires_at.isNull() | (expires_at > F.lit(at).cast("long"))


def _variant_path(parts: tuple[str, ...]) -> str:
    segments = []
    for part in parts:
        if "'" not in part:
            segments.append(f"['{part}']")
        elif '"' not in part:
            segments.append(f'["{part}"]')
        else:
            raise SnapshotError(f"key field name {part!r} holds both quote characters: not supported by Spark paths")
    return "$" + "".join(segments)


# Integers from _UINT_MIN to _UINT_MAX are ints to orjson, though Spark's BIGINT cannot hold them.
# Floats below _EXACT_INT hold every integer. From a normal float (at least _MIN_NORMAL), a decimal
# of at most 15 significant digits that reads back as it is the only one: its shortest spelling.
_UINT_MIN, _UINT_MAX = 2**63, 2**64 - 1
_EXACT_INT = 2**53
_MIN_NORMAL = 2.2250738585072014e-308


def key_token(value: Column) -> Column:
    """One key value's element of a key group, from the value as a VARIANT (a scalar: the caller
    has checked that it is present and not null, an object or an array).

    The text the core gives the value (`processor.core.keys.key_text`) as a JSON string, computed
    by Spark for strings, booleans, integers and every float that 15 significant digits spell
    exactly (laid out as Python's repr does). A float that needs 16 or 17 digits (or is subnormal)
    stays a JSON number, and the SowKey UDF makes its text with the core: its group is still
    exact, except against a *string* key value that spells that same 16-17 digit text (two groups
    then share one SowKey). A number from 2**63 to 2**64 written with `.0` is taken as an integer:
    Spark's VARIANT keeps no trace of the `.0` there (as it does not of a `5.0`, which is harmless).
    """
    from pyspark.sql import functions as F

    j = F.to_json(value)
    d = j.try_cast("double")
    as_int = j.try_cast("decimal(20,0)")
    unsigned = as_int.between(F.lit(str(_UINT_MIN)).cast("decimal(20,0)"), F.lit(str(_UINT_MAX)).cast("decimal(20,0)"))
    # Digits: an integer literal (BIGINT), or a float with a zero fraction (DECIMAL(p,0)), which
    # has the same text below 2**53; orjson reads integer literals up to 2**64 - 1 as int.
    is_int = j.rlike(r"^-?[0-9]+$") & ((F.abs(as_int) < _EXACT_INT) | (F.schema_of_variant(value) == "BIGINT") | unsigned)
    integral = (F.abs(d) < _EXACT_INT) & (d == d.cast("long").cast("double"))
    e14 = F.format_string("%.14e", d)
    exact15 = (F.abs(d) >= _MIN_NORMAL) & (e14.try_cast("double") == d)
    text = (
        F.when(j.isin("true", "false"), j)
        .when(is_int, j)
        .when(integral, d.cast("long").cast("string"))
        .when(exact15, _python_repr(e14))
    )
    quoted = F.concat(F.lit('"'), text, F.lit('"'))
    return F.when(F.substring(j, 1, 1) == '"', j).when(text.isNotNull(), quoted).otherwise(d.cast("string"))


def _python_repr(e14: Column) -> Column:
    """Python's repr of a float from its `%.14e` form (`d.dddddddddddddde±XX`): the digits without
    trailing zeros, positional for exponents -4..15 (`0.0001`, `123.5`, `9100000000000000.0`),
    else `1.5e-05` / `1e+22`."""
    from pyspark.sql import functions as F

    pattern = r"^(-?)([0-9])\.([0-9]+)e([-+][0-9]+)$"
    sign = F.regexp_extract(e14, pattern, 1)
    digits = F.regexp_replace(F.concat(F.regexp_extract(e14, pattern, 2), F.regexp_extract(e14, pattern, 3)), "0+$", "")
    x = F.regexp_extract(e14, pattern, 4).cast("int")
    n = F.length(digits)
    one = F.lit(1)
    whole = F.rpad(F.substring(digits, one, x + 1), x + 1, "0")
    frac = F.when(n > x + 1, F.substring(digits, x + 2, n)).otherwise(F.lit("0"))
    small = F.concat(F.lit("0."), F.repeat(F.lit("0"), -x - 1), digits)
    mantissa = F.when(n > 1, F.concat(F.substring(digits, one, one), F.lit("."), F.substring(digits, F.lit(2), n))).otherwise(digits)
    exponent = F.concat(F.when(x < 0, F.lit("-")).otherwise(F.lit("+")), F.when(F.abs(x) < 10, F.lit("0")).otherwise(F.lit("")), F.abs(x).cast("string"))
    scientific = F.concat(mantissa, F.lit("e"), exponent)
    body = F.when((x >= 0) & (x < 16), F.concat(whole, F.lit("."), frac)).when((x < 0) & (x >= -4), small).otherwise(scientific)
    return F.concat(sign, body)


def classify(raw: DataFrame, spec: SowTopic, as_of: int | None = None, specials_only: bool = False) -> DataFrame:
    """One row per input the worker would apply (rejected ones dropped), with its history order,
    kind (publish | delta | delete | filter | keys), key group, lifetime and value.

    `grp` is the JSON array of the key values' tokens (`key_token`: the texts the SowKey is made
    of), or the publisher's sow-key: equal groups <=> equal SowKey. Deletes by filter or by SowKeys
    have no group (grp null).
    """
    from pyspark.sql import functions as F

    if spec.message_type is not MessageType.JSON:
        raise SnapshotError(f"{spec.topic}: Spark snapshots read JSON topics (message_type {spec.message_type.value} is not supported)")
    # Staged projections: each costly expression (the JSON parse above all) is computed once into
    # a column that later stages reference (Spark does not inline non-cheap aliases used twice).
    df = raw.select(*history_columns(spec), "sort", "value", "headers")
    if as_of is not None:
        df = df.where(F.col("sort") <= as_of)

    known = ", ".join(f"'{h}'" for h in sorted(H.KNOWN_INPUT))
    df = df.select(
        "*",
        F.col("value").cast("string").alias("text"),
        ((F.size("headers") > 0) & F.expr(f"exists(headers, h -> h.key IN ({known}) AND (h.value IS NULL OR NOT is_valid_utf8(cast(h.value AS string))))")).alias("bad_header"),
        _header(H.COMMAND).alias("cmd_raw"),
        _header(H.EXPIRATION).alias("exp_raw"),
        _header(H.KEY).alias("key_raw"),
        _header(H.FILTER).alias("filter_raw"),
        _header(H.KEYS).alias("keys_raw"),
    )
    col = F.col
    if specials_only:  # deletes by filter / SowKeys carry a sow-command and one of these headers
        df = df.where(col("cmd_raw").isNotNull() & (col("filter_raw").isNotNull() | col("keys_raw").isNotNull() | col("key_raw").isNotNull()))
    df = df.select("*", F.expr("try_parse_json(text)").alias("v"))
    exp_valid, life = lifetime_expr(spec, col("exp_raw"))
    header_key = col("key_raw")
    key_ok = header_key.isNotNull() & (header_key != "") & F.regexp_like(header_key, F.lit(USER_KEY_JAVA_REGEX))
    if spec.key_spec.user_keys:
        df = df.select("*", header_key.alias("grp0"), key_ok.alias("grp_ok"))
    else:
        paths = spec.key_spec.split
        df = df.select("*", *[F.variant_get("v", _variant_path(parts), "variant").alias(f"kv{n}") for n, parts in enumerate(paths)])
        df = df.select("*", *[F.to_json(f"kv{n}").alias(f"k{n}") for n in range(len(paths))])
        texts = [col(f"k{n}") for n in range(len(paths))]
        grp_ok = F.lit(True)
        for t in texts:  # present, not null, a scalar
            grp_ok = grp_ok & t.isNotNull() & (t != "null") & ~F.substring(t, 1, 1).isin("{", "[")
        tokens = [key_token(col(f"kv{n}")) for n in range(len(paths))]
        df = df.select("*", F.concat(F.lit("["), F.concat_ws(",", *tokens), F.lit("]")).alias("grp0"), grp_ok.alias("grp_ok"))

    command = F.when(col("cmd_raw").isNull(), F.when(col("rank") == 1, "delta_publish").otherwise("publish")).otherwise(F.lower(_strip(col("cmd_raw"))))
    is_object = col("v").isNotNull() & F.expr("is_valid_utf8(text)") & F.expr("substring(trim(LEADING ' \t\n\r' FROM text), 1, 1) = '{'")  # JSON whitespace
    record_ok = is_object & col("grp_ok")
    filter_text = _strip(col("filter_raw"))
    keys_list = F.filter(F.transform(F.split(col("keys_raw"), ","), lambda k: _strip(k)), lambda k: k != "")
    keys_ok = (F.size(keys_list) > 0) & F.forall(keys_list, lambda k: F.regexp_like(k, F.lit(USER_KEY_JAVA_REGEX)))
    has_value = col("value").isNotNull() & (F.length("value") > 0)
    header_key_set = header_key.isNotNull() & (header_key != "")
    kind = (
        F.when(col("bad_header") | ~exp_valid, None)
        .when(command.isin("publish", "delta_publish"), F.when(record_ok, F.when(command == "publish", "publish").otherwise("delta")))
        .when(command != "sow_delete", None)
        .when(col("filter_raw").isNotNull(), F.when(filter_text != "", "filter"))
        .when(col("keys_raw").isNotNull(), F.when(keys_ok, "keys"))
        .when(has_value, F.when(record_ok, "delete"))
        .when(header_key_set, F.when(key_ok, "keys"))
    )
    df = df.select(*ORDER, "ts", "topic", "value", "text", "headers", "grp0", "filter_raw", "keys_raw", "key_raw", kind.alias("kind"), life.alias("life"))
    df = df.where(col("kind").isNotNull() & _accepted_udf(spec)("topic", "value", F.when(F.size("headers") > 0, col("headers"))))
    sow_keys = F.when(col("keys_raw").isNotNull(), keys_list).otherwise(F.array(header_key))
    return df.select(
        *ORDER,
        "ts",
        "topic",
        "value",
        "text",
        "headers",
        "kind",
        F.when(col("kind").isin("publish", "delta", "delete"), col("grp0")).alias("grp"),
        "life",
        F.when(col("kind") == "filter", filter_text).alias("filter"),
        F.when(col("kind") == "keys", sow_keys).alias("sow_keys"),
    )


# the per-group aggregation --------------------------------------------------------------------------
_PACK = (10**20, 10**19, 10**15, 1)  # sort time | rank | partition < 10^4 | offset < 10^15, in 38 digits


def pack_order(sort: int, rank: int, partition: int, offset: int) -> int:
    """The history order as one number (see `packed_order`)."""
    return sum(v * w for v, w in zip((sort, rank, partition, offset), _PACK))


def packed_order() -> Column:
    """The history order (sort time, rank, partition, offset) as one DECIMAL(38,0): a fixed-size
    aggregation key, which made the per-group aggregation 15% cheaper than a struct."""
    from pyspark.sql import functions as F

    out = None
    for name, weight in zip(ORDER, _PACK):
        term = F.col(name).cast("decimal(38,0)") * F.expr(f"CAST({weight} AS DECIMAL(38,0))")
        out = term if out is None else out + term
    return out.cast("decimal(38,0)")


def aggregate(events: DataFrame, with_first: bool = False) -> DataFrame:
    """Per key group: the latest base (publish or delete) and every delta; with `with_first`, the
    group's first input too (to tell which groups a delete by filter may have touched)."""
    from pyspark.sql import functions as F

    kind = F.col("kind")
    order = packed_order()
    is_base = kind.isin("publish", "delete")
    columns = [
        F.max(F.when(is_base, order)).alias("base_o"),
        F.max_by(F.struct("ts", "sort", (kind == "delete").alias("deleted"), "life", F.col("text").alias("value")), F.when(is_base, order)).alias("base"),
        F.collect_list(F.when(kind == "delta", F.struct(order.alias("o"), "ts", "sort", "life", F.col("text").alias("value")))).alias("deltas"),
    ]
    if with_first:
        columns.append(F.min(order).alias("first"))
    return events.where(F.col("grp").isNotNull()).groupBy("grp").agg(*columns)


def chains(groups: DataFrame, spec: SowTopic) -> DataFrame:
    """Per group, the writes that make its record: the base publish (if the base is not a delete)
    and the deltas after it in order, from the last write whose predecessor had expired by then."""
    from pyspark.sql import functions as F

    after = F.array_sort(F.filter("deltas", lambda d: F.col("base_o").isNull() | (d["o"] > F.col("base_o"))))
    after = F.transform(after, lambda d: F.struct(d["ts"].alias("ts"), d["sort"].alias("sort"), d["life"].alias("life"), d["value"].alias("value")))
    base = F.struct(F.col("base.ts").alias("ts"), F.col("base.sort").alias("sort"), F.col("base.life").alias("life"), F.col("base.value").alias("value"))
    writes = F.when(F.col("base_o").isNotNull() & ~F.col("base.deleted"), F.concat(F.array(base), after)).otherwise(after)
    df = groups.select("grp", writes.alias("w"))
    if spec.expiry.active:
        # Write j starts anew when write j-1's record expired at or before j's sort time: a worker
        # expires records up to the sort time of the next input before it applies it (lifetimes
        # count from each write's own timestamp).
        expired_before = F.expr(
            "filter(sequence(1, greatest(size(w) - 1, 1)), j -> j < size(w) AND "
            "w[j - 1].life IS NOT NULL AND w[j - 1].ts + w[j - 1].life <= w[j].sort)"
        )
        start = F.coalesce(F.array_max(expired_before), F.lit(0))
        df = df.select("grp", F.slice("w", start + 1, F.size("w")).alias("w"))
    last = F.try_element_at("w", F.lit(-1))
    return df.where(F.size("w") > 0).select(
        "grp",
        F.col("w.value").alias("values"),
        F.when(last["life"].isNotNull(), last["ts"] + last["life"]).alias("expires_at"),
        last["ts"].alias("updated_at"),
    )


MERGE_LEVELS = 6  # nested object levels merged by Spark; records with deeper deltas use the core's merge


def _merge_maps(acc: Column, new: Column, levels: int) -> Column:
    """`processor.core.merge.merge` as a Spark expression over map<string, variant>: a field of the
    delta replaces the record's, except that an object meeting an object merges field by field,
    down to `levels` nested levels."""
    from pyspark.sql import functions as F

    def field(name: Column, value: Column) -> Column:
        if levels == 0:
            return value
        new_obj = value.try_cast("map<string,variant>")
        old_obj = F.try_element_at(acc, name).try_cast("map<string,variant>")
        both = new_obj.isNotNull() & old_obj.isNotNull()
        return F.when(both, F.to_variant_object(_merge_maps(old_obj, new_obj, levels - 1))).otherwise(value)

    kept = F.map_filter(acc, lambda name, _: ~F.array_contains(F.map_keys(new), name))
    return F.map_concat(kept, F.transform_values(new, field))


def _merge_in_python():
    """The core's merge over a chain's JSON values: for the chains `records` does not merge in Spark."""
    import functools

    import orjson

    from processor.core.merge import merge

    return _series_udf(lambda values: orjson.dumps(functools.reduce(merge, (orjson.loads(v) for v in values))).decode(), "string")


# Number literals that VARIANT does not give back as the workers write them: it reads a literal
# with a decimal point as a DECIMAL, so a whole one loses its fraction (`2.0` becomes the integer
# `2`, `-0.0` becomes `0`) and one of 16 digits or more keeps digits a double does not (the workers
# read every such literal as a double). Matched anywhere in the text: one inside a string only
# sends its chain to Python too, which is slower, not different.
_NOT_VARIANT_SAFE = r"[0-9]\.0+([^0-9.eE]|$)|[0-9][0-9.]{16,}"


def records(chained: DataFrame) -> DataFrame:
    """Record text per group, all within the group's row (no shuffle): a chain of one write is
    that write's value as published; longer chains fold `_merge_maps` over their VARIANT values.
    Chains that may nest deeper than MERGE_LEVELS (judged by an upper bound: an object level
    needs a '{'), or that hold a number VARIANT would change (`_NOT_VARIANT_SAFE`), go through the
    core's merge in Python instead."""
    from pyspark.sql import functions as F

    def as_map(text: Column) -> Column:
        return F.parse_json(text).try_cast("map<string,variant>")

    braces = F.aggregate("values", F.lit(0), lambda acc, v: F.greatest(acc, F.length(v) - F.length(F.regexp_replace(v, r"\{", ""))))
    in_python = (braces > MERGE_LEVELS + 1) | ((F.size("values") > 1) & F.exists("values", lambda v: v.rlike(_NOT_VARIANT_SAFE)))
    folded = F.aggregate(F.slice("values", 2, F.size("values")), as_map(F.col("values")[0]), lambda acc, v: _merge_maps(acc, as_map(v), MERGE_LEVELS))
    chained = chained.select("*", in_python.alias("in_python"))
    shallow = chained.where(~F.col("in_python")).select(
        "grp",
        F.when(F.size("values") == 1, F.col("values")[0]).otherwise(F.to_json(F.to_variant_object(folded))).alias("record"),
        "expires_at",
        "updated_at",
    )
    python = chained.where(F.col("in_python")).select("grp", _merge_in_python()("values").alias("record"), "expires_at", "updated_at")
    return shallow.unionByName(python)


def _series_udf(fn, return_type: str):
    """A pandas UDF (Series -> Series) from a per-value function of the core, applied per batch.
    The annotations are set here because pandas is only imported lazily (no string hints)."""
    import pandas as pd
    from pyspark.sql.functions import pandas_udf

    def batch(values):
        return pd.Series([fn(v) for v in values])

    batch.__annotations__ = {"values": pd.Series, "return": pd.Series}
    return pandas_udf(batch, return_type)


def accepted(spec: SowTopic, topics, values, headers) -> list[bool]:
    """Whether the worker accepts each input (topic, value, Kafka headers as key/value dicts or
    None): the core's `parse_command`, through the reference fold. Spark's JSON parser takes what
    orjson refuses (trailing content, 1e400, nesting past MAX_NESTING, integers past 64 bits), so
    the Spark expressions of `classify` only compute kinds, groups and lifetimes fast; this
    decides what is rejected."""
    from processor.contract.types import InputMessage
    from processor.engine.fold import SowFold

    fold = SowFold(spec)
    return [
        fold.parse(InputMessage(topic, 0, 0, None, value, None if hs is None else [(h["key"], h["value"]) for h in hs], 0)) is not None
        for topic, value, hs in zip(topics, values, headers)
    ]


def _accepted_udf(spec: SowTopic):
    """`accepted` as a pandas UDF of (topic, value, headers)."""
    import pandas as pd
    from pyspark.sql.functions import pandas_udf

    def batch(topics, values, headers):
        return pd.Series(accepted(spec, topics, values, headers))

    batch.__annotations__ = {"topics": pd.Series, "values": pd.Series, "headers": pd.Series, "return": pd.Series}
    return pandas_udf(batch, "boolean")


def _sow_key_udf(spec: SowTopic):
    """SowKeys from key groups: the core's checksum over the key values the group spells."""
    import orjson

    domain = spec.key_spec.domain
    return _series_udf(lambda g: checksum_key(domain, orjson.loads(g)), "string")


def _filter_udf(text: str):
    """`--filter`: the core's filter language on the resulting records."""
    import orjson

    from processor.core.filters import compile_filter

    predicate = compile_filter(text)  # parse errors surface here, before any job runs
    return _series_udf(lambda r: predicate.matches(orjson.loads(r)), "boolean")


def _fold_groups(spec: SowTopic, events: DataFrame, specials: list, as_of: int) -> DataFrame:
    """The reference fold for key groups that a delete by filter may have touched: each group's
    inputs plus every delete by filter or SowKeys, through `history.SowFold` (per group, pandas)."""
    import pandas as pd

    from processor.engine.topic import InputMessage
    from processor.engine.fold import SowFold

    def message(row) -> InputMessage:
        headers = [(h["key"], None if h["value"] is None else bytes(h["value"])) for h in row["headers"]] if row["headers"] is not None else None
        value = None if row["value"] is None else bytes(row["value"])
        return InputMessage(row["topic"], int(row["partition"]), int(row["offset"]), None, value, headers, int(row["ts"]))

    def placed(row) -> tuple:  # (the history order, the message): its sort time is the whole partition's
        return (*(int(row[c]) for c in ORDER), message(row))

    shared = [placed(s) for s in specials]

    def fold(frame: pd.DataFrame) -> pd.DataFrame:
        fold = SowFold(spec)
        own = [placed(r) for r in frame.to_dict("records")]
        for *order, msg in sorted(own + shared, key=lambda e: e[:4]):
            fold.apply(msg, order[0])  # a group's inputs alone: what was due by its sort time goes first
        rows = [(k, fold.codec.encode(r.data).decode(), r.expires_at, r.updated_at) for k, r in fold.as_of(as_of).items()]
        return pd.DataFrame(rows, columns=["sow_key", "record", "expires_at", "updated_at"])

    return events.select(*ORDER, "ts", "topic", "value", "headers", "grp").groupBy("grp").applyInPandas(fold, OUTPUT_SCHEMA)


def scan_specials(spark: SparkSession, bootstrap: str, spec: SowTopic, as_of: int, pinned: PinnedInputs) -> list:
    """The deletes by filter (that parse) and by SowKeys up to `as_of`. Only sow_delete messages
    with a sow-filter, sow-keys or sow-key header can be one, and that is decided on headers
    before any JSON is parsed, so this pass costs about one read of the topics."""
    from pyspark.sql import functions as F

    return classify(read_inputs(spark, bootstrap, spec, pinned), spec, as_of=as_of, specials_only=True).select(
        *ORDER, "ts", "kind", "filter", "sow_keys", "topic", "value", "headers"
    ).where(F.col("kind").isin("filter", "keys")).collect()  # a filter that does not parse was rejected by `accepted`


def snapshot(
    spark: SparkSession,
    bootstrap: str,
    spec: SowTopic,
    as_of: int,
    filter: str | None = None,
    pinned: PinnedInputs | None = None,
    specials: list | None = None,
    observation: Any = None,
) -> DataFrame:
    """The SOW at `as_of` (epoch ms): columns sow_key, record (JSON text), expires_at, updated_at.

    `specials` are the deletes by filter / SowKeys (`scan_specials`; found here when None). With
    `specials=[]` and an `observation`, the plan assumes there are none and the observation
    counts them (metric "specials") so the caller can redo the job: see `write_snapshot`.
    """
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    check_batch_topic(spec)
    matches = _filter_udf(filter) if filter else None
    pinned = pinned or pin_inputs(bootstrap, spec)
    if specials is None:
        specials = scan_specials(spark, bootstrap, spec, as_of, pinned)
    events = classify(read_inputs(spark, bootstrap, spec, pinned), spec, as_of=as_of)
    if observation is not None:
        events = events.observe(observation, F.count(F.when(F.col("kind").isin("filter", "keys"), 1)).alias("specials"))
    filters = [s for s in specials if s["kind"] == "filter"]
    keyed = [(k, pack_order(*(s[c] for c in ORDER))) for s in specials if s["kind"] == "keys" for k in s["sow_keys"]]
    groups = aggregate(events, with_first=bool(filters))
    sow_key = F.col("grp") if spec.key_spec.user_keys else _sow_key_udf(spec)("grp")

    if keyed:  # a delete by SowKey becomes the group's base when it is the latest one
        groups = groups.withColumn("sow_key", sow_key)
        deletes = spark.createDataFrame([(k, Decimal(o)) for k, o in keyed], "sow_key string, o decimal(38,0)")
        deletes = deletes.groupBy("sow_key").agg(F.max("o").alias("o"))
        newer = F.col("o").isNotNull() & (F.col("base_o").isNull() | (F.col("o") > F.col("base_o")))
        groups = groups.join(F.broadcast(deletes), "sow_key", "left").select(
            "grp",
            *(["first"] if filters else []),
            "deltas",
            F.when(newer, F.col("o")).otherwise(F.col("base_o")).alias("base_o"),
            F.when(newer, F.struct(F.lit(None).cast("long").alias("ts"), F.lit(None).cast("long").alias("sort"), F.lit(True).alias("deleted"), F.lit(None).cast("long").alias("life"), F.lit(None).cast("string").alias("value"))).otherwise(F.col("base")).alias("base"),
        )

    folded = None
    if filters:
        last = max(pack_order(*(s[c] for c in ORDER)) for s in filters)
        touched = F.col("first") < F.lit(Decimal(last)).cast("decimal(38,0)")
        fallback = groups.where(touched).select("grp")
        groups = groups.where(~touched)
        rescan = classify(read_inputs(spark, bootstrap, spec, pinned), spec, as_of=as_of).join(fallback, "grp", "left_semi")
        folded = _fold_groups(spec, rescan, specials, as_of)

    # Two branches read the chains (merged by Spark, by the core): persist them so the aggregation
    # runs once (`release` unpersists).
    chained = chains(groups, spec).persist(StorageLevel.MEMORY_AND_DISK)
    result = records(chained)
    result = result.where(live_expr(spec, F.col("expires_at"), as_of))
    result = result.select(sow_key.alias("sow_key"), "record", "expires_at", "updated_at")
    if folded is not None:
        result = result.unionByName(folded)
    if matches is not None:
        result = result.where(matches("record"))
    result._ksow_cached = [chained]  # type: ignore[attr-defined]
    return result


def release(df: DataFrame) -> None:
    """Unpersist what a snapshot DataFrame cached, once it has been written or read."""
    for cached in getattr(df, "_ksow_cached", ()):
        cached.unpersist()


def write_snapshot(spark: SparkSession, bootstrap: str, spec: SowTopic, as_of: int, path: str, filter: str | None = None) -> int:
    """Write the SOW at `as_of` as Parquet at `path`; returns the number of passes (1 or 2).

    The first pass assumes the history has no deletes by filter or SowKeys and counts them on the
    way; only if it met any is the job redone knowing them (most histories pay one pass).
    """
    from pyspark.sql import Observation

    pinned = pin_inputs(bootstrap, spec)
    seen = Observation("ksow-specials")
    df = snapshot(spark, bootstrap, spec, as_of, filter, pinned, specials=[], observation=seen)
    df.write.mode("overwrite").parquet(path)
    release(df)
    if not seen.get.get("specials"):
        return 1
    df = snapshot(spark, bootstrap, spec, as_of, filter, pinned)
    df.write.mode("overwrite").parquet(path)
    release(df)
    return 2
