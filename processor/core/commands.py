"""Turning one input message (topic, headers, value) into a SowCommand, or a clear InputError."""

from __future__ import annotations

from typing import Iterable

from processor.contract import headers as H
from processor.contract.errors import InputError
from processor.contract.limits import max_delete_keys
from processor.contract.types import Command, SowCommand, UnreadableHeaders
from processor.core.codec import Codec
from processor.core.durations import DurationError, parse_duration_ms
from processor.core.filters import FilterError, compile_filter
from processor.core.keys import KeyError_, KeySpec, validate_user_key

_SOW_DELETE, _DELTA_PUBLISH = Command.SOW_DELETE, Command.DELTA_PUBLISH  # globals: a member looked up on its Enum class costs ~8x more


def header_map(headers: Iterable[tuple[str, bytes | None]] | dict | None) -> dict[str, str]:
    """Input headers as text; later duplicates win. Undecodable ksow headers are input errors."""
    if not headers:
        return {}
    if type(headers) is UnreadableHeaders:
        raise InputError(UnreadableHeaders.REASON)
    items = headers.items() if isinstance(headers, dict) else headers
    out: dict[str, str] = {}
    for name, raw in items:
        if name not in H.KNOWN_INPUT:
            if name not in H.KNOWN and name[:4].lower() == "sow-":
                raise InputError(f"unknown header {name!r}: ksow's input headers are {', '.join(sorted(H.KNOWN_INPUT))} (lower case)")
            continue
        if raw is None:
            raise InputError(f"header {name} has no value")
        try:
            out[name] = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
        except UnicodeDecodeError:
            raise InputError(f"header {name} is not UTF-8") from None
    return out


def parse_command(
    keys: KeySpec,
    codec: Codec,
    default_command: Command,
    value: bytes | None,
    headers: dict[str, str] | None,
) -> SowCommand:
    """Everything an input message asks for, validated; raises InputError with the reason."""
    command = default_command
    expiration_ms = header_key = None
    if headers:  # most inputs carry none: no look-ups then
        raw_command = headers.get(H.COMMAND)
        if raw_command is not None:
            try:
                command = Command(raw_command.strip().lower())
            except ValueError:
                raise InputError(f"unknown sow-command {raw_command!r} (publish, delta_publish or sow_delete)") from None
        if H.EXPIRATION in headers:
            try:
                expiration_ms = parse_duration_ms(headers[H.EXPIRATION])
            except DurationError as exc:
                raise InputError(f"bad sow-expiration header: {exc}") from None
        header_key = headers.get(H.KEY)
        if command is not _SOW_DELETE and (H.FILTER in headers or H.KEYS in headers):
            raise InputError(f"{H.FILTER if H.FILTER in headers else H.KEYS} goes with sow-command: sow_delete, and this input is a "
                             f"{command.value}: nothing was deleted or written")
    try:
        if command is _SOW_DELETE:
            return _parse_delete(keys, codec, value, headers or {}, header_key)
        if value is None:
            raise InputError(f"{command.value} has no value (a tombstone is not a record; use sow_delete)")
        record = codec.decode(value)
        if command is _DELTA_PUBLISH and codec.trims_deltas:
            whole, record = record, codec.delta_fields(record)
            return SowCommand(command, keys.sow_key(record, header_key), record, expiration_ms, whole=whole)
        return SowCommand(command, keys.sow_key(record, header_key), record, expiration_ms)
    except KeyError_ as exc:
        raise InputError(str(exc)) from None


def _parse_delete(keys: KeySpec, codec: Codec, value: bytes | None, headers: dict[str, str], header_key: str | None) -> SowCommand:
    named = [name for name in (H.FILTER, H.KEYS) if name in headers] + (["a value"] if value else [])
    if len(named) > 1:  # applying one would drop the others without a word (a filter 1=1 beside sow-keys deleted everything)
        raise InputError(f"sow_delete with {' and '.join(named)}: give one of sow-filter, sow-keys or a record to delete by data")
    if H.FILTER in headers:
        text = headers[H.FILTER].strip()
        if not text:
            raise InputError("empty sow-filter on sow_delete")
        try:
            compile_filter(text)
        except FilterError as exc:
            raise InputError(f"bad sow-filter: {exc}") from None
        return SowCommand(Command.SOW_DELETE, filter=text)
    if H.KEYS in headers:
        listed = tuple(k.strip() for k in headers[H.KEYS].split(",") if k.strip())
        if not listed:
            raise InputError("empty sow-keys on sow_delete")
        cap = max_delete_keys()
        if len(listed) > cap:  # each key becomes a rerouted copy of the message
            raise InputError(f"sow-keys lists {len(listed)} keys, over the limit of {cap} per sow_delete (KSOW_MAX_DELETE_KEYS)")
        return SowCommand(Command.SOW_DELETE, keys=tuple(validate_user_key(k) for k in listed))
    if value:
        record = codec.decode(value)
        return SowCommand(Command.SOW_DELETE, sow_key=keys.sow_key(record, header_key), data=record)
    if header_key:
        return SowCommand(Command.SOW_DELETE, sow_key=validate_user_key(header_key))
    raise InputError("sow_delete needs a sow-filter, sow-keys or a record to delete by data")
