"""The decision: INCONCLUSIVE reasons, the verdict from the step-time estimate, the notes and
the rules printed on the Method line."""

from __future__ import annotations

from typing import Any

from traceml import schema
from traceml.analysis.compare_estimate import (
    CI_LABEL,
    EQUIVALENT,
    FASTER,
    HIDDEN_DRIFT,
    HIDDEN_NOISE_FLOOR,
    IMPROVEMENT,
    INCONCLUSIVE,
    MATERIAL_SHARE,
    MEMORY_CHANGE,
    MIN_EFFECT,
    MIN_STEPS,
    MIXED,
    NOISE_FLOOR_ASSUMED,
    NOT_MEASURED,
    REGRESSION,
    SLOWER,
    CompareOptions,
    run_estimate,
)
from traceml.analysis.compare_setup import (
    RUN_UNNAMED,
    as_text,
    listing,
    own_cost_notes,
    run_identity,
)


def inconclusive_reasons(
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
                    f"{name} ({as_text(summary.get(schema.RUN), RUN_UNNAMED)}) has only {count} "
                    f"analysed job steps (at least {MIN_STEPS} needed)"
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


def decide_verdict(
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


def _series_notes(summaries: tuple[dict[str, Any], ...]) -> list[str]:
    """Notes on summaries without a job step series. Only an absent key means an older
    traceml: a current one stores null when the run had no step to put in it."""
    older, stepless, damaged = [], [], []
    for summary in summaries:
        series = summary.get(schema.SUMMARY_JOB_SERIES)
        if isinstance(series, dict):
            continue
        name = f"{summary.get('_path') or summary.get(schema.RUN)}"
        if schema.SUMMARY_JOB_SERIES not in summary:
            older.append(name)
        elif series is None and not summary.get(schema.SUMMARY_STEPS_ANALYSED):
            stepless.append(name)
        else:
            damaged.append(name)
    approximate = "its intervals are approximate (steps taken as independent, pooled over ranks)"
    notes = []
    if older:
        notes.append(f"older summary without a job step series ({listing(older)}): {approximate}")
    if damaged:
        notes.append(f"no usable job step series ({listing(damaged)}): {approximate}")
    if stepless:
        notes.append(f"no job step series ({listing(stepless)}): the run recorded no steps")
    return notes


def comparison_notes(
    side_a: list[dict[str, Any]],
    side_b: list[dict[str, Any]],
    blocking: list[str],
    options: CompareOptions,
) -> list[str]:
    notes = _series_notes((*side_a, *side_b))
    if blocking and options.allow_setup_change:
        notes.append("setup change accepted (--allow-setup-change): " + "; ".join(blocking))
    unfinished = [
        f"{s.get('_path') or s.get(schema.RUN)} ({s.get(schema.SUMMARY_STATUS)})"
        for s in (*side_a, *side_b)
        if s.get(schema.SUMMARY_STATUS) not in (None, schema.RUN_COMPLETED)
    ]
    if unfinished:
        notes.append(
            "not a completed run (" + listing(unfinished) + "): its figures cover only the steps "
            "it recorded; its own report says what happened"
        )
    notes.extend(own_cost_notes(side_a, side_b))
    notes.extend(_same_run_notes(side_a, side_b))
    return notes


def _same_run_notes(side_a: list[dict[str, Any]], side_b: list[dict[str, Any]]) -> list[str]:
    """A run given on both sides (the same file twice, or a copy of it): no change by
    construction, which a user comparing before with after did not mean to ask."""

    in_a = {run_identity(s): s for s in side_a}  # (a copy reported again is the same run)
    both = [s for s in side_b if run_identity(s) in in_a]
    if not both:
        return []
    names = [str(s.get(schema.RUN) or s.get("_path") or RUN_UNNAMED) for s in both]
    return [
        f"the same run on both sides ({listing(names)}): it cannot show a change; "
        "compare the run before your change with one after it"
    ]


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
    change = format_pct(step.get("change_pct"))
    if interval is None:
        why.append("step time has no interval (too few steps to estimate the noise)")
    elif step.get("hidden_rule") == HIDDEN_NOISE_FLOOR:
        why.append(f"step time {change} is within the {options.noise_floor_pct:.3g}% noise floor")
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
            f"runs too noisy: {noise}; {CI_LABEL} {format_interval(interval)} exceeds the "
            f"+-{margin:g}% margin"
        )
    if drifting and step.get("hidden_rule") != HIDDEN_DRIFT:
        why.append(f"the runs drift by up to {drift:.1f}% within themselves (first vs second half)")
    if one_run_a_side:
        why.append("run-to-run noise is unknown with one run a side: compare 3 runs a side")
    return INCONCLUSIVE, why


def method_rules(
    options: CompareOptions, one_run_a_side: bool, runs_a: int, runs_b: int
) -> list[str]:
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
            f"{options.noise_floor_pct:.3g}% noise floor and each run's first-vs-second-half drift"
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


def format_pct(value: float | None, signed: bool = True) -> str:
    if value is None:
        return "-"
    return f"{value:+.1f}%" if signed else f"{value:.1f}%"


def format_interval(interval: list[float]) -> str:
    return f"{interval[0]:+.1f}% .. {interval[1]:+.1f}%"


def floor_is_a_guess(result: dict[str, Any]) -> bool:
    """One run a side and the default floor: run-to-run noise is neither known nor bounded."""
    noise = result["noise"]
    return noise["run_to_run"] == "unknown" and noise.get("noise_floor_source") in (
        None,
        NOISE_FLOOR_ASSUMED,
    )
