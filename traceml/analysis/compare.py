"""Runs before a change vs runs after it -> what changed, whether it is real, and a verdict for
people and CI. Pure except :func:`compare_command` (files in, files out, exit code).

Is a change real? Three things made the old answer wrong (issue 17), and each has its rule:

* **The unit is the job's step.** DDP ranks move in lock-step, so each summary's job series
  (traceml/analysis/job_series.py) gives one value per step: the slowest rank's step time, a phase's
  mean over ranks. Counting every rank's step as a sample shrank intervals with sqrt(ranks).
* **Consecutive steps are correlated.** A run's mean step time gets its standard error from
  batch means (long contiguous batches are nearly independent), with Student's t on
  batches - 1 degrees of freedom; the effective sample size says how many independent steps
  that is worth. The interval is for log(mean B / mean A), so a change is a ratio and its
  interval never goes below -100%.
* **Runs differ from runs.** With several runs a side the interval comes from the spread of
  the runs' (log) means, pooled over both sides, Student's t on runs - 2 degrees of freedom: it
  includes whatever makes one run differ from the next. With one run a side that spread is
  unknown: a change is called only when it is beyond a noise floor (an option) and beyond the
  drift each run shows between its own first and second half; otherwise INCONCLUSIVE, saying
  why.

EQUIVALENT means the whole interval lies inside the equivalence margin; an interval that does
not, with no significant change either, is INCONCLUSIVE ("runs too noisy"). Every rule that
hides a change is listed in the result's ``rules`` and printed on the Method line.
Deterministic: no resampling, no seed.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from traceml import schema
from traceml.analysis import input_pipeline, job_series, resources, stats
from traceml.analysis.diagnose import label
from traceml.analysis.job_series import RunEstimate
from traceml.errors import OutputError, UserError

MIN_EFFECT = 0.01  # changes under 1% are never called (not worth a verdict)
MATERIAL_SHARE = 0.02  # a phase under 2% of the step in both runs cannot move a verdict
MEMORY_CHANGE = 0.10  # a peak-memory change this large makes a faster run MIXED
MIN_STEPS = 10
DEFAULT_NOISE_FLOOR_PCT = 5.0
DEFAULT_EQUIVALENCE_MARGIN_PCT = 5.0
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

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_BAD_INPUT = 2
EXIT_INCONCLUSIVE = 3

COMM_LABEL = "Comm wait"

# Rules that keep a change whose interval excludes zero from being called (``hidden_rule``).
HIDDEN_MIN_EFFECT = "min_effect"
HIDDEN_MATERIAL = "material"
HIDDEN_NOISE_FLOOR = "noise_floor"
HIDDEN_DRIFT = "drift"
HIDDEN_ZERO_MEAN = "zero_mean"


class CompareInputError(UserError):
    """A file that cannot be compared; one line for the user (cli.main), exit code 2."""


@dataclass(frozen=True)
class CompareOptions:
    """What the user chose; the defaults are what ``traceml compare`` uses."""

    noise_floor_pct: float = DEFAULT_NOISE_FLOOR_PCT
    equivalence_margin_pct: float = DEFAULT_EQUIVALENCE_MARGIN_PCT
    allow_setup_change: bool = False


# ----------------------------------------------------------------------------------------------
# Loading


def load_summary(path: Path | str) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        candidate = path / schema.SUMMARY_JSON
        if candidate.is_file():
            path = candidate
    if not path.is_file():
        raise CompareInputError(f"no such file: {path}")
    try:
        data = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError:
        raise CompareInputError(f"{path} is not JSON (is it a final_summary.json?)") from None
    except OSError as exc:
        raise CompareInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise CompareInputError(f"{path} is not a traceml summary")
    family, supported = schema.family_and_major(schema.SUMMARY_SCHEMA)
    found = data.get(schema.SCHEMA)
    major = schema.schema_major(found, family)
    if major is None:
        raise CompareInputError(
            f"{path} is not a traceml summary (schema {found!r}; expected {family}/{supported}.x)"
        )
    if major > supported:
        raise CompareInputError(
            f"{path} has schema {found}, newer than this traceml reads ({family}/{supported}.x): "
            "upgrade traceml"
        )
    if not isinstance(data.get(schema.SUMMARY_OVERALL), dict):
        raise CompareInputError(f"{path} is a traceml summary without an 'overall' section")
    data["_path"] = str(path)
    return data


# ----------------------------------------------------------------------------------------------
# Statistics


def run_estimate(summary: dict[str, Any], fieldname: str) -> RunEstimate | None:
    """One run's mean per job step of ``fieldname`` and its uncertainty; None if unmeasured."""
    series = summary.get(schema.SUMMARY_JOB_SERIES)
    if isinstance(series, dict):
        stored = (series.get("fields") or {}).get(fieldname)
        return job_series.estimate(stored) if isinstance(stored, dict) else None
    # A summary from before job series: only the pooled quantiles of all ranks' steps.
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


