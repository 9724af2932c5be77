"""Run reduction: the ranks' parts -> the run summary dict (before diagnosis).

:func:`reduce_run` is the pipeline up to here for a run directory: list the rank files, reduce
each rank (:mod:`reduce_rank`, in worker processes with ``jobs``), then add the parts up one
rank at a time (memory: one rank's part).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from traceml import schema
from traceml.analysis import input_pipeline, job_series, stats
from traceml.analysis.imbalance import imbalance_with_memory
from traceml.analysis.node_series import node_of
from traceml.analysis.node_sketches import NodeSketches, all_field_quantiles, exactness
from traceml.analysis.notes import (
    dedupe_rank_notes,
    missing_ranks_note,
    mixed_runs_note,
    warmup_note,
)
from traceml.analysis.partials import LoadedPartials, load_partials, missing_partials_note
from traceml.analysis.rankfile import RankRecords, run_rank_files
from traceml.analysis.reduce_rank import (
    STAT_FIELDS,
    add_share_sums,
    max_or_none,
    shares_from_sums,
    summarise_ranks,
    summarise_records,
)
from traceml.errors import ReduceError
from traceml.files import text_path
from traceml.thresholds import resolve_thresholds

# Fields whose whole distribution goes into the summary (what compare needs).
_DISTRIBUTED_FIELDS = frozenset(
    (*schema.TIMED_FIELDS, *schema.GPU_FIELDS, schema.COMM, schema.GPU_COMM)
)


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
    files, skipped = run_rank_files(run_dir)
    limits = resolve_thresholds(thresholds)
    warmup = int(limits["warmup_steps"])
    # Per-node partials stand in for their nodes' rank files; the rest are read here. Parts
    # are added up in rank order either way, so the sums are the same numbers in the same order.
    loaded = load_partials(run_dir, files, warmup)
    rest = {rank: path for rank, path in files.items() if rank not in loaded.covered}
    parts = heapq.merge(
        sorted(loaded.parts, key=_part_rank), summarise_ranks(rest, warmup, jobs), key=_part_rank
    )
    return _summary_from_parts(
        parts,
        list(files),
        limits,
        run_name=text_path(run_dir.name),
        run_dir=text_path(run_dir.resolve()),
        now=now,
        notes=skipped + loaded.notes,
        partials=loaded,
        jobs=jobs,
    )


def _part_rank(part: dict[str, Any]) -> int:
    return part["entry"][schema.RANK]


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
    """One field's exact sum, count and extremes over every rank (so the mean, min and max
    are exact whatever the sketches drop); the quantiles come from the nodes' sketches."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self.low = math.inf
        self.high = -math.inf

    def add(self, described: dict[str, Any]) -> None:
        self.total += described["sum"]
        self.count += described["count"]
        self.low = min(self.low, described["min"])
        self.high = max(self.high, described["max"])

    def describe(self, at: dict[float, float]) -> dict[str, Any]:
        """The overall statistics entry, given the run's quantiles (with 0.5 and 0.9)."""
        return {
            "count": self.count,
            "sum": self.total,
            "mean": self.total / self.count,
            "min": self.low,
            "median": at[0.5],
            "p90": at[0.9],
            "max": self.high,
        }


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
        self.read_nodes: set[int] = set()
        self.sketches: dict[int, NodeSketches] = {}
        self.share_sums: dict[str, list[float]] = {}
        self.bad_schema: tuple[str, str] | None = None  # (path, schema) of a foreign header
        self.approximate = False  # set with the run's quantiles (see _overall)
        self.jobs = 1

    def add(self, part: dict[str, Any]) -> None:
        entry = part["entry"]
        rank = entry[schema.RANK]
        self.entries.append(entry)
        self.notes.extend(part["notes"])
        self.max_steps_message = self.max_steps_message or part["max_steps_message"]
        self.statuses[rank] = part["status"]
        if part["header"] is not None:
            self.headers[rank] = part["header"]
        if "job_series" in part:  # read from its rank file here, not from a node's partial
            self.read_nodes.add(node_of(part["header"]))
            self.series.add(part["job_series"], node_of(part["header"]))
        self.inputs.extend(part.get("inputs") or [])
        self.bad_schema = self.bad_schema or part.get("bad_schema")
        add_share_sums(self.share_sums, part["share_sums"])
        node = node_of(part["header"])
        for fieldname, described in entry[schema.PHASE_STATS].items():
            if described is None:
                continue
            self.fields.setdefault(fieldname, _FieldTotals()).add(described)
            sketch = part["sketches"].get(fieldname)
            if sketch is not None:  # (a node's partial brings its node's sketches instead)
                self.sketches.setdefault(node, NodeSketches()).add(fieldname, sketch)

    def refuse_if_foreign(self) -> None:
        """No file of the run has a traceml header and one has another schema: not a run."""
        if self.bad_schema and not self.headers:
            path, value = self.bad_schema
            raise ReduceError(f"{path} is not a traceml rank file (schema {value})")

    def steps(self, key: str) -> int:
        return sum(e[key] for e in self.entries)


def _totals_of(
    parts: Iterable[dict[str, Any]],
    notes: list[str] | None,
    partials: LoadedPartials | None,
    jobs: int,
) -> _RunTotals:
    totals = _RunTotals()
    totals.jobs = jobs
    totals.notes.extend(notes or [])
    for node, series in (partials.series if partials else {}).items():
        totals.series.add_node(node, series)
    totals.sketches.update(partials.sketches if partials else {})
    for part in parts:
        totals.add(part)
    totals.refuse_if_foreign()
    if partials is not None:
        note = missing_partials_note(partials, totals.read_nodes)
        if note:
            totals.notes.append(note)
    return totals


