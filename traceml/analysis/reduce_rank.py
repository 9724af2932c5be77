"""Per-rank reduction: one rank's cleaned records -> its summary entry, quantile sketches,
notes and job-series share (a small picklable "part": a worker process can make it).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from traceml import schema
from traceml.analysis import job_series, resources, stats, unstepped, workers
from traceml.analysis.clean import clean_records, is_number
from traceml.analysis.notes import rank_notes
from traceml.analysis.rankfile import RankRecords, read_rank_file

TIMELINE_BINS = 200

# Derived per step from the columns above (see _derive_own).
OWN_FIELDS: tuple[str, ...] = (
    schema.OWN_MS,
    *schema.OWN_OF_PHASE.values(),
    schema.GPU_OWN_MS,
    *schema.GPU_OWN_OF_PHASE.values(),
)
STAT_FIELDS: tuple[str, ...] = (
    *schema.TIMED_FIELDS,
    *schema.GPU_FIELDS,
    *schema.COMM_FIELDS,
    *schema.GPU_COMM_FIELDS,
    *OWN_FIELDS,
    schema.TRACEML_COST_US,
    schema.MICROBATCHES,  # the input advice's batches per step (gradient accumulation)
)


def _minus(values: list[Any], waits: list[Any]) -> list[float | None]:
    """Per step ``value - wait``; null where either is unmeasured."""
    if None not in values and None not in waits:
        return list(map(operator.sub, values, waits))
    if values.count(None) == len(values) or waits.count(None) == len(waits):
        return [None] * len(values)
    return [
        None if value is None or wait is None else value - wait
        for value, wait in zip(values, waits, strict=True)
    ]


def _unmeasured_bucket_waits(columns: dict[str, list[Any]]) -> None:
    """DDP's gradient buckets went untimed (a hook of the user's held their slot): the wait in
    Backward, and so each step's total wait, are unknown, not the 0 written for them. Own
    time is then the step minus Backward, as where no wait is timed (a review: rank 0's wait
    on a slow rank read as its own Backward, and the straggler as Residual)."""
    for fieldname in (
        schema.COMM,
        schema.COMM_OF_PHASE[schema.BACKWARD],
        schema.GPU_COMM,
        schema.GPU_COMM_OF_PHASE[schema.BACKWARD],
    ):
        columns[fieldname] = [None] * len(columns[fieldname])


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
        columns[schema.OWN_MS] = _minus(steps, columns[schema.BACKWARD])
    for phase, own in schema.OWN_OF_PHASE.items():
        columns[own] = _minus(columns[phase], columns[schema.COMM_OF_PHASE[phase]])
    _derive_gpu_own(columns)


def _derive_gpu_own(columns: dict[str, list[Any]]) -> None:
    device_own = _minus(columns[schema.GPU_STEP], columns[schema.GPU_COMM])
    inputs = columns[schema.INPUT_WAIT]
    if all(wait is None for wait in inputs):
        inputs = [0.0] * len(inputs)  # no fetch seen at all (batches from a list): device only
    # Device time plus Input Wait: a step whose wait went unmeasured has no known sum (a rank
    # with unseen fetches would look faster than the others).
    columns[schema.GPU_OWN_MS] = [
        None if own is None or wait is None else own + wait
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
    if None not in values:
        return values
    return [v for v in values if v is not None]


def max_or_none(values: list[Any]) -> int | float | None:
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


def reduce_rank(
    data: RankRecords, warmup: int
) -> tuple[dict[str, Any], dict[str, stats.Sketch], dict[str, list[float]]]:
    """One rank's summary entry, and the sketches and share sums its analysed steps add to the
    overall view."""
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
    for fieldname in STAT_FIELDS:
        values = sorted(_present(columns[fieldname][skipped:]))
        if not values:
            phase_stats[fieldname] = None
            continue
        phase_stats[fieldname] = stats.describe_sorted(values)
        sketches[fieldname] = stats.sketch_sorted(values)
    entry[schema.PHASE_STATS] = phase_stats
    sums = share_sums(columns, skipped)
    entry[schema.SHARES] = shares_from_sums(sums)
    step_stats = phase_stats.get(schema.STEP)
    entry[schema.STEPS_PER_S] = (
        1000.0 / step_stats["mean"] if step_stats and step_stats["mean"] > 0 else None
    )
    entry[schema.PEAK_ALLOCATED] = max_or_none(columns[schema.MEM_PEAK_ALLOCATED])
    entry[schema.PEAK_RESERVED] = max_or_none(columns[schema.MEM_PEAK_RESERVED])
    entry[schema.PEAK_RSS] = _peak_rss(columns[schema.RSS], footer.get(schema.RSS_HWM))
    gaps = _present(columns[schema.GAP_MS])
    # One step has no gap, so 0; several steps whose gaps all went unmeasured, unknown.
    entry[schema.BETWEEN_STEPS_MS] = math.fsum(gaps) if gaps else (0.0 if count == 1 else None)
    entry[schema.WALL_MS], last_end = _step_span(columns)
    entry[schema.AFTER_LAST_STEP_MS] = _after_last_step(header, footer, last_end)
    entry[schema.TIMELINE] = _timeline(columns, skipped)
    entry[schema.TELEMETRY] = resources.rank_telemetry(columns, data.samples, data.header, skipped)
    return entry, sketches, sums


def _peak_rss(at_step_ends: list[Any], high_water_mark: Any) -> float | None:
    """The process's peak RSS: the kernel's high-water mark where the footer has it (memory a
    step allocates and frees, as activations, between two step-end readings), never below
    those readings."""
    peak = max_or_none(at_step_ends)
    if is_number(high_water_mark) and high_water_mark > 0:
        return high_water_mark if peak is None else max(peak, high_water_mark)
    return peak


def _step_span(columns: dict[str, list[Any]]) -> tuple[float | None, float | None]:
    """First step start to last step end (ms), and that end on the rank's clock."""
    starts = columns[schema.T_START_MS]
    if not starts or starts[0] is None or starts[-1] is None:
        return None, None
    end = starts[-1] + (columns[schema.STEP][-1] or 0.0)
    first = starts[0]
    if None not in starts and not first <= starts[-1] == max(starts):
        # Records out of order (the reducer notes it): the span is still earliest to latest.
        first = min(starts)
        end = max(s + (t or 0.0) for s, t in zip(starts, columns[schema.STEP], strict=True))
    return max(0.0, end - first), end


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


