"""The job's step series: one value per training step of the whole job, what compare needs.

Why not every rank's steps pooled? DDP ranks move in lock-step: at one step, R ranks' times
are one observation of the job, not R. Pooling them made compare's intervals shrink with
sqrt(R) and raise false alarms at 8 and 32 ranks (issue 17). Here each step position (the i-th
analysed step of every rank; ranks of one job take their optimizer steps together) gives one
value: the step time is the slowest rank's (the job waits for it), a phase's time is its mean
over the ranks.

Pure. The reducer calls :func:`rank_series` per rank (in a worker process with ``--jobs``; the
result is a small picklable dict) and feeds a :class:`JobSeriesAccumulator`, which holds
O(steps) numbers whatever the rank count. :func:`estimate` turns a stored series into a mean
with an honest standard error (batch means: consecutive steps are correlated), an effective
sample size, and the drift between the run's first and second half.

Ranks are aligned by step number, not by position: a rank that abandoned one step (an
exception it recovered from, a skipped batch) would otherwise be shifted one step against the
others for the rest of the run. The number is the trainer's global step when every analysed
record of the rank carries one, strictly increasing; else the record's own step index; else
its position.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from traceml import schema
from traceml.analysis import stats
from traceml.analysis.node_series import NodeSeries

# Time waiting on other ranks (schema.COMM) rides along: compare shows it when both runs have it.
SERIES_FIELDS: tuple[str, ...] = (*schema.TIMED_FIELDS, schema.COMM)
# Points kept per field in a summary. Longer runs store means of consecutive steps instead of
# steps: batch means over those points are still batch means over steps, and the summary stays
# ~20 kB per field however long the run.
MAX_POINTS = 2048
UNIT = "job step: per step position, step_ms = slowest rank, phases = mean over ranks"

RankSeries = dict[str, list[float | None]]
_CLEAN_TYPES = frozenset({int, float, type(None)})
# The step numbers of a rank series (see rank_series), stored beside its fields.
STEP_NUMBERS = "_step_numbers"
# A rank's step numbers may span at most this many times its step count (plus a margin):
# beyond that (a damaged file) the rank is aligned by position, so memory stays O(steps).
_MAX_SPAN_FACTOR = 4


def rank_series(columns: dict[str, list[Any]], skip: int) -> RankSeries:
    """One rank's analysed steps (after the ``skip`` warm-up steps), per series field, with
    their step numbers under :data:`STEP_NUMBERS`.

    ``columns`` maps field names to per-step lists as the reducer reads them; fields the rank
    file does not carry are left out. Null (unmeasured) stays None, position is kept.
    """
    series: RankSeries = {}
    for fieldname in SERIES_FIELDS:
        column = columns.get(fieldname)
        if column is None:
            continue
        values = column[skip:]
        if not set(map(type, values)) <= _CLEAN_TYPES:  # the reducer's columns are cleaned
            values = [v if isinstance(v, (int, float)) else None for v in values]
        if any(v is not None for v in values):
            series[fieldname] = values
    if series:
        count = max(len(values) for values in series.values())
        series[STEP_NUMBERS] = _step_numbers(columns, skip, count)
    return series


def _step_numbers(columns: dict[str, list[Any]], skip: int, count: int) -> list[int]:
    """The numbers that align this rank's analysed steps with the other ranks'."""
    for name in (schema.GLOBAL_STEP, schema.STEP_INDEX):
        numbers = _gaps_filled((columns.get(name) or [])[skip : skip + count])
        if len(numbers) == count and _usable_numbers(numbers):
            return numbers
    return list(range(skip, skip + count))


def _gaps_filled(numbers: list[Any]) -> list[Any]:
    """A damaged (null) step number after a good one taken as the next number: one bad value
    must not make this rank align by another numbering than its peers (off by one)."""
    if None not in numbers:
        return numbers
    filled = list(numbers)
    for index in range(1, len(filled)):
        if filled[index] is None and type(filled[index - 1]) is int:
            filled[index] = filled[index - 1] + 1
    return filled


def _usable_numbers(numbers: list[Any]) -> bool:
    if not numbers or not all(type(n) is int for n in numbers):
        return False
    increasing = all(a < b for a, b in itertools.pairwise(numbers))
    return increasing and numbers[-1] - numbers[0] < _MAX_SPAN_FACTOR * len(numbers) + 1024


class JobSeriesAccumulator:
    """Merges ranks' series one at a time; memory O(steps x fields x nodes), not O(ranks x
    steps).

    Ranks are summed within their node first and the nodes then in node order, so a run
    reduced in one pass and one merged from per-node partials (traceml/analysis/partials.py)
    add the same numbers in the same order: their job series are identical, not just close.
    """

    def __init__(self) -> None:
        self._nodes: dict[int, NodeSeries] = {}

    def add(self, series: RankSeries | None, node: int = 0) -> None:
        if not series:
            return
        self._nodes.setdefault(node, NodeSeries()).add(series, STEP_NUMBERS)

    def add_node(self, node: int, node_series: NodeSeries) -> None:
        """A node's series as a partial stored it (before any of its ranks is added here)."""
        self._nodes[node] = node_series

    def node(self, node: int) -> NodeSeries | None:
        return self._nodes.get(node)

    def result(self) -> dict[str, Any] | None:
        """What the summary stores (see :data:`schema.SUMMARY_JOB_SERIES`), None without steps."""
        merged = NodeSeries()
        for node in sorted(self._nodes):
            merged.merge(self._nodes[node])
        fields: dict[str, Any] = {}
        for fieldname, values in merged.job_values().items():
            if values:
                fields[fieldname] = _stored_field(values)
        if not fields:
            return None
        return {"unit": UNIT, "ranks": merged.ranks, "fields": fields}


