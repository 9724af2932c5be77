"""Runs before a change vs runs after it -> what changed, whether it is real, and a verdict for
people and CI. Pure: the command (files in, files out, exit code) is
:mod:`traceml.compare_command`, the text :mod:`traceml.present.compare_text`.

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
from typing import Any

from traceml import schema
from traceml.analysis import input_pipeline, resources

# The parts, re-exported: callers import compare's names from here.
from traceml.analysis.compare_estimate import (  # noqa: F401
    CI_LABEL,
    COMM_LABEL,
    CONFIDENCE,
    DEFAULT_EQUIVALENCE_MARGIN_PCT,
    DEFAULT_NOISE_FLOOR_PCT,
    EQUIVALENT,
    FASTER,
    HIDDEN_DRIFT,
    HIDDEN_MATERIAL,
    HIDDEN_MIN_EFFECT,
    HIDDEN_NOISE_FLOOR,
    HIDDEN_ZERO_MEAN,
    IMPROVEMENT,
    INCONCLUSIVE,
    MATERIAL_SHARE,
    MEMORY_CHANGE,
    MIN_EFFECT,
    MIN_STEPS,
    MIXED,
    NO_CHANGE,
    NOISE_FLOOR_ASSUMED,
    NOISE_FLOOR_GIVEN,
    NOISE_FLOOR_MEASURED,
    NOT_MEASURED,
    REGRESSION,
    SLOWER,
    CompareOptions,
    Difference,
    compare_field,
    difference,
    pct_change,
    run_estimate,
)
from traceml.analysis.compare_load import CompareInputError, load_summary  # noqa: F401
from traceml.analysis.compare_rules import (
    comparison_notes,
    decide_verdict,
    inconclusive_reasons,
    method_rules,
)
from traceml.analysis.compare_setup import (
    blocking_differences,
    diagnosis_change,
    imbalance_ratio,
    memory_comparison,
    sides_setup_differences,
)


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
    unfair, changed = sides_setup_differences(side_a, side_b)
    one_run_a_side = len(side_a) == 1 and len(side_b) == 1
    blocking = blocking_differences(side_a, side_b)
    reasons = inconclusive_reasons(side_a, side_b, fields, blocking, options)
    memory, memory_change = memory_comparison(side_a, side_b)
    verdict = decide_verdict(step, reasons, memory_change, options, one_run_a_side)
    rules = method_rules(options, one_run_a_side, len(side_a), len(side_b))
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
        "phases_that_moved": _moved(fields),
        "setup_differences": unfair,
        "changes": changed,
        "diagnosis": diagnosis_change(first_a, first_b),
        "imbalance": {"a": imbalance_ratio(first_a), "b": imbalance_ratio(first_b)},
        "memory": memory,
        "noise": {
            "run_to_run": "unknown" if one_run_a_side else "measured",
            "run_to_run_cv_pct": step.get("run_cv_pct"),
            "noise_floor_pct": options.noise_floor_pct if one_run_a_side else None,
            "noise_floor_source": options.noise_floor_source if one_run_a_side else None,
            "noise_floor_runs": options.noise_floor_runs if one_run_a_side else None,
            "equivalence_margin_pct": options.equivalence_margin_pct,
            "within_run_drift_pct": step.get("drift_pct"),
        },
        "notes": comparison_notes(side_a, side_b, blocking, options),
        # Memory trend and utilization (issue 15): figures side by side, not judged.
        "resources": resources.resource_deltas(side_a, side_b),
        "input_pipeline": input_pipeline.compare_breakdowns(first_a, first_b),
        "rules": rules,
        "method": "; ".join(rules),
    }


def _moved(fields: dict[str, dict[str, Any]]) -> list[str]:
    return [e["label"] for f, e in fields.items() if f != schema.STEP and e.get("significant")]


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