# Each share's numerator field and the field it divides by.
SHARE_OF: dict[str, str] = {
    **{phase: schema.STEP for phase in schema.PHASES},
    schema.COMM: schema.STEP,
    **{own: schema.STEP for own in schema.OWN_OF_PHASE.values()},
    schema.GPU_COMM: schema.GPU_STEP,
    **{name: schema.GPU_STEP for name in schema.GPU_FIELDS if name != schema.GPU_STEP},
    **{own: schema.GPU_STEP for own in schema.GPU_OWN_OF_PHASE.values()},
}
_SHARE_KEY = {schema.COMM: schema.COMM_SHARE, schema.GPU_COMM: schema.GPU_COMM_SHARE}


def _paired_sums(values: list[Any], totals: list[Any]) -> list[float] | None:
    """``[sum of values, sum of totals]`` over the steps where both are measured: a share of
    the step is then a share of the same steps (a step whose time is unknown cannot be the
    denominator of a phase measured in it). None when no step has both."""
    pairs = [(v, t) for v, t in zip(values, totals, strict=True) if v is not None and t is not None]
    if not pairs:
        return None
    return [math.fsum(v for v, _ in pairs), math.fsum(t for _, t in pairs)]


def share_sums(columns: dict[str, list[Any]], skipped: int) -> dict[str, list[float]]:
    """The analysed steps' paired sums of every share (see :func:`_paired_sums`). Each
    denominator column is sliced and, when complete, summed once for all its shares."""
    totals = {name: columns[name][skipped:] for name in set(SHARE_OF.values())}
    whole = {name: math.fsum(column) for name, column in totals.items() if None not in column}
    sums: dict[str, list[float]] = {}
    for fieldname, total in SHARE_OF.items():
        values = columns[fieldname][skipped:]
        if not values:
            continue
        if total in whole and None not in values:  # the usual case: every step measured
            sums[fieldname] = [math.fsum(values), whole[total]]
            continue
        paired = _paired_sums(values, totals[total])
        if paired is not None:
            sums[fieldname] = paired
    return sums


def add_share_sums(into: dict[str, list[float]], sums: dict[str, Any]) -> None:
    """``sums`` (one rank's :func:`share_sums`) added into ``into`` (the run's)."""
    for fieldname, (value, total) in sums.items():
        known = into.setdefault(fieldname, [0.0, 0.0])
        known[0] += value
        known[1] += total


def shares_from_sums(sums: dict[str, Any]) -> dict[str, float | None]:
    """Every share from :func:`share_sums`; null where nothing was measured or the
    denominator is zero."""
    shares: dict[str, float | None] = {}
    for fieldname in SHARE_OF:
        paired = sums.get(fieldname)
        key = _SHARE_KEY.get(fieldname, fieldname)
        shares[key] = paired[0] / paired[1] if paired is not None and paired[1] else None
    return shares


def summarise_rank(path: Path, rank: int, warmup: int) -> dict[str, Any]:
    """Everything the run summary needs from one rank file (small and picklable: the rank's
    steps are dropped once reduced, so a worker process can do this too)."""
    return summarise_records(read_rank_file(path, rank), warmup)


def summarise_records(data: RankRecords, warmup: int) -> dict[str, Any]:
    """:func:`summarise_rank` for records already in memory (the live view's window)."""
    unstepped.set_aside(data)
    clean_records(data)
    if (data.header or {}).get(schema.BUCKET_TIMING) == "off":
        _unmeasured_bucket_waits(data.columns)  # for the job series (compare) too
    notes, max_steps_message = rank_notes(data)
    entry, sketches, sums = reduce_rank(data, warmup)
    return {
        "entry": entry,
        "sketches": sketches,
        "share_sums": sums,
        "bad_schema": None if data.bad_schema is None else (str(data.path), data.bad_schema),
        "notes": notes,
        "max_steps_message": max_steps_message,
        "status": (data.footer or {}).get(schema.STATUS),
        "header": data.header,
        "job_series": job_series.rank_series(data.columns, entry[schema.SUMMARY_WARMUP]),
        "inputs": data.inputs,
    }


def summarise_ranks(files: dict[int, Path], warmup: int, jobs: int) -> Iterator[dict[str, Any]]:
    if jobs <= 1 or len(files) <= 1:
        for rank, path in files.items():
            yield summarise_rank(path, rank, warmup)
        return
    # Each worker holds one rank's steps at a time: memory grows with jobs, not with ranks.
    yield from workers.pool_map(
        min(jobs, len(files)),
        summarise_rank,
        list(files.values()),
        list(files),
        [warmup] * len(files),
    )
