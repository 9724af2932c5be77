"""Checking what was read: a rank file may come from another writer, an older traceml, a
damaged disk or a person. Values of the wrong type or range become null (unmeasured) and are
counted for a note, so every later stage computes on numbers only.
"""

from __future__ import annotations

import math
from typing import Any

from traceml import schema
from traceml.analysis.rankfile import RankRecords

# Largest believable value of any step field: ms (~30,000 years) or bytes (~1 EB). Beyond it a
# number is damage, and the bound keeps every sum of a column finite.
_MAX_VALUE = 1e18
# Step fields that may be negative (a start time before the header's clock origin).
_SIGNED_COLUMNS = frozenset({schema.T_START_MS})
_NUMBER_TYPES = frozenset({int, float, type(None)})
# Text from rank files is cut to this many characters before it reaches notes and reports.
_MAX_TEXT = 300


def _is_int(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def is_count(value: Any) -> bool:
    """A whole number of things, 0 or more, not a bool (input records are checked by it too)."""
    return _is_int(value, 0, 1 << 62)


def _is_positive_count(value: Any) -> bool:
    return _is_int(value, 1, 1 << 62)


def _is_rank(value: Any) -> bool:
    return _is_int(value, 0, schema.MAX_WORLD_SIZE - 1)


def is_world_size(value: Any) -> bool:
    """A world size a header could truly carry (the live view checks its headers by it too)."""
    return _is_int(value, 1, schema.MAX_WORLD_SIZE)


def is_number(value: Any) -> bool:
    """A finite real number in range, not a bool (the live view checks its steps by it too)."""
    return type(value) in (int, float) and math.isfinite(value) and abs(value) <= _MAX_VALUE


def _is_text_dict(value: Any) -> bool:
    return isinstance(value, dict) and all(_is_text(v) or v is None for v in value.values())


# Header fields the reducer reads, and what a usable value looks like (declarative table).
_HEADER_CHECKS: dict[str, Any] = {
    schema.RUN: _is_text,
    schema.RANK: _is_rank,
    schema.LOCAL_RANK: _is_rank,
    schema.WORLD_SIZE: is_world_size,
    schema.LOCAL_WORLD_SIZE: is_world_size,
    schema.NODE_RANK: _is_rank,
    schema.HOST: _is_text,
    schema.CLOCK_ORIGIN_UNIX: is_number,
    schema.VERSIONS: _is_text_dict,
    schema.DEVICE: lambda value: isinstance(value, dict),
    schema.TIMING: _is_text,
    schema.COMM_TIMING: _is_text,
    schema.BUCKET_TIMING: _is_text,
    schema.SCRIPT: _is_text,
    schema.INTEGRATION: _is_text,
    schema.ACCUMULATE_GRAD_BATCHES: _is_positive_count,
    schema.BATCH_SIZE: _is_positive_count,
    "num_workers": is_count,
    schema.SETTINGS: lambda value: isinstance(value, dict),
}
_DEVICE_CHECKS: dict[str, Any] = {
    schema.DEVICE_TYPE: _is_text,
    schema.DEVICE_NAME: _is_text,
    schema.DEVICE_TOTAL_MEMORY: lambda value: is_number(value) and value > 0,
}


def _checked(record: dict[str, Any], checks: dict[str, Any], prefix: str = "") -> list[str]:
    """Drop the fields of ``record`` that fail their check; return their names."""
    dropped = []
    for name, check in checks.items():
        value = record.get(name)
        if value is not None and not check(value):
            del record[name]
            dropped.append(prefix + name)
    return dropped


def _clean_header(data: RankRecords) -> None:
    header = data.header
    if header is None:
        return
    header = dict(header)
    dropped = _checked(header, _HEADER_CHECKS)
    if isinstance(header.get(schema.DEVICE), dict):
        header[schema.DEVICE] = dict(header[schema.DEVICE])
        dropped += _checked(header[schema.DEVICE], _DEVICE_CHECKS, schema.DEVICE + ".")
    settings = header.get(schema.SETTINGS)
    max_steps = settings.get("trace_max_steps") if isinstance(settings, dict) else None
    if max_steps is not None and not _is_positive_count(max_steps):
        header[schema.SETTINGS] = {**settings, "trace_max_steps": None}
        dropped.append(schema.SETTINGS + ".trace_max_steps")
    data.header = header
    data.bad_header_fields.extend(dropped)


def _short_text(value: Any) -> str | None:
    """Text from a rank file, on one line and cut to a length a note can carry."""
    if value is None:
        return None
    text = " ".join(str(value).split())
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "..."


def _clean_footer_and_events(data: RankRecords) -> None:
    if data.footer is not None:
        footer = dict(data.footer)
        for name in (schema.STATUS, schema.ERROR, schema.ERROR_TYPE, schema.ENDED_AT):
            if not _is_text(footer.get(name)):
                footer[name] = None
            else:
                footer[name] = _short_text(footer[name])
        data.footer = footer
    data.events = [
        {**event, schema.MESSAGE: _short_text(event.get(schema.MESSAGE)) or ""}
        for event in data.events
    ]


def _column_is_clean(column: list[Any], signed: bool) -> bool:
    """The fast check (C-speed passes): numbers and nulls only, all in range, none NaN."""
    nulls = column.count(None)
    if nulls == len(column):  # a field this rank never measured
        return True
    if not set(map(type, column)) <= _NUMBER_TYPES:
        return False
    values = [v for v in column if v is not None] if nulls else column
    if not values:
        return True
    low = -_MAX_VALUE if signed else 0.0
    # A NaN makes the sum NaN, which fails the comparison too.
    return min(values) >= low and max(values) <= _MAX_VALUE and math.isfinite(sum(values))


def _clean_column(column: list[Any], signed: bool) -> int:
    """Replace the values that are not usable numbers by null, in place; return how many."""
    bad = 0
    for index, value in enumerate(column):
        if value is None:
            continue
        if not is_number(value) or (value < 0 and not signed):
            column[index] = None
            bad += 1
    return bad


def clean_records(data: RankRecords) -> None:
    """Make ``data`` safe to compute on (idempotent): see the section comment above."""
    _clean_header(data)
    _clean_footer_and_events(data)
    for name, column in data.columns.items():
        signed = name in _SIGNED_COLUMNS
        if not _column_is_clean(column, signed):
            data.bad_values += _clean_column(column, signed)
