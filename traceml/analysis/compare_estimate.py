"""Is a change real? The estimate of one field, A vs B: means per job step, the interval of
their ratio, and the rules that keep a change whose interval excludes zero from being called.

The reasoning (job steps, correlated steps, run-to-run spread) is in :mod:`compare`'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from traceml import schema
from traceml.analysis import job_series, stats
from traceml.analysis.job_series import RunEstimate

MIN_EFFECT = 0.01  # changes under 1% are never called (not worth a verdict)
MATERIAL_SHARE = 0.02  # a phase under 2% of the step in both runs cannot move a verdict
MEMORY_CHANGE = 0.10  # a peak-memory change this large makes a faster run MIXED
MIN_STEPS = 10
DEFAULT_NOISE_FLOOR_PCT = 5.0
DEFAULT_EQUIVALENCE_MARGIN_PCT = 5.0
NOISE_FLOOR_ASSUMED = "assumed"
NOISE_FLOOR_GIVEN = "given"
NOISE_FLOOR_MEASURED = "measured"
# Two-sided 90% intervals: each claim compare makes is one-sided (B is slower; B is faster; B is
# equivalent, i.e. neither slower nor faster than the margin, as in a TOST equivalence test), so
# each is a test at the 5% level. That is what the gate's false-alarm target is, and the 95%
# two-sided interval would spend half of it on the direction the gate does not act on.
CONFIDENCE = 0.90
_T_LEVEL = 1 - (1 - CONFIDENCE) / 2
CI_LABEL = f"{CONFIDENCE:.0%} CI"

IMPROVEMENT = "IMPROVEMENT"
REGRESSION = "REGRESSION"
EQUIVALENT = "EQUIVALENT"
MIXED = "MIXED"
INCONCLUSIVE = "INCONCLUSIVE"

SLOWER = "slower"
FASTER = "faster"
NO_CHANGE = "no significant change"
NOT_MEASURED = "not measured"

COMM_LABEL = "Comm wait"

# Rules that keep a change whose interval excludes zero from being called (``hidden_rule``).
HIDDEN_MIN_EFFECT = "min_effect"
HIDDEN_MATERIAL = "material"
HIDDEN_NOISE_FLOOR = "noise_floor"
HIDDEN_DRIFT = "drift"
HIDDEN_ZERO_MEAN = "zero_mean"


@dataclass(frozen=True)
class CompareOptions:
    """What the user chose; the defaults are what ``traceml compare`` uses."""

    noise_floor_pct: float = DEFAULT_NOISE_FLOOR_PCT
    equivalence_margin_pct: float = DEFAULT_EQUIVALENCE_MARGIN_PCT
    allow_setup_change: bool = False
    # Where the floor came from: the default (a guess), --noise-floor, or identical runs
    # (--noise-floor-from). A one-run-a-side gate acts only on a floor that is not a guess.
    noise_floor_source: str = NOISE_FLOOR_ASSUMED
    noise_floor_runs: int | None = None  # identical runs it was measured from


def run_estimate(summary: dict[str, Any], fieldname: str) -> RunEstimate | None:
    """One run's mean per job step of ``fieldname`` and its uncertainty; None if unmeasured."""
    series = summary.get(schema.SUMMARY_JOB_SERIES)
    if isinstance(series, dict):
        stored = (series.get("fields") or {}).get(fieldname)
        return job_series.estimate(stored) if isinstance(stored, dict) else None
    # No usable series: a summary from before job series, a damaged one, or a current one's
    # null (no timed step, so no pooled quantiles either: None below). Only the pooled
    # quantiles of all ranks' steps remain.
    phase_stats = _phase_stats(summary, fieldname)
    distribution = _distribution(summary, fieldname)
    if not phase_stats or not distribution:
        return None
    ranks = summary.get(schema.WORLD_SIZE) or 1
    return job_series.estimate_from_distribution(distribution, phase_stats, int(ranks))


@dataclass(frozen=True)
class Difference:
    """log(B / A) of the mean per job step, with a CONFIDENCE interval."""

    log_ratio: float
    low: float  # CONFIDENCE interval of log_ratio (-inf / inf: unknown)
    high: float
    df: float
    between_runs: bool  # True: from the spread of run means; False: within-run only
    run_cv: float | None  # sd of the runs' log means (~ run-to-run CV), several runs only