def _stored_field(values: list[float]) -> dict[str, Any]:
    n = len(values)
    per_point = max(1, math.ceil(n / MAX_POINTS))
    points = [
        math.fsum(values[start : start + per_point]) / len(values[start : start + per_point])
        for start in range(0, n, per_point)
    ]
    # The first and second half, at step resolution (the points may straddle the middle).
    half = n // 2
    first = math.fsum(values[:half]) / half if half else None
    second = math.fsum(values[half:]) / (n - half) if n - half else None
    return {
        "steps": n,
        "steps_per_point": per_point,
        "mean": math.fsum(values) / n,
        "sd": stats.weighted_sd(values) if n > 1 else None,
        "first_half_mean": first,
        "second_half_mean": second,
        "points": [round(p, 4) for p in points],
    }


# ----------------------------------------------------------------------------------------------
# What one run's series says


@dataclass(frozen=True)
class RunEstimate:
    """One run, one field: the mean per job step and how well it is known."""

    mean: float
    se: float  # standard error of the mean (inf: unknown)
    df: float  # degrees of freedom of ``se``
    steps: int
    ess: float  # effective sample size: steps worth of independent information
    cv: float | None  # step-to-step coefficient of variation
    drift: float | None  # log(second-half mean / first-half mean)
    approximate: bool  # from an older summary's pooled distribution, not a job series


def _finite(value: Any) -> float | None:
    """A stored number, or None when a damaged summary holds something else there."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def estimate(stored: dict[str, Any]) -> RunEstimate | None:
    """The estimate from a stored job-series field (see :func:`_stored_field`); None when the
    field is absent or damaged (compare then falls back to the stored distributions)."""
    if not isinstance(stored, dict):
        return None
    raw_points = stored.get("points")
    if not isinstance(raw_points, list) or not raw_points:
        return None
    points = [_finite(point) for point in raw_points]
    steps = _count(stored.get("steps"))
    per_point = _count(stored.get("steps_per_point", 1))
    if any(point is None or point < 0 for point in points) or steps is None or per_point is None:
        return None
    weights = [float(per_point)] * len(points)
    weights[-1] = float(steps - per_point * (len(points) - 1))
    if weights[-1] <= 0:
        return None
    mean, variance, batches = stats.batch_means(points, weights)
    if per_point == 1 and batches < stats.SHORT_SERIES_BATCHES:
        # A short run: few, short batches understate the spread (compare's A/A false alarms
        # with 60 steps a side were 6-7% for a 5% target).
        variance = max(variance, stats.ar1_mean_variance(points))
    stored_mean = _finite(stored.get("mean"))
    mean = stored_mean if stored_mean is not None else mean
    sd = _finite(stored.get("sd"))
    if math.isfinite(variance) and variance > 0 and sd:
        ess = min(float(steps), sd**2 / variance)
    elif variance == 0.0:
        ess = float(steps)  # constant steps: nothing to learn about correlation
    else:
        ess = math.nan
    first = _finite(stored.get("first_half_mean"))
    second = _finite(stored.get("second_half_mean"))
    drift = math.log(second / first) if first and second and first > 0 and second > 0 else None
    return RunEstimate(
        mean=mean,
        se=math.sqrt(variance),
        df=float(batches - 1),
        steps=steps,
        ess=ess,
        cv=(sd / mean) if sd is not None and mean > 0 else None,
        drift=drift,
        approximate=False,
    )


def estimate_from_distribution(
    distribution: list[float], phase_stats: dict[str, Any], ranks: int
) -> RunEstimate | None:
    """For summaries written before job series (schema 1.0): the pooled quantiles of all ranks'
    steps. Steps are taken as independent and ``count / ranks`` of them as the sample (ranks
    move together), so the interval is approximate and usually too narrow."""
    count = int(phase_stats.get("count") or 0)
    mean = phase_stats.get("mean")
    if not distribution or count < 1 or mean is None:
        return None
    steps = max(1, count // max(1, ranks))
    sd = stats.weighted_sd(distribution)
    se = sd / math.sqrt(steps) if steps > 1 and math.isfinite(sd) else math.inf
    return RunEstimate(
        mean=float(mean),
        se=se,
        df=float(steps - 1),
        steps=steps,
        ess=float(steps),
        cv=(sd / mean) if mean > 0 and math.isfinite(sd) else None,
        drift=None,
        approximate=True,
    )
