"""The live view's model (pure: the followed rank files in, numbers out): steps, steps/s,
median step, phase shares, slowest rank, and a *provisional* verdict from
:func:`traceml.analysis.diagnose.diagnose` on the window's summary."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from traceml import schema
from traceml.analysis.clean import is_number, is_world_size
from traceml.analysis.diagnose import diagnose
from traceml.analysis.reduce import RankRecords, reduce_records
from traceml.present.live_follow import RankTail
from traceml.present.live_settings import DEFAULT_COLLECT_S
from traceml.thresholds import resolve_thresholds

WAITING = "waiting"
COLLECTING = "collecting"
PROVISIONAL = "provisional"
FINAL = "final"


@dataclass(frozen=True)
class LiveView:
    """Everything the live view shows at one moment."""

    run: str
    state: str  # WAITING, COLLECTING, PROVISIONAL or FINAL
    world_size: int | None
    rank_steps: dict[int, int]
    missing_ranks: list[int]
    closed_ranks: list[int]
    dead_ranks: list[int]
    window_steps: int  # steady steps per rank the numbers below come from (the smallest rank)
    training_s: float | None  # first step start to latest step end, the longest rank
    steps_per_s: float | None
    median_step_ms: float | None
    shares: dict[str, float | None]
    slowest_rank: int | None
    slowest_ratio: float | None  # its own time over the other ranks' median
    verdict_kind: str | None
    verdict_why: str | None
    collecting: str | None  # what the provisional verdict still waits for


def window_summary(
    tails: Mapping[int, RankTail], thresholds: dict[str, float] | None = None
) -> dict[str, Any]:
    """The summary of each rank's recent steady steps, as :func:`reduce.reduce_run` builds one.

    The window already leaves each rank's warm-up steps out, so the reducer skips none.
    """
    limits = resolve_thresholds(thresholds)
    warmup = int(limits["warmup_steps"])
    ranks = []
    for rank, tail in sorted(tails.items()):
        data = RankRecords(rank=rank, path=tail.path, header=tail.header)
        steady = _steady(tail, warmup)
        for name, column in data.columns.items():
            column.extend(record.get(name) for record in steady)
        ranks.append(data)
    return reduce_records(ranks, thresholds={**limits, "warmup_steps": 0}, run_name="live")


def _steady(tail: RankTail, warmup: int) -> list[dict[str, Any]]:
    return [
        record
        for record in tail.recent
        if not isinstance(record.get(schema.STEP_INDEX), int) or record[schema.STEP_INDEX] >= warmup
    ]


def _window_rate(tail: RankTail, warmup: int) -> float | None:
    """Steps per second over the window, validation and other pauses between steps included."""
    steady = _steady(tail, warmup)
    if len(steady) < 2:
        return None
    first, last = steady[0].get(schema.T_START_MS), steady[-1].get(schema.T_START_MS)
    length = steady[-1].get(schema.STEP)
    if not is_number(first) or not is_number(last):
        return None
    span_ms = last + (float(length) if is_number(length) and length >= 0 else 0.0) - first
    return len(steady) * 1000.0 / span_ms if span_ms > 0 else None


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def build_view(
    tails: Mapping[int, RankTail],
    *,
    run: str,
    world_size: int | None = None,
    thresholds: dict[str, float] | None = None,
    collect_s: float = DEFAULT_COLLECT_S,
    final_summary: dict[str, Any] | None = None,
) -> LiveView:
    """What to show for ``tails``: numbers from the window's summary, and a provisional verdict
    once every rank has warm-up + ``min_steps`` steps and the run has trained ``collect_s``.

    With ``final_summary`` (the whole run, verdicts included) the view shows that instead.
    """
    limits = resolve_thresholds(thresholds)
    common = _common_view_fields(tails, run, world_size)
    if not any(common["rank_steps"].values()):
        return _empty_view(common, final_summary, files=bool(tails))
    if final_summary is not None:
        summary = final_summary
        verdicts = summary.get(schema.SUMMARY_VERDICTS) or diagnose(summary)
        steps_per_s = (summary.get(schema.SUMMARY_OVERALL) or {}).get(schema.STEPS_PER_S)
        return _numbers_view(common, summary, verdicts, FINAL, None, steps_per_s)
    summary = window_summary(tails, limits)
    expected = range(common["world_size"] or 0)
    waits = _still_collecting(tails, expected, common["training_s"], collect_s, limits)
    verdicts = [] if waits else diagnose(summary)
    warmup = int(limits["warmup_steps"])
    steps_per_s = _median(
        [r for r in (_window_rate(t, warmup) for t in tails.values()) if r is not None]
    )
    state = COLLECTING if waits else PROVISIONAL
    return _numbers_view(common, summary, verdicts, state, ", ".join(waits) or None, steps_per_s)


def _empty_view(
    common: dict[str, Any], final_summary: dict[str, Any] | None, *, files: bool
) -> LiveView:
    """No step recorded yet (or ever): what the view is waiting for, or, for a run that ended
    without a step, the whole run's verdict (insufficient data)."""
    verdicts = [] if final_summary is None else final_summary.get(schema.SUMMARY_VERDICTS) or []
    headline = verdicts[0] if verdicts else None
    return LiveView(
        **common,
        state=WAITING if final_summary is None else FINAL,
        window_steps=0,
        steps_per_s=None,
        median_step_ms=None,
        shares={},
        slowest_rank=None,
        slowest_ratio=None,
        verdict_kind=headline["kind"] if headline else None,
        verdict_why=headline["why"] if headline else None,
        collecting="waiting for the first step" if files else "waiting for the first rank file",
    )