def _pct(log_ratio: float) -> float:
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
    estimates_a = [run_estimate(s, fieldname) for s in side_a]
    estimates_b = [run_estimate(s, fieldname) for s in side_b]
    measured_a = [e for e in estimates_a if e is not None]
    measured_b = [e for e in estimates_b if e is not None]
    mean_a = sum(e.mean for e in measured_a) / len(measured_a) if measured_a else None
    mean_b = sum(e.mean for e in measured_b) / len(measured_b) if measured_b else None
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
    drifts = [abs(_pct(e.drift)) for e in (*measured_a, *measured_b) if e.drift is not None]
    entry.update(
        delta_ms=mean_b - mean_a,
        a_steps=sum(e.steps for e in measured_a),
        b_steps=sum(e.steps for e in measured_b),
        a_ess=_sum_or_none([e.ess for e in measured_a]),
        b_ess=_sum_or_none([e.ess for e in measured_b]),
        a_cv_pct=_max_cv(measured_a),
        b_cv_pct=_max_cv(measured_b),
        drift_pct=max(drifts) if drifts else None,
        approximate=any(e.approximate for e in (*measured_a, *measured_b)),
    )
    if diff is None:
        entry.update(status=NO_CHANGE, change_pct=None, ci_change_pct=None)
        entry.update(hidden_rule=HIDDEN_ZERO_MEAN, hidden_by="zero mean")
        return entry
    change = _pct(diff.log_ratio)
    finite = math.isfinite(diff.low) and math.isfinite(diff.high)
    entry.update(
        change_pct=change,
        ci_change_pct=[_pct(diff.low), _pct(diff.high)] if finite else None,
        df=diff.df,
        between_runs=diff.between_runs,
        run_cv_pct=None if diff.run_cv is None else diff.run_cv * 100,
    )
    excludes_zero = finite and (diff.low > 0 or diff.high < 0)
    rule, hidden = None, None
    if excludes_zero:
        found = _hiding_rule(fieldname, change, mean_a, mean_b, drifts, diff, options, step_means)
        rule, hidden = found or (None, None)
    significant = excludes_zero and rule is None
    entry.update(
        significant=significant,
        hidden_rule=rule,
        hidden_by=hidden,
        status=(SLOWER if change > 0 else FASTER) if significant else NO_CHANGE,
    )
    return entry


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
        if max(mean_a / step_a if step_a else 0, mean_b / step_b if step_b else 0) < (
            MATERIAL_SHARE
        ):
            return HIDDEN_MATERIAL, f"under {MATERIAL_SHARE * 100:.0f}% of step"
    if not diff.between_runs:
        if abs(change) <= options.noise_floor_pct:
            return HIDDEN_NOISE_FLOOR, f"{options.noise_floor_pct:g}% noise floor"
        drift = max(drifts) if drifts else 0.0
        if abs(change) <= drift:
            return HIDDEN_DRIFT, f"drift {drift:.1f}%"
    return None


def _sum_or_none(values: list[float]) -> float | None:
    return sum(values) if all(math.isfinite(v) for v in values) else None


def _max_cv(estimates: list[RunEstimate]) -> float | None:
    cvs = [e.cv for e in estimates if e.cv is not None]
    return max(cvs) * 100 if cvs else None


# ----------------------------------------------------------------------------------------------
# The comparison


