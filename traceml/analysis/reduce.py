"""Rank files -> summary dict. Pure Python; never imports torch or Lightning.

Reads ``<run_dir>/ranks/rank_*.jsonl`` one rank at a time (so memory is bounded by the
largest rank), in chunks of lines (so it is bounded by that rank's numbers, not its parsed
records). Damage is reported, never raised: a truncated last line, a missing footer, a missing
rank, an empty file, a value of the wrong type, a negative time each become a note. Only two
things are errors: no rank files at all, and a rank file of a newer schema than this traceml
understands. Rank files are only read: nothing here writes.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson

from traceml import schema
from traceml.analysis import input_pipeline, job_series, resources, stats
from traceml.errors import ReduceError
from traceml.thresholds import resolve_thresholds

# Only the spelling traceml writes: "rank_01.jsonl" next to "rank_1.jsonl" would be two files
# for one rank.
_RANK_FILE = re.compile(r"^rank_(0|[1-9][0-9]*)\.jsonl$")
_ANY_RANK_FILE = re.compile(r"^rank_.*\.jsonl$")
_CHUNK_LINES = 8192
TIMELINE_BINS = 200

# Step fields the reducer keeps per step (the rest of a record is not needed after reading).
_COLUMNS: tuple[str, ...] = (
    *schema.TIMED_FIELDS,
    *schema.GPU_FIELDS,
    schema.GAP_MS,
    schema.T_START_MS,
    schema.MEM_PEAK_ALLOCATED,
    schema.MEM_PEAK_RESERVED,
    schema.RSS,
    schema.MICROBATCHES,
    *schema.COMM_FIELDS,
    *schema.GPU_COMM_FIELDS,
    schema.TRACEML_COST_US,
)
# Derived per step from the columns above (see _derive_own).
_OWN_FIELDS: tuple[str, ...] = (
    schema.OWN_MS,
    *schema.OWN_OF_PHASE.values(),
    schema.GPU_OWN_MS,
    *schema.GPU_OWN_OF_PHASE.values(),
)
_STAT_FIELDS: tuple[str, ...] = (
    *schema.TIMED_FIELDS,
    *schema.GPU_FIELDS,
    *schema.COMM_FIELDS,
    *schema.GPU_COMM_FIELDS,
    *_OWN_FIELDS,
    schema.TRACEML_COST_US,
)
# Fields whose whole distribution goes into the summary (what compare needs).
_DISTRIBUTED_FIELDS = frozenset(
    (*schema.TIMED_FIELDS, *schema.GPU_FIELDS, schema.COMM, schema.GPU_COMM)
)
# Fields compared across ranks (imbalance, stragglers).
_RANK_COMPARED: tuple[str, ...] = (
    *schema.TIMED_FIELDS,
    schema.COMM,
    schema.GPU_STEP,
    schema.GPU_COMM,
    *schema.GPU_OF_PHASE.values(),
    *_OWN_FIELDS,
)


# Largest believable value of any step field: ms (~30,000 years) or bytes (~1 EB). Beyond it a
# number is damage, and the bound keeps every sum of a column finite.
_MAX_VALUE = 1e18
# Step fields that may be negative (a start time before the header's clock origin).
_SIGNED_COLUMNS = frozenset({schema.T_START_MS})
_NUMBER_TYPES = frozenset({int, float, type(None)})
# Text from rank files is cut to this many characters before it reaches notes and reports.
_MAX_TEXT = 300


@dataclass
class RankRecords:
    """Everything read from one rank file."""

    rank: int
    path: Path
    header: dict[str, Any] | None = None
    footer: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    columns: dict[str, list[Any]] = field(default_factory=lambda: {c: [] for c in _COLUMNS})
    bad_lines: int = 0
    truncated_tail: bool = False
    # Set by clean_records: step values and header fields that were not what traceml writes.
    bad_values: int = 0
    bad_header_fields: list[str] = field(default_factory=list)
    unreadable: str | None = None  # why the file could not be read at all
    inputs: list[dict[str, Any]] = field(default_factory=list)  # KIND_INPUT records
    samples: list[dict[str, Any]] = field(default_factory=list)  # telemetry (KIND_SAMPLE)

    @property
    def step_count(self) -> int:
        return len(self.columns[schema.STEP])


# ----------------------------------------------------------------------------------------------
# Reading


def list_rank_files(run_dir: Path) -> dict[int, Path]:
    """The rank files of ``run_dir`` by rank (regular files with traceml's names only)."""
    return scan_rank_files(run_dir)[0]


def scan_rank_files(run_dir: Path) -> tuple[dict[int, Path], list[str]]:
    """The rank files by rank, and a note for each file that looks like one but is skipped."""
    ranks_dir = Path(run_dir) / schema.RANKS_DIR
    found: dict[int, Path] = {}
    skipped: list[str] = []
    try:
        entries = list(ranks_dir.iterdir()) if ranks_dir.is_dir() else []
    except OSError:
        entries = []
    for path in entries:
        match = _RANK_FILE.match(path.name)
        if match is None:
            if _ANY_RANK_FILE.match(path.name):
                skipped.append(f"{path.name}: not a rank file name traceml writes; skipped")
            continue
        rank = int(match.group(1))
        if rank >= schema.MAX_WORLD_SIZE:
            skipped.append(
                f"{path.name}: rank {rank} is beyond any real job "
                f"({schema.MAX_WORLD_SIZE} ranks at most); skipped"
            )
        elif not path.is_file():
            skipped.append(f"{path.name}: not a regular file; skipped")
        else:
            found[rank] = path
    return dict(sorted(found.items())), sorted(skipped)


def parse_lines(lines: list[bytes]) -> list[dict[str, Any] | None]:
    """JSON lines to dicts (None for a damaged line); one orjson call for the whole chunk in
    the common case. Also the live view's parser."""
    if not lines:
        return []
    try:
        records = orjson.loads(b"[" + b",".join(lines) + b"]")
        if all(type(record) is dict for record in records):
            return records
    except orjson.JSONDecodeError:
        pass
    parsed: list[dict[str, Any] | None] = []
    for line in lines:
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            record = None
        parsed.append(record if isinstance(record, dict) else None)
    return parsed


def read_rank_file(path: Path, rank: int) -> RankRecords:
    data = RankRecords(rank=rank, path=path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        data.unreadable = exc.strerror or type(exc).__name__
        return data
    ends_cleanly = raw.endswith(b"\n") or not raw
    lines = [line for line in raw.split(b"\n") if line]
    del raw
    columns = data.columns
    total = len(lines)
    for start in range(0, total, _CHUNK_LINES):
        parsed = parse_lines(lines[start : start + _CHUNK_LINES])
        # Nearly every line is a well-formed step: take those in one pass, look at the rest.
        steps = [
            record
            for record in parsed
            if record is not None
            and record.get(schema.KIND) == schema.KIND_STEP
            and record.get(schema.STEP) is not None
        ]
        if len(steps) == len(parsed):
            _append_columns(columns, steps)
            continue
        # Telemetry samples come about once a second, so most chunks hold a few: keep those
        # chunks on the fast path too.
        samples = [r for r in parsed if r is not None and r.get(schema.KIND) == schema.KIND_SAMPLE]
        if samples and len(steps) + len(samples) == len(parsed):
            _append_columns(columns, steps)
            data.samples.extend(samples)
            continue
        steps = []
        for index, record in enumerate(parsed):
            if record is None:
                if start + index == total - 1 and not ends_cleanly:
                    data.truncated_tail = True
                else:
                    data.bad_lines += 1
                continue
            kind = record.get(schema.KIND)
            if kind == schema.KIND_STEP:
                if record.get(schema.STEP) is None:
                    data.bad_lines += 1
                    continue
                steps.append(record)
            elif kind == schema.KIND_HEADER and data.header is None:
                _check_rank_schema(record, path)
                data.header = record
            elif kind == schema.KIND_EVENT:
                data.events.append(record)
            elif kind == schema.KIND_FOOTER:
                data.footer = record
            elif kind == schema.KIND_INPUT:
                data.inputs.append({**record, schema.RANK: data.rank})
            elif kind == schema.KIND_SAMPLE:
                data.samples.append(record)
        _append_columns(columns, steps)
    return data


_pick_columns = operator.itemgetter(*_COLUMNS)


def _append_columns(columns: dict[str, list[Any]], steps: list[dict[str, Any]]) -> None:
    """Transpose step records into columns (C-speed when every field is present, as traceml
    writes them; field by field with defaults for records from other writers)."""
    try:
        rows = [_pick_columns(record) for record in steps]
    except KeyError:
        for column in _COLUMNS:
            columns[column].extend([record.get(column) for record in steps])
        return
    if rows:
        for column, values in zip(_COLUMNS, zip(*rows, strict=True), strict=True):
            columns[column].extend(values)


def _check_rank_schema(header: dict[str, Any], path: Path) -> None:
    family, supported_major = schema.family_and_major(schema.RANK_SCHEMA)
    major = schema.schema_major(header.get(schema.SCHEMA), family)
    if major is None:
        raise ReduceError(
            f"{path} is not a traceml rank file (schema {header.get(schema.SCHEMA)!r})"
        )
    if major != supported_major:
        raise ReduceError(
            f"{path} has schema {header.get(schema.SCHEMA)}; this traceml reads "
            f"{family}/{supported_major}.x (install the traceml version that wrote it)"
        )


# ----------------------------------------------------------------------------------------------
# Checking what was read: a rank file may come from another writer, an older traceml, a
# damaged disk or a person. Values of the wrong type or range become null (unmeasured) with a
# note, so every later step computes on numbers only.


def _is_int(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _is_count(value: Any) -> bool:
    return _is_int(value, 0, 1 << 62)


def _is_positive_count(value: Any) -> bool:
    return _is_int(value, 1, 1 << 62)


def _is_rank(value: Any) -> bool:
    return _is_int(value, 0, schema.MAX_WORLD_SIZE - 1)


def _is_world_size(value: Any) -> bool:
    return _is_int(value, 1, schema.MAX_WORLD_SIZE)


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and abs(value) <= _MAX_VALUE


def _is_text_dict(value: Any) -> bool:
    return isinstance(value, dict) and all(_is_text(v) or v is None for v in value.values())


# Header fields the reducer reads, and what a usable value looks like (declarative table).
_HEADER_CHECKS: dict[str, Any] = {
    schema.RUN: _is_text,
    schema.RANK: _is_rank,
    schema.LOCAL_RANK: _is_rank,
    schema.WORLD_SIZE: _is_world_size,
    schema.LOCAL_WORLD_SIZE: _is_world_size,
    schema.NODE_RANK: _is_rank,
    schema.HOST: _is_text,
    schema.CLOCK_ORIGIN_UNIX: _is_number,
    schema.VERSIONS: _is_text_dict,
    schema.DEVICE: lambda value: isinstance(value, dict),
    schema.TIMING: _is_text,
    schema.COMM_TIMING: _is_text,
    schema.BUCKET_TIMING: _is_text,
    schema.SCRIPT: _is_text,
    schema.INTEGRATION: _is_text,
    schema.ACCUMULATE_GRAD_BATCHES: _is_positive_count,
    schema.BATCH_SIZE: _is_positive_count,
    "num_workers": _is_count,
    schema.SETTINGS: lambda value: isinstance(value, dict),
}
_DEVICE_CHECKS: dict[str, Any] = {
    schema.DEVICE_TYPE: _is_text,
    schema.DEVICE_NAME: _is_text,
    schema.DEVICE_TOTAL_MEMORY: lambda value: _is_number(value) and value > 0,
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
    if not set(map(type, column)) <= _NUMBER_TYPES:
        return False
    values = [v for v in column if v is not None] if None in column else column
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
        if not _is_number(value) or (value < 0 and not signed):
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


# ----------------------------------------------------------------------------------------------
# Per-rank reduction


def _minus(values: list[Any], waits: list[Any]) -> list[float | None]:
    """Per step ``value - wait``; null where either is unmeasured."""
    return [
        None if value is None or wait is None else value - wait
        for value, wait in zip(values, waits, strict=True)
    ]


def _derive_own(columns: dict[str, list[Any]]) -> None:
    """A rank's own time per step: what it spent not waiting on other ranks.

    With comm fields (multi-rank runs of this traceml): the step minus its waits, and each
    phase minus the waits inside it. Without them (older files, or a single process): the
    step minus Backward, where DDP's all-reduce wait sits on gloo; per-phase own times are then
    unknown (null).
    """
    steps, comm = columns[schema.STEP], columns[schema.COMM]
    if any(value is not None for value in comm):
        columns[schema.OWN_MS] = _minus(steps, comm)
    else:
        columns[schema.OWN_MS] = [
            None if step is None else step - (backward or 0.0)
            for step, backward in zip(steps, columns[schema.BACKWARD], strict=True)
        ]
    for phase, own in schema.OWN_OF_PHASE.items():
        columns[own] = _minus(columns[phase], columns[schema.COMM_OF_PHASE[phase]])
    _derive_gpu_own(columns)


def _derive_gpu_own(columns: dict[str, list[Any]]) -> None:
    device_own = _minus(columns[schema.GPU_STEP], columns[schema.GPU_COMM])
    inputs = columns[schema.INPUT_WAIT]
    columns[schema.GPU_OWN_MS] = [
        None if own is None else own + (wait or 0.0)
        for own, wait in zip(device_own, inputs, strict=True)
    ]
    named = [0.0] * len(device_own)
    for phase, own in schema.GPU_OWN_OF_PHASE.items():
        if phase == schema.RESIDUAL:
            continue
        columns[own] = _minus(
            columns[schema.GPU_OF_PHASE[phase]], columns[schema.GPU_COMM_OF_PHASE[phase]]
        )
        named = [total + (value or 0.0) for total, value in zip(named, columns[own], strict=True)]
    # What the device did in the step outside the named phases (loss, matching...), not waiting.
    columns[schema.GPU_OWN_OF_PHASE[schema.RESIDUAL]] = [
        None if own is None else max(0.0, own - total)
        for own, total in zip(device_own, named, strict=True)
    ]


def _present(values: list[Any]) -> list[float]:
    """The measured values (null means unmeasured and is left out)."""
    return [v for v in values if v is not None]


def _max_or_none(values: list[Any]) -> int | float | None:
    present = _present(values)
    return max(present) if present else None


def _timeline(columns: dict[str, list[Any]], warmup: int) -> dict[str, Any]:
    count = len(columns[schema.STEP])
    per_bin = max(1, math.ceil(count / TIMELINE_BINS))
    bins: list[dict[str, Any]] = [{} for _ in range(0, count, per_bin)]
    for fieldname in schema.TIMED_FIELDS:
        column = columns[fieldname]
        complete = None not in column  # the usual case: plain sums over slices, no filtering
        for index, start in enumerate(range(0, count, per_bin)):
            values = column[start : start + per_bin]
            if not complete:
                values = _present(values)
            bins[index][fieldname] = sum(values) / len(values) if values else None
    return {"steps_per_bin": per_bin, "warmup_steps": warmup, "bins": bins}


def reduce_rank(data: RankRecords, warmup: int) -> tuple[dict[str, Any], dict[str, stats.Sketch]]:
    """One rank's summary entry, and the sketches its analysed steps add to the overall view."""
    columns = dict(data.columns)
    _derive_own(columns)
    count = data.step_count
    skipped = min(warmup, count) if count > warmup else 0
    header = data.header or {}
    footer = data.footer or {}
    entry: dict[str, Any] = {
        schema.RANK: data.rank,
        schema.LOCAL_RANK: header.get(schema.LOCAL_RANK),
        schema.NODE_RANK: header.get(schema.NODE_RANK),
        schema.HOST: header.get(schema.HOST),
        schema.STATUS: footer.get(schema.STATUS),
        schema.ERROR: footer.get(schema.ERROR),
        schema.ERROR_TYPE: _error_type(footer),
        schema.NOT_TRACED_REASON: _not_traced_reason(data),
        schema.SUMMARY_STEPS_RECORDED: count,
        schema.SUMMARY_STEPS_ANALYSED: count - skipped,
        schema.SUMMARY_WARMUP: skipped,
    }
    phase_stats: dict[str, Any] = {}
    sketches: dict[str, stats.Sketch] = {}
    sums: dict[str, float] = {}
    for fieldname in _STAT_FIELDS:
        values = sorted(_present(columns[fieldname][skipped:]))
        if not values:
            phase_stats[fieldname] = None
            continue
        phase_stats[fieldname] = stats.describe_sorted(values)
        sketches[fieldname] = stats.sketch_sorted(values)
        sums[fieldname] = phase_stats[fieldname]["sum"]
    entry[schema.PHASE_STATS] = phase_stats
    entry[schema.SHARES] = shares_from_sums(sums)
    step_stats = phase_stats.get(schema.STEP)
    entry[schema.STEPS_PER_S] = (
        1000.0 / step_stats["mean"] if step_stats and step_stats["mean"] > 0 else None
    )
    entry[schema.PEAK_ALLOCATED] = _max_or_none(columns[schema.MEM_PEAK_ALLOCATED])
    entry[schema.PEAK_RESERVED] = _max_or_none(columns[schema.MEM_PEAK_RESERVED])
    entry[schema.PEAK_RSS] = _max_or_none(columns[schema.RSS])
    gaps = _present(columns[schema.GAP_MS])
    entry[schema.BETWEEN_STEPS_MS] = math.fsum(gaps) if gaps else (0.0 if count else None)
    entry[schema.WALL_MS], last_end = _step_span(columns)
    entry[schema.AFTER_LAST_STEP_MS] = _after_last_step(header, footer, last_end)
    entry[schema.TIMELINE] = _timeline(columns, skipped)
    entry[schema.TELEMETRY] = resources.rank_telemetry(columns, data.samples, data.header, skipped)
    return entry, sketches


def _step_span(columns: dict[str, list[Any]]) -> tuple[float | None, float | None]:
    """First step start to last step end (ms), and that end on the rank's clock."""
    starts = columns[schema.T_START_MS]
    if not starts or starts[0] is None or starts[-1] is None:
        return None, None
    end = starts[-1] + (columns[schema.STEP][-1] or 0.0)
    return max(0.0, end - starts[0]), end


def _after_last_step(
    header: dict[str, Any], footer: dict[str, Any], last_end_ms: float | None
) -> float | None:
    """Time from the last step's end to the footer (training's end: final validation,
    checkpoints, teardown). Null when the file lacks a clock origin, an end time or steps."""
    origin = header.get(schema.CLOCK_ORIGIN_UNIX)
    started, ended = (
        _unix_time(header.get(schema.STARTED_AT)),
        _unix_time(footer.get(schema.ENDED_AT)),
    )
    if last_end_ms is None or origin is None or started is None or ended is None:
        return None
    after = (ended - origin) * 1000.0 - last_end_ms
    # Both ends come from one process's clocks, so the gap cannot exceed the file's whole span
    # (start to end); beyond it the clocks disagree (a moved system clock, a hand-made file).
    # The footer's time has millisecond resolution: a little below zero is rounding.
    if not -5.0 < after <= (ended - started) * 1000.0 + 5.0:
        return None
    return max(0.0, after)


def _unix_time(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except (ValueError, OverflowError, OSError):
        return None


def _error_type(footer: dict[str, Any]) -> str | None:
    """The exception type a rank stopped on: the footer's ERROR_TYPE, else the part of its
    ERROR before the first ':' (the writer's "<type name>: <message>" format)."""
    if footer.get(schema.ERROR_TYPE):
        return footer[schema.ERROR_TYPE]
    error = footer.get(schema.ERROR)
    if not error:
        return None
    name = error.partition(":")[0].strip()
    return name if name.isidentifier() else None


def _not_traced_reason(data: RankRecords) -> str | None:
    for event in data.events:
        if event.get(schema.CODE) == schema.EVENT_UNSUPPORTED:
            return event.get(schema.MESSAGE) or None
    return None


def shares_from_sums(sums: dict[str, float]) -> dict[str, float | None]:
    total = sums.get(schema.STEP)
    shares: dict[str, float | None] = {}
    for phase in schema.PHASES:
        value = sums.get(phase)
        shares[phase] = value / total if (value is not None and total) else None
    comm = sums.get(schema.COMM)
    shares[schema.COMM_SHARE] = comm / total if (comm is not None and total) else None
    for own in schema.OWN_OF_PHASE.values():
        value = sums.get(own)
        shares[own] = value / total if (value is not None and total) else None
    gpu_comm, gpu_total = sums.get(schema.GPU_COMM), sums.get(schema.GPU_STEP)
    shares[schema.GPU_COMM_SHARE] = (
        gpu_comm / gpu_total if (gpu_comm is not None and gpu_total) else None
    )
    for fieldname in schema.GPU_FIELDS:
        if fieldname == schema.GPU_STEP:
            continue
        value = sums.get(fieldname)
        gpu_total = sums.get(schema.GPU_STEP)
        shares[fieldname] = value / gpu_total if (value is not None and gpu_total) else None
    return shares


# ----------------------------------------------------------------------------------------------
# Notes about what a rank file says or lacks


def rank_notes(data: RankRecords) -> tuple[list[str], str | None]:
    """Sentences about one rank file's gaps and events, and its trace-max-steps message."""
    rank = data.rank
    notes: list[str] = []
    max_steps_message: str | None = None
    if data.unreadable is not None:
        return [f"rank {rank}: its file cannot be read ({data.unreadable})"], None
    notes.extend(_damage_notes(data))
    if data.header is None:
        if data.step_count == 0 and not data.events and data.footer is None:
            notes.append(f"rank {rank}: its file is empty (the process ended before training)")
        else:
            notes.append(f"rank {rank}: its file has no header line")
    if data.truncated_tail:
        notes.append(
            f"rank {rank}: the last line was cut short (the process was probably killed); "
            f"{data.step_count} complete steps kept"
        )
    if data.bad_lines:
        notes.append(f"rank {rank}: {data.bad_lines} unreadable lines skipped")
    for event in data.events:
        code = event.get(schema.CODE)
        message = event.get(schema.MESSAGE, "")
        if code == schema.EVENT_UNSUPPORTED:
            notes.append(f"rank {rank}: not traced: {message}; it trained natively")
        elif code == schema.EVENT_DISABLED:
            notes.append(
                f"rank {rank}: tracing turned itself off after {event.get('at_step', '?')} "
                f"steps: {message}"
            )
        elif code == schema.EVENT_MAX_STEPS:
            max_steps_message = message
        elif code in (schema.EVENT_VERSION, schema.EVENT_NOTE, schema.EVENT_BUCKET_TIMING_OFF) and (
            message
        ):
            notes.append(f"rank {rank}: {message}")
    footer = data.footer
    if data.header is not None and footer is None:
        notes.append(
            f"rank {rank}: no footer: the process ended without closing its file "
            "(killed, or still running)"
        )
    elif footer is not None:
        status = footer.get(schema.STATUS)
        error = footer.get(schema.ERROR)
        if status == schema.STATUS_EXCEPTION:
            notes.append(
                f"rank {rank}: training failed after {data.step_count} steps"
                + (f" ({error})" if error else "")
            )
        elif status == schema.STATUS_INTERRUPTED:
            notes.append(
                f"rank {rank}: training was interrupted after {data.step_count} steps"
                + (f" ({error})" if error else "")
            )
    return notes, max_steps_message


def _damage_notes(data: RankRecords) -> list[str]:
    """Notes on what clean_records replaced, and on a header that names another rank."""
    rank = data.rank
    notes = []
    if data.bad_values:
        notes.append(
            f"rank {rank}: {data.bad_values} step value{'s' if data.bad_values != 1 else ''} "
            "of the wrong type or out of range (not a number, negative, huge) treated as "
            "unmeasured"
        )
    if data.bad_header_fields:
        notes.append(
            f"rank {rank}: header field{'s' if len(data.bad_header_fields) != 1 else ''} "
            f"{', '.join(data.bad_header_fields)} of the wrong type or out of range; ignored"
        )
    claimed = (data.header or {}).get(schema.RANK)
    if claimed is not None and claimed != rank:
        notes.append(f"rank {rank}: its header says rank {claimed}; the file name's rank is used")
    return notes


def summarise_rank(path: Path, rank: int, warmup: int) -> dict[str, Any]:
    """Everything the run summary needs from one rank file (small and picklable: the rank's
    steps are dropped once reduced, so a worker process can do this too)."""
    return summarise_records(read_rank_file(path, rank), warmup)


def summarise_records(data: RankRecords, warmup: int) -> dict[str, Any]:
    """:func:`summarise_rank` for records already in memory (the live view's window)."""
    clean_records(data)
    notes, max_steps_message = rank_notes(data)
    entry, sketches = reduce_rank(data, warmup)
    return {
        "entry": entry,
        "sketches": sketches,
        "notes": notes,
        "max_steps_message": max_steps_message,
        "status": (data.footer or {}).get(schema.STATUS),
        "header": data.header,
        "job_series": job_series.rank_series(data.columns, entry[schema.SUMMARY_WARMUP]),
        "inputs": data.inputs,
    }


def _summarise_ranks(files: dict[int, Path], warmup: int, jobs: int) -> Iterator[dict[str, Any]]:
    if jobs <= 1 or len(files) <= 1:
        for rank, path in files.items():
            yield summarise_rank(path, rank, warmup)
        return
    from concurrent.futures import ProcessPoolExecutor

    # Each worker holds one rank's steps at a time: memory grows with jobs, not with ranks.
    with ProcessPoolExecutor(max_workers=min(jobs, len(files))) as pool:
        yield from pool.map(
            summarise_rank, list(files.values()), list(files), [warmup] * len(files)
        )


def _dedupe_rank_notes(notes: list[str], ranks: int) -> list[str]:
    """'rank 0: X', 'rank 1: X' ... -> 'all N ranks: X' when every rank says the same."""
    by_text: dict[str, list[str]] = {}
    order: list[str] = []
    for note in notes:
        prefix, sep, text = note.partition(": ")
        key = text if sep and prefix.startswith("rank ") else note
        if key not in by_text:
            order.append(key)
        by_text.setdefault(key, []).append(note)
    result = []
    for key in order:
        group = by_text[key]
        if ranks > 1 and len(group) == ranks and group[0] != key:
            result.append(f"all {ranks} ranks: {key}")
        else:
            result.extend(group)
    return result


# ----------------------------------------------------------------------------------------------
# The whole run


def reduce_run(
    run_dir: Path | str,
    *,
    thresholds: dict[str, float] | None = None,
    now: datetime | None = None,
    jobs: int = 1,
) -> dict[str, Any]:
    """Summarise a run directory. Raises :class:`ReduceError` only when nothing can be said.

    ``jobs`` > 1 reduces that many rank files at once in worker processes (faster on many
    cores; memory then holds up to ``jobs`` ranks' steps instead of one).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReduceError(f"{run_dir} is not a directory")
    files, skipped = scan_rank_files(run_dir)
    if not files:
        raise ReduceError(f"{run_dir} has no {schema.RANKS_DIR}/rank_*.jsonl files to report on")
    limits = resolve_thresholds(thresholds)
    warmup = int(limits["warmup_steps"])
    parts = _summarise_ranks(files, warmup, jobs)
    return _summary_from_parts(
        parts,
        list(files),
        limits,
        run_name=run_dir.name,
        run_dir=str(run_dir.resolve()),
        now=now,
        notes=skipped,
    )


def reduce_records(
    ranks: list[RankRecords],
    *,
    thresholds: dict[str, float] | None = None,
    run_name: str = "live",
    now: datetime | None = None,
) -> dict[str, Any]:
    """The summary of rank records already in memory, exactly as :func:`reduce_run` builds it
    from files (the live view reduces its recent window this way)."""
    limits = resolve_thresholds(thresholds)
    warmup = int(limits["warmup_steps"])
    ordered = sorted(ranks, key=lambda data: data.rank)
    parts = (summarise_records(data, warmup) for data in ordered)
    return _summary_from_parts(
        parts, [data.rank for data in ordered], limits, run_name=run_name, run_dir=None, now=now
    )


class _FieldTotals:
    """One field's statistics over every rank: sketches to merge, and the exact sum, count
    and extremes (so the mean, min and max are exact whatever the sketches drop)."""

    def __init__(self) -> None:
        self.sketches: list[stats.Sketch] = []
        self.total = 0.0
        self.count = 0
        self.low = math.inf
        self.high = -math.inf

    def add(self, sketch: stats.Sketch, described: dict[str, Any]) -> None:
        self.sketches.append(sketch)
        self.total += described["sum"]
        self.count += described["count"]
        self.low = min(self.low, described["min"])
        self.high = max(self.high, described["max"])

    @property
    def approximate(self) -> bool:
        return any(weight != 1.0 for _values, weight in self.sketches)

    def describe(self, ps: tuple[float, ...]) -> tuple[dict[str, Any], dict[float, float]]:
        """The overall statistics entry, and the merged quantiles at ``ps`` (with 0.5, 0.9)."""
        wanted = sorted({0.5, 0.9, *ps})
        at = dict(zip(wanted, stats.merged_quantiles(self.sketches, wanted), strict=True))
        described = {
            "count": self.count,
            "sum": self.total,
            "mean": self.total / self.count,
            "min": self.low,
            "median": at[0.5],
            "p90": at[0.9],
            "max": self.high,
        }
        return described, at


class _RunTotals:
    """What the rank parts add up to, fed one rank at a time (memory: one rank's part)."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.fields: dict[str, _FieldTotals] = {}
        self.notes: list[str] = []
        self.max_steps_message: str | None = None
        self.headers: dict[int, dict[str, Any]] = {}
        self.statuses: dict[int, str | None] = {}
        self.series = job_series.JobSeriesAccumulator()
        self.inputs: list[dict[str, Any]] = []

    def add(self, part: dict[str, Any]) -> None:
        entry = part["entry"]
        rank = entry[schema.RANK]
        self.entries.append(entry)
        self.notes.extend(part["notes"])
        self.max_steps_message = self.max_steps_message or part["max_steps_message"]
        self.statuses[rank] = part["status"]
        if part["header"] is not None:
            self.headers[rank] = part["header"]
        self.series.add(part.get("job_series"))
        self.inputs.extend(part.get("inputs") or [])
        for fieldname, sketch in part["sketches"].items():
            totals = self.fields.setdefault(fieldname, _FieldTotals())
            totals.add(sketch, entry[schema.PHASE_STATS][fieldname])

    @property
    def approximate(self) -> bool:
        return any(totals.approximate for totals in self.fields.values())

    def steps(self, key: str) -> int:
        return sum(e[key] for e in self.entries)


def _summary_from_parts(
    parts: Iterator[dict[str, Any]],
    found: list[int],
    limits: dict[str, float],
    *,
    run_name: str,
    run_dir: str | None,
    now: datetime | None,
    notes: list[str] | None = None,
) -> dict[str, Any]:
    totals = _RunTotals()
    totals.notes.extend(notes or [])
    for part in parts:
        totals.add(part)
    world_size = _world_size(totals.headers, found)
    missing = _missing_ranks(world_size, found)
    if missing:
        totals.notes.append(_missing_ranks_note(missing, totals.headers))
    if totals.max_steps_message:
        totals.notes.append(totals.max_steps_message)
    skipped = max((e[schema.SUMMARY_WARMUP] for e in totals.entries), default=0)
    _add_warmup_note(totals, skipped, int(limits["warmup_steps"]))
    overall = _overall(totals)
    setup = _setup(totals.headers, world_size)
    overall[schema.SAMPLES_PER_S] = _samples_per_s(overall, setup, world_size)
    steps_recorded = totals.steps(schema.SUMMARY_STEPS_RECORDED)
    return {
        schema.SCHEMA: schema.SUMMARY_SCHEMA,
        schema.RUN: _run_name(totals.headers, run_name),
        schema.SUMMARY_RUN_DIR: run_dir,
        schema.SUMMARY_GENERATED_AT: (now or datetime.now(timezone.utc)).isoformat(
            timespec="seconds"
        ),
        schema.SUMMARY_STATUS: _run_status(
            totals.statuses, missing, steps_recorded, totals.headers, found
        ),
        schema.WORLD_SIZE: world_size,
        schema.SUMMARY_RANKS_EXPECTED: list(range(world_size)),
        schema.SUMMARY_RANKS_FOUND: list(found),
        schema.SUMMARY_RANKS_MISSING: missing,
        schema.SUMMARY_SETUP: setup,
        schema.SUMMARY_WARMUP: skipped,
        schema.SUMMARY_STEPS_RECORDED: steps_recorded,
        schema.SUMMARY_STEPS_ANALYSED: totals.steps(schema.SUMMARY_STEPS_ANALYSED),
        schema.SUMMARY_APPROXIMATE: totals.approximate,
        schema.SUMMARY_OVERALL: overall,
        schema.SUMMARY_RANKS: totals.entries,
        schema.SUMMARY_IMBALANCE: _imbalance_with_memory(totals.entries),
        schema.SUMMARY_THRESHOLDS: limits,
        schema.SUMMARY_NOTES: _dedupe_rank_notes(totals.notes, len(totals.entries)),
        schema.SUMMARY_JOB_SERIES: totals.series.result(),
        schema.SUMMARY_INPUT_PIPELINE: input_pipeline.summarise(totals.inputs),
    }


def _world_size(headers: dict[int, dict[str, Any]], found: list[int]) -> int:
    """The largest world size a (checked) header claims, or the highest rank file + 1."""
    claimed = max((h.get(schema.WORLD_SIZE) or 1 for h in headers.values()), default=1)
    return max(claimed, max(found) + 1) if found else claimed


def _missing_ranks(world_size: int, found: list[int]) -> list[int]:
    present = set(found)
    return [rank for rank in range(world_size) if rank not in present]


def _add_warmup_note(totals: _RunTotals, skipped: int, warmup: int) -> None:
    recorded = totals.steps(schema.SUMMARY_STEPS_RECORDED)
    analysed = totals.steps(schema.SUMMARY_STEPS_ANALYSED)
    if skipped:
        totals.notes.insert(
            0,
            f"skipped the first {skipped} step{'s' if skipped != 1 else ''} of each rank as "
            "warm-up (DataLoader start-up, lazy initialisation, allocator growth); "
            f"{analysed} of {recorded} steps analysed",
        )
    elif recorded and recorded <= warmup * len(totals.entries):
        totals.notes.insert(0, "too few steps to skip a warm-up: every recorded step is analysed")


def _samples_per_s(overall: dict[str, Any], setup: dict[str, Any], world_size: int) -> float | None:
    batch = setup.get(schema.BATCH_SIZE)
    accumulate = setup.get(schema.ACCUMULATE_GRAD_BATCHES) or 1
    if not overall.get(schema.STEPS_PER_S) or not isinstance(batch, int):
        return None
    return overall[schema.STEPS_PER_S] * batch * accumulate * world_size


def _overall(totals: _RunTotals) -> dict[str, Any]:
    phase_stats: dict[str, Any] = {}
    distributions: dict[str, list[float]] = {}
    ps = tuple(stats.distribution_ps())
    for fieldname in _STAT_FIELDS:
        field_totals = totals.fields.get(fieldname)
        if field_totals is None or not field_totals.sketches:
            phase_stats[fieldname] = None
            continue
        wanted = fieldname in _DISTRIBUTED_FIELDS
        phase_stats[fieldname], at = field_totals.describe(ps if wanted else ())
        if wanted:
            distributions[fieldname] = [round(at[p], 6) for p in ps]
    step_stats = phase_stats.get(schema.STEP)
    entries = totals.entries
    sums = {name: field_totals.total for name, field_totals in totals.fields.items()}
    return {
        schema.PHASE_STATS: phase_stats,
        schema.SHARES: shares_from_sums(sums),
        schema.STEPS_PER_S: (
            1000.0 / step_stats["mean"] if step_stats and step_stats["mean"] > 0 else None
        ),
        schema.PEAK_ALLOCATED: _max_or_none([e[schema.PEAK_ALLOCATED] for e in entries]),
        schema.PEAK_RESERVED: _max_or_none([e[schema.PEAK_RESERVED] for e in entries]),
        schema.PEAK_RSS: _max_or_none([e[schema.PEAK_RSS] for e in entries]),
        schema.BETWEEN_STEPS_MS: _max_or_none([e[schema.BETWEEN_STEPS_MS] for e in entries]),
        schema.AFTER_LAST_STEP_MS: _max_or_none([e[schema.AFTER_LAST_STEP_MS] for e in entries]),
        schema.WALL_MS: _max_or_none([e[schema.WALL_MS] for e in entries]),
        schema.DISTRIBUTIONS: distributions,
    }


def _imbalance(rank_entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    with_data = [e for e in rank_entries if (e[schema.PHASE_STATS].get(schema.STEP) or {})]
    if len(with_data) < 2:
        return None
    fields: dict[str, Any] = {}
    for fieldname in _RANK_COMPARED:
        medians = {
            e[schema.RANK]: e[schema.PHASE_STATS][fieldname]["median"]
            for e in with_data
            if e[schema.PHASE_STATS].get(fieldname)
        }
        if len(medians) < 2:
            continue
        middle = stats.quantile_sorted(sorted(medians.values()), 0.5)
        slowest = max(medians, key=lambda rank: medians[rank])
        # The slowest rank against the typical one of the *others* (with two ranks: the other).
        others = stats.quantile_sorted(
            sorted(v for rank, v in medians.items() if rank != slowest), 0.5
        )
        fields[fieldname] = {
            "max_over_median": medians[slowest] / middle if middle > 0 else None,
            "max_over_others": medians[slowest] / others if others > 0 else None,
            "slowest_rank": slowest,
            "median_across_ranks_ms": middle,
            "median_of_others_ms": others,
            "rank_medians_ms": {str(rank): value for rank, value in medians.items()},
        }
    own = fields.get(schema.GPU_OWN_MS) or fields.get(schema.OWN_MS) or fields.get(schema.STEP)
    return {
        schema.IMBALANCE_FIELDS: fields,
        schema.SLOWEST_RANK: own["slowest_rank"] if own else None,
    }


def _imbalance_with_memory(rank_entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """:func:`_imbalance`, plus which rank holds the most memory (telemetry, issue 15)."""
    imbalance = _imbalance(rank_entries)
    memory = resources.memory_imbalance(rank_entries)
    if imbalance is not None or memory is not None:
        imbalance = dict(imbalance or {})
        imbalance[schema.MEMORY_IMBALANCE] = memory
    return imbalance


def _setup(headers: dict[int, dict[str, Any]], world_size: int) -> dict[str, Any]:
    """What the run was: device, versions, script... taken from the lowest rank's header."""
    if not headers:
        return {schema.WORLD_SIZE: world_size}
    first = headers[min(headers)]
    device = first.get(schema.DEVICE) or {}
    hosts = sorted({h.get(schema.HOST) for h in headers.values() if h.get(schema.HOST)})
    nodes = sorted(
        {h.get(schema.NODE_RANK) for h in headers.values() if h.get(schema.NODE_RANK) is not None}
    )
    return {
        schema.WORLD_SIZE: world_size,
        "device": device.get(schema.DEVICE_TYPE),
        "device_name": device.get(schema.DEVICE_NAME),
        schema.DEVICE_TOTAL_MEMORY: device.get(schema.DEVICE_TOTAL_MEMORY),
        schema.TIMING: first.get(schema.TIMING),
        schema.COMM_TIMING: first.get(schema.COMM_TIMING),
        schema.BUCKET_TIMING: first.get(schema.BUCKET_TIMING),
        schema.VERSIONS: first.get(schema.VERSIONS) or {},
        schema.SCRIPT: first.get(schema.SCRIPT),
        schema.INTEGRATION: first.get(schema.INTEGRATION),
        schema.BATCH_SIZE: first.get(schema.BATCH_SIZE),
        schema.ACCUMULATE_GRAD_BATCHES: first.get(schema.ACCUMULATE_GRAD_BATCHES),
        "num_workers": first.get("num_workers"),
        "trace_max_steps": (first.get(schema.SETTINGS) or {}).get("trace_max_steps"),
        "hosts": hosts,
        "nodes": nodes,
        schema.LOCAL_WORLD_SIZE: first.get(schema.LOCAL_WORLD_SIZE),
    }


def _rank_ranges(ranks: list[int], most: int = 20) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8" (the first ``most`` runs, then how many more)."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:most])
    return text + (f" and {len(runs) - most} more ranges" if len(runs) > most else "")


def _missing_ranks_note(missing: list[int], headers: dict[int, dict[str, Any]]) -> str:
    ranks = _rank_ranges(missing)
    per_node = None
    for header in headers.values():
        if (
            isinstance(header.get(schema.LOCAL_WORLD_SIZE), int)
            and header[schema.LOCAL_WORLD_SIZE] > 0
        ):
            per_node = header[schema.LOCAL_WORLD_SIZE]
            break
    text = f"rank{'s' if len(missing) > 1 else ''} {ranks} missing: no rank file"
    if per_node and len(missing) <= 4096:  # beyond that, a node list says nothing useful
        nodes = sorted({r // per_node for r in missing})
        seen_nodes = {h.get(schema.NODE_RANK) for h in headers.values()}
        absent = [n for n in nodes if n not in seen_nodes]
        if absent:
            text += (
                f" (node{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} wrote "
                "nothing here: is the logs dir on a filesystem all nodes share?)"
            )
        else:
            text += f" (node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))})"
    return text


def _run_name(headers: dict[int, dict[str, Any]], fallback: str) -> str:
    for header in headers.values():
        if header.get(schema.RUN):
            return str(header[schema.RUN])
    return fallback


def _run_status(
    statuses: dict[int, str | None],
    missing: list[int],
    steps: int,
    headers: dict[int, dict[str, Any]],
    found: list[int],
) -> str:
    values = list(statuses.values())
    if schema.STATUS_EXCEPTION in values:
        return "failed"
    if schema.STATUS_INTERRUPTED in values:
        return "interrupted"
    if values and all(v == schema.STATUS_UNSUPPORTED for v in values):
        return "unsupported"
    if steps == 0:
        return "empty"
    if missing or None in values or len(headers) < len(found):
        return "partial"
    return "completed"