def _numbers_view(
    common: dict[str, Any],
    summary: dict[str, Any],
    verdicts: list[dict[str, Any]],
    state: str,
    collecting: str | None,
    steps_per_s: float | None,
) -> LiveView:
    """The view of a summary (the window's or the whole run's) and its verdicts."""
    overall = summary.get(schema.SUMMARY_OVERALL) or {}
    step_stats = (overall.get(schema.PHASE_STATS) or {}).get(schema.STEP) or {}
    analysed = [
        e.get(schema.SUMMARY_STEPS_ANALYSED, 0) for e in summary.get(schema.SUMMARY_RANKS, [])
    ]
    slowest_rank, slowest_ratio = _slowest(summary)
    headline = verdicts[0] if verdicts else None
    return LiveView(
        **common,
        state=state,
        window_steps=min(analysed) if analysed else 0,
        steps_per_s=steps_per_s,
        median_step_ms=step_stats.get("median"),
        shares={p: (overall.get(schema.SHARES) or {}).get(p) for p in schema.PHASES},
        slowest_rank=slowest_rank,
        slowest_ratio=slowest_ratio,
        verdict_kind=headline["kind"] if headline else None,
        verdict_why=headline["why"] if headline else None,
        collecting=collecting,
    )


def _common_view_fields(
    tails: Mapping[int, RankTail], run: str, world_size: int | None
) -> dict[str, Any]:
    """What the view shows whatever the state: ranks, steps so far, training time."""
    headers = [t.header.get(schema.WORLD_SIZE) for t in tails.values() if t.header]
    sizes = [s for s in (world_size, *headers) if is_world_size(s)]
    size = max(sizes) if sizes else (max(tails) + 1 if tails else None)
    spans = [
        (t.last_end_ms - t.first_t_ms) / 1000.0
        for t in tails.values()
        if t.first_t_ms is not None and t.last_end_ms is not None
    ]
    return {
        "run": _run_name(tails, run),
        "world_size": size,
        "rank_steps": {rank: tails[rank].steps for rank in sorted(tails)},
        "missing_ranks": [rank for rank in range(size or 0) if rank not in tails],
        "closed_ranks": [rank for rank, t in sorted(tails.items()) if t.closed],
        "dead_ranks": [rank for rank, t in sorted(tails.items()) if t.dead],
        "training_s": max(spans) if spans else None,
    }


def _still_collecting(
    tails: Mapping[int, RankTail],
    expected: range,
    training_s: float | None,
    collect_s: float,
    limits: dict[str, float],
) -> list[str]:
    """What a provisional verdict still waits for (warm-up + min_steps on every rank, and
    ``collect_s`` of training); empty when it can be given."""
    needed = int(limits["warmup_steps"]) + int(limits["min_steps"])
    short = [rank for rank in expected if rank not in tails or tails[rank].steps < needed]
    waits = []
    if short:
        fewest = min((tails[r].steps if r in tails else 0) for r in short)
        waits.append(f"{fewest}/{needed} steps on rank {short[0]}")
    if (training_s or 0.0) < collect_s:
        waits.append(f"{training_s or 0.0:.0f}/{collect_s:.0f} s of training")
    return waits


def _run_name(tails: Mapping[int, RankTail], fallback: str) -> str:
    for tail in tails.values():
        if tail.header and tail.header.get(schema.RUN):
            return str(tail.header[schema.RUN])
    return fallback


def _slowest(summary: dict[str, Any]) -> tuple[int | None, float | None]:
    """The slowest rank by its own time (step minus Backward, where DDP's fast ranks wait)."""
    fields = (summary.get(schema.SUMMARY_IMBALANCE) or {}).get(schema.IMBALANCE_FIELDS) or {}
    entry = fields.get(schema.OWN_MS) or fields.get(schema.STEP)
    if not entry or entry.get("max_over_others") is None:
        return None, None
    return entry["slowest_rank"], entry["max_over_others"]