def difference(side_a: list[RunEstimate], side_b: list[RunEstimate]) -> Difference | None:
    """The interval for log(mean B / mean A); None when a mean is not positive."""
    if any(e.mean <= 0 for e in (*side_a, *side_b)):
        return None
    logs_a = [math.log(e.mean) for e in side_a]
    logs_b = [math.log(e.mean) for e in side_b]
    log_ratio = sum(logs_b) / len(logs_b) - sum(logs_a) / len(logs_a)
    # Relative variance of each run's mean (delta method: var(log m) ~ var(m) / m^2).
    within = [(e.se / e.mean) ** 2 for e in (*side_a, *side_b)]
    if len(side_a) == 1 and len(side_b) == 1:
        var_a, var_b = within
        variance = var_a + var_b
        df_a, df_b = side_a[0].df, side_b[0].df
        if not math.isfinite(variance) or min(df_a, df_b) < 1:
            return Difference(log_ratio, -math.inf, math.inf, 0.0, False, None)
        # Welch-Satterthwaite: the two runs' variances come with different degrees of freedom.
        denominator = var_a**2 / df_a + var_b**2 / df_b
        df = variance**2 / denominator if denominator > 0 else min(df_a, df_b)
        half = stats.t_quantile(_T_LEVEL, df) * math.sqrt(variance)
        return Difference(log_ratio, log_ratio - half, log_ratio + half, df, False, None)
    # Several runs on at least one side: the runs' means scatter by everything that differs
    # between runs; pooled over both sides (a side of one run borrows the other's spread).
    squares = sum((x - sum(logs) / len(logs)) ** 2 for logs in (logs_a, logs_b) for x in logs)
    df = float(len(logs_a) + len(logs_b) - 2)
    spread = squares / df
    # A run's mean varies at least as much as its within-run error says; a lucky small spread
    # of two or three runs must not make the interval narrower than that.
    finite = [v for v in within if math.isfinite(v)]
    floor = sum(finite) / len(finite) if finite else 0.0
    variance = max(spread, floor) * (1 / len(logs_a) + 1 / len(logs_b))
    half = stats.t_quantile(_T_LEVEL, df) * math.sqrt(variance)
    return Difference(log_ratio, log_ratio - half, log_ratio + half, df, True, math.sqrt(spread))


def side_mean(estimates: list[RunEstimate]) -> float | None:
    """A side's mean per job step: its runs' means averaged as the change is (geometric: the
    change is the ratio of the sides' mean log), so the means shown, their delta and the change
    agree in sign. A side with a zero mean has no log: its arithmetic mean, and no ratio."""
    if not estimates:
        return None
    if len(estimates) == 1:
        return estimates[0].mean
    if all(e.mean > 0 for e in estimates):
        return math.exp(sum(math.log(e.mean) for e in estimates) / len(estimates))
    return sum(e.mean for e in estimates) / len(estimates)


def pct_change(log_ratio: float) -> float:
    """A log ratio as a % change (-100% .. +inf)."""
    if log_ratio == math.inf:
        return math.inf
    return (math.exp(log_ratio) - 1.0) * 100.0


def _phase_stats(summary: dict[str, Any], fieldname: str) -> dict[str, Any] | None:
    return ((summary.get(schema.SUMMARY_OVERALL) or {}).get(schema.PHASE_STATS) or {}).get(
        fieldname
    )


def _distribution(summary: dict[str, Any], fieldname: str) -> list[float] | None:
    dist = ((summary.get(schema.SUMMARY_OVERALL) or {}).get(schema.DISTRIBUTIONS) or {}).get(
        fieldname
    )
    return dist if isinstance(dist, list) and dist else None


def _label(fieldname: str) -> str:
    return COMM_LABEL if fieldname == schema.COMM else schema.PHASE_LABELS[fieldname]