def _summary_from_parts(
    parts: Iterable[dict[str, Any]],
    found: list[int],
    limits: dict[str, float],
    *,
    run_name: str,
    run_dir: str | None,
    now: datetime | None,
    notes: list[str] | None = None,
    partials: LoadedPartials | None = None,
    jobs: int = 1,
) -> dict[str, Any]:
    totals = _totals_of(parts, notes, partials, jobs)
    world_size = _world_size(totals.headers, found)
    missing = _missing_ranks(world_size, found)
    skipped = max((e[schema.SUMMARY_WARMUP] for e in totals.entries), default=0)
    _add_run_notes(totals, missing, int(limits["warmup_steps"]))
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
        schema.SUMMARY_EXACTNESS: exactness(totals.approximate),
        schema.SUMMARY_OVERALL: overall,
        schema.SUMMARY_RANKS: totals.entries,
        schema.SUMMARY_IMBALANCE: imbalance_with_memory(totals.entries),
        schema.SUMMARY_THRESHOLDS: limits,
        schema.SUMMARY_NOTES: dedupe_rank_notes(totals.notes, len(totals.entries)),
        schema.SUMMARY_JOB_SERIES: totals.series.result(),
        schema.SUMMARY_INPUT_PIPELINE: input_pipeline.summarise(totals.inputs),
    }


def _add_run_notes(totals: _RunTotals, missing: list[int], warmup: int) -> None:
    """The run-level notes: missing ranks, the trace-max-steps message, then (first) warm-up."""
    mixed = mixed_runs_note(totals.headers)
    if mixed:
        totals.notes.append(mixed)
    if missing:
        totals.notes.append(missing_ranks_note(missing, totals.headers))
    if totals.max_steps_message:
        totals.notes.append(totals.max_steps_message)
    note = warmup_note(
        totals.steps(schema.SUMMARY_STEPS_RECORDED),
        totals.steps(schema.SUMMARY_STEPS_ANALYSED),
        {entry[schema.RANK]: entry[schema.SUMMARY_WARMUP] for entry in totals.entries},
        warmup,
    )
    if note:
        totals.notes.insert(0, note)


def _world_size(headers: dict[int, dict[str, Any]], found: list[int]) -> int:
    """The largest world size a (checked) header claims, or the highest rank file + 1."""
    claimed = max((h.get(schema.WORLD_SIZE) or 1 for h in headers.values()), default=1)
    return max(claimed, max(found) + 1) if found else claimed


def _missing_ranks(world_size: int, found: list[int]) -> list[int]:
    present = set(found)
    return [rank for rank in range(world_size) if rank not in present]


def _samples_per_s(overall: dict[str, Any], setup: dict[str, Any], world_size: int) -> float | None:
    batch = setup.get(schema.BATCH_SIZE)
    if not overall.get(schema.STEPS_PER_S) or not isinstance(batch, int):
        return None
    # Each step's microbatches where counted (GradientAccumulationScheduler changes them).
    counted = ((overall.get(schema.PHASE_STATS) or {}).get(schema.MICROBATCHES) or {}).get("mean")
    accumulate = counted or setup.get(schema.ACCUMULATE_GRAD_BATCHES) or 1
    return overall[schema.STEPS_PER_S] * batch * accumulate * world_size


def _overall(totals: _RunTotals) -> dict[str, Any]:
    phase_stats: dict[str, Any] = {}
    distributions: dict[str, list[float]] = {}
    ps = tuple(stats.distribution_ps())
    wanted = {
        name: sorted({0.5, 0.9, *(ps if name in _DISTRIBUTED_FIELDS else ())})
        for name in STAT_FIELDS
        if name in totals.fields and any(g.fields.get(name) for g in totals.sketches.values())
    }
    quantiles = all_field_quantiles(totals.sketches, wanted, totals.jobs)
    totals.approximate = any(approximate for _at, approximate in quantiles.values())
    for fieldname in STAT_FIELDS:
        if fieldname not in quantiles:
            phase_stats[fieldname] = None
            continue
        at = dict(zip(wanted[fieldname], quantiles[fieldname][0], strict=True))
        phase_stats[fieldname] = totals.fields[fieldname].describe(at)
        if fieldname in _DISTRIBUTED_FIELDS:
            distributions[fieldname] = [round(at[p], 6) for p in ps]
    step_stats = phase_stats.get(schema.STEP)
    entries = totals.entries
    return {
        schema.PHASE_STATS: phase_stats,
        schema.SHARES: shares_from_sums(totals.share_sums),
        schema.STEPS_PER_S: (
            1000.0 / step_stats["mean"] if step_stats and step_stats["mean"] > 0 else None
        ),
        schema.PEAK_ALLOCATED: max_or_none([e[schema.PEAK_ALLOCATED] for e in entries]),
        schema.PEAK_RESERVED: max_or_none([e[schema.PEAK_RESERVED] for e in entries]),
        schema.PEAK_RSS: max_or_none([e[schema.PEAK_RSS] for e in entries]),
        schema.BETWEEN_STEPS_MS: max_or_none([e[schema.BETWEEN_STEPS_MS] for e in entries]),
        schema.AFTER_LAST_STEP_MS: max_or_none([e[schema.AFTER_LAST_STEP_MS] for e in entries]),
        schema.WALL_MS: max_or_none([e[schema.WALL_MS] for e in entries]),
        schema.DISTRIBUTIONS: distributions,
    }


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