_SETUP_KEYS = (
    (schema.WORLD_SIZE, "world size"),
    (schema.BATCH_SIZE, "batch size"),
    (schema.ACCUMULATE_GRAD_BATCHES, "gradient accumulation"),
    ("device", "device"),
    ("device_name", "device model"),
    (schema.SCRIPT, "script"),
    ("trace_max_steps", "trace-max-steps"),
    (schema.INTEGRATION, "integration"),
)
# Differences that are usually the change under test: shown, not held against the comparison.
_CHANGE_KEYS = (("num_workers", "DataLoader workers"),)


def setup_differences(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[str], list[str]]:
    setup_a = a.get(schema.SUMMARY_SETUP) or {}
    setup_b = b.get(schema.SUMMARY_SETUP) or {}
    unfair = []
    for key, name in _SETUP_KEYS:
        if setup_a.get(key) != setup_b.get(key):
            unfair.append(f"{name}: {setup_a.get(key)} -> {setup_b.get(key)}")
    versions_a = setup_a.get(schema.VERSIONS) or {}
    versions_b = setup_b.get(schema.VERSIONS) or {}
    for package in ("torch", "pytorch_lightning", "lightning", "rfdetr"):
        if versions_a.get(package) != versions_b.get(package):
            unfair.append(f"{package}: {versions_a.get(package)} -> {versions_b.get(package)}")
    changed = [
        f"{name}: {setup_a.get(key)} -> {setup_b.get(key)}"
        for key, name in _CHANGE_KEYS
        if setup_a.get(key) != setup_b.get(key)
    ]
    return unfair, changed


def _primary(summary: dict[str, Any]) -> str | None:
    verdicts = summary.get(schema.SUMMARY_VERDICTS) or []
    return verdicts[0]["kind"] if verdicts else None


# traceml's own cost above this share of a step is worth a warning: it may move the result.
OWN_COST_WARN = 0.01


def _own_cost_notes(side_a: list[dict[str, Any]], side_b: list[dict[str, Any]]) -> list[str]:
    notes = []
    for summary in (*side_a, *side_b):
        measured = resources.own_cost(summary)
        if measured is not None and measured[1] > OWN_COST_WARN:
            notes.append(
                f"traceml's own cost in {summary.get(schema.RUN)} is {measured[0]:.0f} us per "
                f"step, {measured[1] * 100:.1f}% of step time (over {OWN_COST_WARN:.0%}): "
                "changes of that size may be traceml's, not the training's"
            )
    return notes


# Verdicts that name a problem (a change away from one is news).
_PROBLEMS = frozenset(
    {
        schema.VERDICT_INPUT_BOUND,
        schema.VERDICT_H2D_BOUND,
        schema.VERDICT_OPTIMIZER_HEAVY,
        schema.VERDICT_RESIDUAL_HEAVY,
        schema.VERDICT_STRAGGLER,
        schema.VERDICT_COMM_BOUND,
        schema.VERDICT_MEMORY_PRESSURE,
    }
)