def compare_field(
    side_a: list[dict[str, Any]],
    side_b: list[dict[str, Any]],
    fieldname: str,
    options: CompareOptions | None = None,
    step_means: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """A vs B for one field: means per job step, % change, its interval, and whether it is a
    change (``significant``), or which rule hid it (``hidden_by``)."""
    options = options or CompareOptions()
    entry: dict[str, Any] = {"field": fieldname, "label": _label(fieldname)}
    measured_a = [e for e in (run_estimate(s, fieldname) for s in side_a) if e is not None]
    measured_b = [e for e in (run_estimate(s, fieldname) for s in side_b) if e is not None]
    mean_a, mean_b = side_mean(measured_a), side_mean(measured_b)
    entry.update(
        status=NOT_MEASURED,
        significant=False,
        hidden_by=None,
        hidden_rule=None,
        a_mean_ms=mean_a,
        b_mean_ms=mean_b,
        measured_in_a=bool(measured_a),
        measured_in_b=bool(measured_b),
    )
    if len(measured_a) != len(side_a) or len(measured_b) != len(side_b):
        return entry
    diff = difference(measured_a, measured_b)
    drifts = [abs(pct_change(e.drift)) for e in (*measured_a, *measured_b) if e.drift is not None]
    entry["delta_ms"] = mean_b - mean_a
    entry.update(_sample_sizes(measured_a, measured_b))
    entry["drift_pct"] = max(drifts) if drifts else None
    entry["approximate"] = any(e.approximate for e in (*measured_a, *measured_b))
    if diff is None:
        entry.update(_zero_mean(mean_a, mean_b))
        return entry
    change = pct_change(diff.log_ratio)
    finite = math.isfinite(diff.low) and math.isfinite(diff.high)
    entry.update(
        change_pct=change,
        ci_change_pct=[pct_change(diff.low), pct_change(diff.high)] if finite else None,
        df=diff.df,
        between_runs=diff.between_runs,
        run_cv_pct=None if diff.run_cv is None else diff.run_cv * 100,
    )
    entry.update(_decision(fieldname, diff, mean_a, mean_b, drifts, options, step_means))
    return entry


def _zero_mean(mean_a: float, mean_b: float) -> dict[str, Any]:
    """A side with a zero mean has no log ratio, so no interval and nothing called; but a drop
    from a nonzero mean to zero is a measured -100%, not an unknown change."""
    change = (mean_b - mean_a) / mean_a * 100 if mean_a > 0 else None
    where = "" if (mean_a <= 0) == (mean_b <= 0) else (" in A" if mean_a <= 0 else " in B")
    return {
        "status": NO_CHANGE,
        "change_pct": change,
        "ci_change_pct": None,
        "hidden_rule": HIDDEN_ZERO_MEAN,
        "hidden_by": f"zero mean{where}",
    }


def _decision(
    fieldname: str,
    diff: Difference,
    mean_a: float,
    mean_b: float,
    drifts: list[float],
    options: CompareOptions,
    step_means: tuple[float, float] | None,
) -> dict[str, Any]:
    """Whether the change is called (``significant``), or which rule hid it."""
    decided: dict[str, Any] = {}
    if fieldname != schema.STEP and step_means is not None:
        share = max(_share(mean_a, step_means[0]), _share(mean_b, step_means[1]))
        decided["step_share_pct"] = 100 * share
    change = pct_change(diff.log_ratio)
    finite = math.isfinite(diff.low) and math.isfinite(diff.high)
    excludes_zero = finite and (diff.low > 0 or diff.high < 0)
    rule, hidden = None, None
    if excludes_zero:
        found = _hiding_rule(fieldname, change, mean_a, mean_b, drifts, diff, options, step_means)
        rule, hidden = found or (None, None)
    significant = excludes_zero and rule is None
    decided.update(
        significant=significant,
        hidden_rule=rule,
        hidden_by=hidden,
        status=(SLOWER if change > 0 else FASTER) if significant else NO_CHANGE,
    )
    return decided


def _hiding_rule(
    fieldname: str,
    change: float,
    mean_a: float,
    mean_b: float,
    drifts: list[float],
    diff: Difference,
    options: CompareOptions,
    step_means: tuple[float, float] | None,
) -> tuple[str, str] | None:
    """(rule, short text): why a change whose interval excludes zero is not called; or None."""
    if abs(change) < MIN_EFFECT * 100:
        return HIDDEN_MIN_EFFECT, f"under {MIN_EFFECT * 100:.0f}%"
    if fieldname != schema.STEP and step_means is not None:
        step_a, step_b = step_means
        if max(_share(mean_a, step_a), _share(mean_b, step_b)) < MATERIAL_SHARE:
            return HIDDEN_MATERIAL, f"under {MATERIAL_SHARE * 100:.0f}% of step"
    if not diff.between_runs:
        if abs(change) <= options.noise_floor_pct:
            return HIDDEN_NOISE_FLOOR, f"{options.noise_floor_pct:.3g}% noise floor"
        drift = max(drifts) if drifts else 0.0
        if abs(change) <= drift:
            return HIDDEN_DRIFT, f"drift {drift:.1f}%"
    return None


def _sample_sizes(measured_a: list[RunEstimate], measured_b: list[RunEstimate]) -> dict[str, Any]:
    """How much each side's estimate rests on: steps, effective sample size, step-time CV."""
    return {
        "a_steps": sum(e.steps for e in measured_a),
        "b_steps": sum(e.steps for e in measured_b),
        "a_ess": _sum_or_none([e.ess for e in measured_a]),
        "b_ess": _sum_or_none([e.ess for e in measured_b]),
        "a_cv_pct": _max_cv(measured_a),
        "b_cv_pct": _max_cv(measured_b),
    }


def _share(phase_ms: float, step_ms: float) -> float:
    return phase_ms / step_ms if step_ms else 0.0


def _sum_or_none(values: list[float]) -> float | None:
    return sum(values) if all(math.isfinite(v) for v in values) else None


def _max_cv(estimates: list[RunEstimate]) -> float | None:
    cvs = [e.cv for e in estimates if e.cv is not None]
    return max(cvs) * 100 if cvs else None


# ----------------------------------------------------------------------------------------------
# The comparison