def _diagnosis_change(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    kind_a, kind_b = _primary(a), _primary(b)
    if kind_a is None or kind_b is None:
        message = "no diagnosis in one of the summaries"
    elif kind_a == kind_b:
        message = f"{label(kind_a)} in both runs"
    else:
        message = f"{label(kind_a)} -> {label(kind_b)}"
        if kind_a in _PROBLEMS:
            message += f": the {label(kind_a).lower()} problem is gone"
            if kind_a == schema.VERDICT_INPUT_BOUND:
                message += " (the input fix worked)"
    return {"a": kind_a, "b": kind_b, "changed": kind_a != kind_b, "message": message}


def _imbalance_ratio(summary: dict[str, Any]) -> float | None:
    fields = (summary.get(schema.SUMMARY_IMBALANCE) or {}).get(schema.IMBALANCE_FIELDS) or {}
    entry = fields.get(schema.OWN_MS) or fields.get(schema.STEP)
    return entry.get("max_over_others") if entry else None


def _memory(summary: dict[str, Any]) -> tuple[str, float | None]:
    overall = summary.get(schema.SUMMARY_OVERALL) or {}
    reserved = overall.get(schema.PEAK_RESERVED)
    if reserved is not None:
        return "device peak reserved", reserved
    return "peak RSS", overall.get(schema.PEAK_RSS)


def _side_memory(side: list[dict[str, Any]]) -> tuple[str, float | None]:
    """The median over a side's runs (one odd run's allocator growth is not the change)."""
    measured = [_memory(s) for s in side]
    name = measured[0][0]
    values = sorted(v for n, v in measured if n == name and v is not None)
    return name, stats.quantile_sorted(values, 0.5) if values else None


# Differences that make the timing itself incomparable: INCONCLUSIVE unless accepted.
_BLOCKING_KEYS = (
    (schema.WORLD_SIZE, "world sizes"),
    ("device", "devices and clocks"),
    ("device_name", "device models"),
    (schema.TIMING, "timing methods (host clock vs CUDA events)"),
)


def _setup_value(summary: dict[str, Any], key: str) -> Any:
    if key == schema.WORLD_SIZE:
        return summary.get(schema.WORLD_SIZE)
    return (summary.get(schema.SUMMARY_SETUP) or {}).get(key)


def _blocking_differences(side_a: list[dict[str, Any]], side_b: list[dict[str, Any]]) -> list[str]:
    found = []
    for key, name in _BLOCKING_KEYS:
        values_a = [_setup_value(s, key) for s in side_a]
        values_b = [_setup_value(s, key) for s in side_b]
        for side, values in (("A", values_a), ("B", values_b)):
            if len(set(map(repr, values))) > 1:
                found.append(f"the {side} runs differ in {name} ({_listing(values)})")
        if values_a[0] != values_b[0]:
            found.append(f"different {name} ({values_a[0]} vs {values_b[0]})")
    return found


def _listing(values: list[Any]) -> str:
    return ", ".join(str(v) for v in values)


def _as_side(runs: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [runs] if isinstance(runs, dict) else list(runs)


def compare(
    a: dict[str, Any] | list[dict[str, Any]],
    b: dict[str, Any] | list[dict[str, Any]],
    options: CompareOptions | None = None,
) -> dict[str, Any]:
    """Compare run(s) A with run(s) B (a summary, or a list of summaries per side)."""
    options = options or CompareOptions()
    side_a, side_b = _as_side(a), _as_side(b)
    if not side_a or not side_b:
        raise ValueError("each side needs at least one summary")
    first_a, first_b = side_a[0], side_b[0]
    fields = _compare_fields(side_a, side_b, options)
    step = fields[schema.STEP]
    unfair, changed = setup_differences(first_a, first_b)
    one_run_a_side = len(side_a) == 1 and len(side_b) == 1
    blocking = _blocking_differences(side_a, side_b)
    reasons = _inconclusive_reasons(side_a, side_b, fields, blocking, options)
    memory_name, memory_a = _side_memory(side_a)
    _name_b, memory_b = _side_memory(side_b)
    memory_change = (memory_b - memory_a) / memory_a if memory_a and memory_b is not None else None
    verdict = _verdict(step, reasons, memory_change, options, one_run_a_side)
    moved = [
        entry["label"]
        for f, entry in fields.items()
        if f != schema.STEP and entry.get("significant")
    ]
    return {
        schema.SCHEMA: schema.COMPARISON_SCHEMA,
        "a": _run_info(first_a),
        "b": _run_info(first_b),
        "a_runs": [_run_info(s) for s in side_a],
        "b_runs": [_run_info(s) for s in side_b],
        "verdict": verdict,
        "inconclusive_reasons": reasons if verdict == INCONCLUSIVE else [],
        "step": step,
        "fields": fields,
        "phases_that_moved": moved,
        "setup_differences": unfair,
        "changes": changed,
        "diagnosis": _diagnosis_change(first_a, first_b),
        "imbalance": {"a": _imbalance_ratio(first_a), "b": _imbalance_ratio(first_b)},
        "memory": {
            "measure": memory_name,
            "a_bytes": memory_a,
            "b_bytes": memory_b,
            "change_pct": None if memory_change is None else memory_change * 100,
        },
        "noise": {
            "run_to_run": "unknown" if one_run_a_side else "measured",
            "run_to_run_cv_pct": step.get("run_cv_pct"),
            "noise_floor_pct": options.noise_floor_pct if one_run_a_side else None,
            "equivalence_margin_pct": options.equivalence_margin_pct,
            "within_run_drift_pct": step.get("drift_pct"),
        },
        "notes": _notes(side_a, side_b, blocking, options),
        # Memory trend and utilization (issue 15): figures side by side, not judged.
        "resources": resources.resource_deltas(side_a, side_b),
        "input_pipeline": input_pipeline.compare_breakdowns(first_a, first_b),
        "rules": _rules(options, one_run_a_side, len(side_a), len(side_b)),
        "method": "; ".join(_rules(options, one_run_a_side, len(side_a), len(side_b))),
    }


def _compare_fields(
    side_a: list[dict[str, Any]], side_b: list[dict[str, Any]], options: CompareOptions
) -> dict[str, dict[str, Any]]:
    """Step, each phase, and (newer summaries on both sides) the comm wait, A vs B."""
    step = compare_field(side_a, side_b, schema.STEP, options)
    step_means = (step["a_mean_ms"], step["b_mean_ms"]) if step["status"] != NOT_MEASURED else None
    fields = {f: compare_field(side_a, side_b, f, options, step_means) for f in schema.PHASES}
    fields[schema.STEP] = step
    comm = compare_field(side_a, side_b, schema.COMM, options, step_means)
    if comm["measured_in_a"] and comm["measured_in_b"]:
        fields[schema.COMM] = comm  # newer summaries only; skipped silently otherwise
    return fields


def _inconclusive_reasons(
    side_a: list[dict[str, Any]],
    side_b: list[dict[str, Any]],
    fields: dict[str, dict[str, Any]],
    blocking: list[str],
    options: CompareOptions,
) -> list[str]:
    """Why no verdict can be given (too few steps, an unfair setup, phases measured once)."""
    reasons: list[str] = []
    for name, side in (("A", side_a), ("B", side_b)):
        for summary in side:
            estimate = run_estimate(summary, schema.STEP)
            count = estimate.steps if estimate else 0
            if count < MIN_STEPS:
                reasons.append(
                    f"{name} ({summary.get(schema.RUN)}) has only {count} analysed job steps "
                    f"(at least {MIN_STEPS} needed)"
                )
    if not options.allow_setup_change:
        reasons.extend(blocking)
    missing = [
        fields[f]["label"]
        for f in schema.PHASES
        if fields[f]["status"] == NOT_MEASURED
        and fields[f]["measured_in_a"] != fields[f]["measured_in_b"]
    ]
    if missing:
        reasons.append("phases measured in only one run: " + ", ".join(missing))
    if fields[schema.STEP]["status"] == NOT_MEASURED and not reasons:
        reasons.append("no step times to compare")
    return reasons


def _verdict(
    step: dict[str, Any],
    reasons: list[str],
    memory_change: float | None,
    options: CompareOptions,
    one_run_a_side: bool,
) -> str:
    """The overall verdict; a no-change verdict may add its reasons to ``reasons``."""
    if reasons:
        return INCONCLUSIVE
    if step["status"] == FASTER:
        return MIXED if (memory_change or 0) >= MEMORY_CHANGE else IMPROVEMENT
    if step["status"] == SLOWER:
        return MIXED if (memory_change or 0) <= -MEMORY_CHANGE else REGRESSION
    verdict, why = _no_change_verdict(step, options, one_run_a_side)
    reasons.extend(why)
    return verdict


def _notes(
    side_a: list[dict[str, Any]],
    side_b: list[dict[str, Any]],
    blocking: list[str],
    options: CompareOptions,
) -> list[str]:
    approximate = [
        f"{s.get('_path') or s.get(schema.RUN)}"
        for s in (*side_a, *side_b)
        if not isinstance(s.get(schema.SUMMARY_JOB_SERIES), dict)
    ]
    notes = []
    if approximate:
        notes.append(
            "older summary without a job step series (" + _listing(approximate) + "): its "
            "intervals are approximate (steps taken as independent, pooled over ranks)"
        )
    if blocking and options.allow_setup_change:
        notes.append("setup change accepted (--allow-setup-change): " + "; ".join(blocking))
    notes.extend(_own_cost_notes(side_a, side_b))
    return notes


def _no_change_verdict(
    step: dict[str, Any], options: CompareOptions, one_run_a_side: bool
) -> tuple[str, list[str]]:
    """EQUIVALENT only when the whole interval is inside the margin; else INCONCLUSIVE + why."""
    margin = options.equivalence_margin_pct
    interval = step.get("ci_change_pct")
    drift = step.get("drift_pct")
    drifting = one_run_a_side and drift is not None and drift > margin
    inside = interval is not None and -margin <= interval[0] and interval[1] <= margin
    if inside and not drifting:
        return EQUIVALENT, []
    why: list[str] = []
    change = _fmt_pct(step.get("change_pct"))
    if interval is None:
        why.append("step time has no interval (too few steps to estimate the noise)")
    elif step.get("hidden_rule") == HIDDEN_NOISE_FLOOR:
        why.append(f"step time {change} is within the {options.noise_floor_pct:g}% noise floor")
    elif step.get("hidden_rule") == HIDDEN_DRIFT:
        why.append(
            f"step time {change} is within the runs' own drift ({drift:.1f}%, first vs second half)"
        )
    elif not inside:
        if step.get("between_runs"):
            noise = f"run-to-run CV {step.get('run_cv_pct') or 0.0:.1f}%"
        else:
            cvs = [v for v in (step.get("a_cv_pct"), step.get("b_cv_pct")) if v is not None]
            noise = f"step-time CV {max(cvs):.0f}%" if cvs else "step times vary"
        why.append(
            f"runs too noisy: {noise}; {CI_LABEL} {_fmt_interval(interval)} exceeds the "
            f"+-{margin:g}% margin"
        )
    if drifting and step.get("hidden_rule") != HIDDEN_DRIFT:
        why.append(f"the runs drift by up to {drift:.1f}% within themselves (first vs second half)")
    if one_run_a_side:
        why.append("run-to-run noise is unknown with one run a side: compare 3 runs a side")
    return INCONCLUSIVE, why


def _rules(options: CompareOptions, one_run_a_side: bool, runs_a: int, runs_b: int) -> list[str]:
    """Every rule that decides or hides a change, as printed on the Method line."""
    rules = [
        "one sample per job step (the slowest rank's step time; phases averaged over ranks)",
        f"{CI_LABEL} (two-sided; one-sided 5% per claim) of the ratio of mean times, on the log "
        "scale",
    ]
    if one_run_a_side:
        rules.append("within-run error from batch means (correlated steps), Welch t")
        rules.append(
            "one run a side: run-to-run noise unknown, so a change must exceed the "
            f"{options.noise_floor_pct:g}% noise floor and each run's first-vs-second-half drift"
        )
    else:
        rules.append(f"between-run spread of {runs_a} + {runs_b} runs' means, pooled t")
    rules.append(
        f"changes under {MIN_EFFECT * 100:.0f}% and phases under {MATERIAL_SHARE * 100:.0f}% of "
        "the step are never called"
    )
    rules.append(
        f"EQUIVALENT only when the whole CI is within +-{options.equivalence_margin_pct:g}%"
    )
    rules.append(
        "world size, device or timing-method changes: "
        + ("accepted (--allow-setup-change)" if options.allow_setup_change else "INCONCLUSIVE")
    )
    return rules


def _run_info(summary: dict[str, Any]) -> dict[str, Any]:
    step = run_estimate(summary, schema.STEP)
    return {
        "path": summary.get("_path"),
        "run": summary.get(schema.RUN),
        "status": summary.get(schema.SUMMARY_STATUS),
        "steps_analysed": summary.get(schema.SUMMARY_STEPS_ANALYSED),
        "job_steps": step.steps if step else None,
        "ess": step.ess if step and math.isfinite(step.ess) else None,
        "world_size": summary.get(schema.WORLD_SIZE),
    }


def gate_exit_code(result: dict[str, Any], fail_on_regression: float | None) -> int:
    """The exit code CI sees: 1 = significant step-time regression beyond the limit,
    3 = inconclusive (under the gate only), 0 otherwise."""
    if fail_on_regression is None:
        return EXIT_OK
    if result["verdict"] == INCONCLUSIVE:
        return EXIT_INCONCLUSIVE
    step = result["step"]
    regressed = step.get("significant") and step["status"] == SLOWER
    if regressed and (step.get("change_pct") or 0.0) > fail_on_regression:
        return EXIT_REGRESSION
    return EXIT_OK


# ----------------------------------------------------------------------------------------------
# Text


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _fmt_pct(value: float | None, signed: bool = True) -> str:
    if value is None:
        return "-"
    return f"{value:+.1f}%" if signed else f"{value:.1f}%"


def _fmt_interval(interval: list[float]) -> str:
    return f"{interval[0]:+.1f}% .. {interval[1]:+.1f}%"


def _side_title(runs: list[dict[str, Any]]) -> str:
    if len(runs) == 1:
        return str(runs[0]["run"])
    names = [str(r["run"]) for r in runs]
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{len(runs)} runs ({shown})"


def _side_steps(runs: list[dict[str, Any]]) -> str:
    steps = [r["job_steps"] for r in runs if r["job_steps"] is not None]
    ess = [r["ess"] for r in runs if r["ess"] is not None]
    text = (
        "-"
        if not steps
        else str(min(steps)) + (f"-{max(steps)}" if max(steps) > min(steps) else "")
    )
    if ess:
        low, high = round(min(ess)), round(max(ess))
        text += f" (ESS {low}" + (f"-{high}" if high > low else "") + ")"
    return text


def render_comparison(result: dict[str, Any]) -> str:
    lines = [
        *_header_lines(result),
        "",
        *_verdict_lines(result),
        "",
        *_setup_lines(result),
        "",
        *_table_lines(result),
        "",
        *_footer_lines(result),
    ]
    return "\n".join(lines) + "\n"


def _header_lines(result: dict[str, Any]) -> list[str]:
    runs_a, runs_b = result["a_runs"], result["b_runs"]
    lines = [
        f"traceml compare: A = {_side_title(runs_a)}  vs  B = {_side_title(runs_b)}",
        f"Job steps per run: A {_side_steps(runs_a)}, B {_side_steps(runs_b)}",
    ]
    noise = result["noise"]
    drift = noise["within_run_drift_pct"]
    if noise["run_to_run"] == "unknown":
        lines.append(
            f"Run-to-run noise: unknown (one run a side); noise floor {noise['noise_floor_pct']:g}%"
            + (f", largest within-run drift {drift:.1f}%" if drift is not None else "")
        )
    else:
        cv = noise["run_to_run_cv_pct"]
        lines.append(
            f"Run-to-run noise: {len(runs_a)} + {len(runs_b)} runs, spread of run means "
            + ("-" if cv is None else f"{cv:.1f}%")
        )
    return lines


def _verdict_lines(result: dict[str, Any]) -> list[str]:
    step = result["step"]
    verdict = result["verdict"]
    ci = step.get("ci_change_pct")
    lines = []
    if verdict == INCONCLUSIVE:
        detail = ""
        if step.get("change_pct") is not None:
            detail = f": step time {_fmt_pct(step['change_pct'])}" + (
                f", {CI_LABEL} {_fmt_interval(ci)}" if ci else ""
            )
        lines.append(f"Verdict: INCONCLUSIVE{detail}")
        lines.extend(f"  - {reason}" for reason in result["inconclusive_reasons"])
    else:
        ci_text = f", {CI_LABEL} {_fmt_interval(ci)}" if ci else ""
        lines.append(
            f"Verdict: {verdict}: step time {_fmt_pct(step.get('change_pct'))} "
            f"({_fmt_ms(step.get('a_mean_ms'))} ms -> {_fmt_ms(step.get('b_mean_ms'))} ms "
            f"mean{ci_text})"
        )
        if verdict == MIXED:
            memory = result["memory"]
            lines.append(f"  but {memory['measure']} changed {_fmt_pct(memory['change_pct'])}")
    lines.append(f"Diagnosis: {result['diagnosis']['message']}")
    moved = result["phases_that_moved"]
    lines.append("Phases that moved: " + (", ".join(moved) if moved else "none significantly"))
    return lines


def _setup_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    if result["setup_differences"]:
        lines.append("Setup differences (may make this comparison unfair):")
        lines.extend(f"  - {item}" for item in result["setup_differences"])
    else:
        lines.append("Setup differences: none")
    if result["changes"]:
        lines.append("Changed between the runs: " + "; ".join(result["changes"]))
    return lines


def _table_lines(result: dict[str, Any]) -> list[str]:
    lines = [
        "  Mean per job step (ms)",
        f"  {'Phase':<12}{'A':>9}{'B':>9}{'delta':>9}{'change':>9}"
        f"{CI_LABEL + ' of change':>20}  result",
    ]
    for entry in result["fields"].values():
        ci = entry.get("ci_change_pct")
        ci_text = _fmt_interval(ci) if ci else "-"
        status = entry["status"]
        if entry.get("hidden_by"):
            status = f"hidden: {entry['hidden_by']}"
        lines.append(
            f"  {entry['label']:<12}{_fmt_ms(entry.get('a_mean_ms')):>9}"
            f"{_fmt_ms(entry.get('b_mean_ms')):>9}{_fmt_ms(entry.get('delta_ms')):>9}"
            f"{_fmt_pct(entry.get('change_pct')):>9}{ci_text:>20}  {status}"
        )
    return lines


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _footer_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    imbalance = result["imbalance"]
    if imbalance["a"] is not None or imbalance["b"] is not None:
        lines.append(
            "Rank imbalance (slowest rank / the others' median): "
            f"{_ratio(imbalance['a'])} -> {_ratio(imbalance['b'])}"
        )
    memory = result["memory"]
    if memory["a_bytes"] is not None and memory["b_bytes"] is not None:
        lines.append(
            f"Memory ({memory['measure']}): {memory['a_bytes'] / 2**20:.0f} MiB -> "
            f"{memory['b_bytes'] / 2**20:.0f} MiB ({_fmt_pct(memory['change_pct'])})"
        )
    lines.extend(resources.delta_lines(result.get("resources") or {}))
    lines.extend(input_pipeline.comparison_lines(result.get("input_pipeline")))
    lines.extend(f"Note: {note}" for note in result["notes"])
    # One line in the JSON; wrapped here so the text stays 100 columns wide.
    lines.extend(
        textwrap.wrap(
            f"Method: {result['method']}.", 100, subsequent_indent="  ", break_on_hyphens=False
        )
    )
    return lines


# ----------------------------------------------------------------------------------------------
# Command


def output_paths(output: str) -> tuple[Path, Path]:
    base = Path(output)
    if base.suffix in (".json", ".txt"):
        base = base.with_suffix("")
    return base.with_name(base.name + ".json"), base.with_name(base.name + ".txt")


def split_sides(runs: list[str], vs: list[str] | None) -> tuple[list[str], list[str]]:
    """``A B`` or ``A1 A2 ... --vs B1 B2 ...`` -> (A paths, B paths)."""
    if vs:
        return list(runs), list(vs)
    if len(runs) == 2:
        return [runs[0]], [runs[1]]
    raise CompareInputError(
        f"got {len(runs)} summar{'y' if len(runs) == 1 else 'ies'} and no --vs: give two "
        "(A B), or several a side with --vs (A1 A2 A3 --vs B1 B2 B3)"
    )


def compare_command(args: Any) -> int:
    import sys

    options = CompareOptions(
        noise_floor_pct=args.noise_floor,
        equivalence_margin_pct=args.equivalence_margin,
        allow_setup_change=args.allow_setup_change,
    )
    try:
        paths_a, paths_b = split_sides(args.runs, args.vs)
        for name, value in (("--noise-floor", args.noise_floor),
                            ("--equivalence-margin", args.equivalence_margin)):  # fmt: skip
            if not (0 <= value < 100):
                raise CompareInputError(f"{name} {value:g}: expected a percentage in [0, 100)")
        side_a = [load_summary(path) for path in paths_a]
        side_b = [load_summary(path) for path in paths_b]
    except CompareInputError:
        raise  # one line and exit code 2, printed by cli.main
    result = compare(side_a, side_b, options)
    text = render_comparison(result)
    if args.output:
        json_path, text_path = output_paths(args.output)
        try:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            for path in (json_path, text_path):
                if path.exists():
                    print(f"traceml: overwriting {path}", file=sys.stderr)
            json_path.write_bytes(
                orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)
            )
            text_path.write_text(text)
        except OSError as exc:
            raise OutputError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    sys.stdout.write(text)
    code = gate_exit_code(result, args.fail_on_regression)
    if code == EXIT_REGRESSION:
        print(
            f"traceml: step time regressed {result['step']['change_pct']:+.1f}% "
            f"(limit {args.fail_on_regression:g}%)",
            file=sys.stderr,
        )
    elif code == EXIT_INCONCLUSIVE:
        print("traceml: comparison inconclusive; see the reasons above", file=sys.stderr)
    return code
