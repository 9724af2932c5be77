"""Verdicts on where a step's time goes: no data, too few steps, a phase's share (input,
H2D, optimizer, residual), compute-bound, no clear bottleneck; the noisy-steps caveat."""

from __future__ import annotations

from typing import Any

from traceml import schema
from traceml.analysis.diagnose_base import (
    COMPUTE_BOUND,
    H2D_BOUND,
    INFO,
    INPUT_BOUND,
    INPUT_NEXT_ON_CPU,
    INSUFFICIENT_DATA,
    NEXT_STEPS,
    NO_CLEAR_BOTTLENECK,
    NOT_TRACED,
    OPTIMIZER_HEAVY,
    RESIDUAL_BY_INTEGRATION,
    RESIDUAL_HEAVY,
    STEP_END_BY_INTEGRATION,
    WARN,
    PhaseView,
    new_verdict,
    pct,
    severity_for,
    step_stats,
)
from traceml.thresholds import known_thresholds, resolve_thresholds


def no_data(summary: dict[str, Any]) -> dict[str, Any] | None:
    """NOT_TRACED or INSUFFICIENT_DATA when no step was recorded at all."""
    if step_stats(summary):
        return None
    if summary.get(schema.SUMMARY_STATUS) == schema.RUN_UNSUPPORTED:
        reasons = [
            entry[schema.NOT_TRACED_REASON]
            for entry in summary.get(schema.SUMMARY_RANKS) or []
            if isinstance(entry.get(schema.NOT_TRACED_REASON), str)
        ]
        why = reasons[0] if reasons else "this configuration is not supported"
        return new_verdict(
            NOT_TRACED,
            WARN,
            f"Nothing was measured: not traced: {why}.",
            "See the README's list of supported setups; training itself ran as usual.",
            1.0,
        )
    return new_verdict(
        INSUFFICIENT_DATA,
        WARN,
        "No training step was recorded.",
        "Run at least a few dozen optimizer steps; if training did run, the notes say why no "
        "step was kept (a process killed before its first write keeps none).",
        1.0,
        steps=0,
    )


def _largest_phase(shares: dict[str, Any]) -> str | None:
    return max(
        (p for p in schema.PHASES if shares.get(p) is not None),
        key=lambda p: shares[p],
        default=None,
    )


def _measured_steps(entry: dict[str, Any]) -> int:
    """A rank's analysed steps whose step time was measured (a step whose values were all
    damaged, cleaned to null, is a record, not a measurement)."""
    step = (entry.get(schema.PHASE_STATS) or {}).get(schema.STEP)
    measured = step.get("count", 0) if isinstance(step, dict) else 0
    return min(entry.get(schema.SUMMARY_STEPS_ANALYSED, 0), measured)


def insufficient(summary: dict[str, Any], limits: dict[str, float]) -> dict[str, Any] | None:
    """INSUFFICIENT_DATA when some rank has fewer steady steps than a verdict needs."""
    min_steps = int(limits["min_steps"])
    per_rank_steps = [
        _measured_steps(e)
        for e in summary.get(schema.SUMMARY_RANKS, [])
        if e.get(schema.SUMMARY_STEPS_RECORDED)
    ]
    fewest = min(per_rank_steps) if per_rank_steps else step_stats(summary)["count"]
    if fewest >= min_steps:
        return None
    shares = (summary.get(schema.SUMMARY_OVERALL) or {}).get(schema.SHARES) or {}
    largest = _largest_phase(shares)
    hint = (
        f"; so far {schema.PHASE_LABELS[largest]} is the largest phase ({pct(shares[largest])})"
        if largest
        else ""
    )
    return new_verdict(
        INSUFFICIENT_DATA,
        WARN,
        f"Only {fewest} steady step{'s' if fewest != 1 else ''} per rank were "
        f"measured (at least {min_steps} are needed for a verdict){hint}.",
        "Train longer (or raise --trace-max-steps) before drawing conclusions.",
        1.0,
        steps_analysed=fewest,
        min_steps=min_steps,
    )


# Residual holds a phase that went unmeasured: said before the advice.
UNMEASURED = {
    schema.FORWARD: (
        "Forward was not measured, so the model's forward is in Residual (with Lightning, "
        "traceml times the LightningModule's forward, its `model`, or, where it defines no "
        "forward, its largest submodule; a training_step that calls another one is not seen). "
    ),
    schema.BACKWARD: (
        "Backward was not measured, so the backward pass is in Residual (traceml times "
        "loss.backward(); gradients taken with torch.autograd.grad are not seen). "
    ),
}

# Phase verdicts judged on share of step time: (kind, phase, threshold key prefix).
_SHARE_RULES: tuple[tuple[str, str, str], ...] = (
    (INPUT_BOUND, schema.INPUT_WAIT, "input"),
    (H2D_BOUND, schema.H2D, "h2d"),
    (OPTIMIZER_HEAVY, schema.OPTIMIZER, "optimizer"),
    (RESIDUAL_HEAVY, schema.RESIDUAL, "residual"),
)


def share_verdicts(
    summary: dict[str, Any], view: PhaseView, limits: dict[str, float]
) -> list[dict[str, Any]]:
    _host, device = view.compute_shares()
    # When the device is busy computing, Residual is host time spent while it works (kernel
    # launches queue ahead): not a bottleneck of its own.
    device_busy = device is not None and device >= limits["compute_share"]
    verdicts = []
    for kind, phase, key in _SHARE_RULES:
        if kind == RESIDUAL_HEAVY and device_busy:
            continue
        verdict = _share_verdict(summary, view, limits, kind, phase, key)
        if verdict is not None:
            verdicts.append(verdict)
    return verdicts


def _share_verdict(
    summary: dict[str, Any],
    view: PhaseView,
    limits: dict[str, float],
    kind: str,
    phase: str,
    key: str,
) -> dict[str, Any] | None:
    share = view.shares.get(phase)
    severity = severity_for(share, limits[f"{key}_warn"], limits[f"{key}_critical"])
    if severity is None:
        return None
    mean, step_mean = view.means[phase], view.means[schema.STEP]
    own = " (its own time, not counting waits on other ranks)" if view.own else ""
    setup = summary.get(schema.SUMMARY_SETUP) or {}
    text = NEXT_STEPS[kind]
    if kind == INPUT_BOUND and setup.get("device") == "cpu":
        text = INPUT_NEXT_ON_CPU
    next_step = text.format(workers=_workers_hint(summary))
    if kind == RESIDUAL_HEAVY:
        integration = setup.get(schema.INTEGRATION)
        next_step = RESIDUAL_BY_INTEGRATION.get(integration, next_step)
        unmeasured = [words for p, words in UNMEASURED.items() if view.means.get(p) is None]
        next_step = "".join(unmeasured) + next_step
    input_advice = _input_advice(summary, mean, step_mean) if kind == INPUT_BOUND else None
    return new_verdict(
        kind,
        severity,
        f"{schema.PHASE_LABELS[phase]} took {pct(share)} of step time{own} "
        f"({mean:.1f} ms of {step_mean:.1f} ms per step).",
        input_advice[0] if input_advice else next_step,
        share,
        **({"input_pipeline": input_advice[1]} if input_advice else {}),
        share=share,
        phase_mean_ms=mean,
        step_mean_ms=step_mean,
        warn_at=limits[f"{key}_warn"],
        critical_at=limits[f"{key}_critical"],
    )


def compute_bound(view: PhaseView, limits: dict[str, float]) -> dict[str, Any] | None:
    """COMPUTE_BOUND (the healthy case): Forward + Backward dominate, on either clock."""
    host, device = view.compute_shares()
    best = max(v for v in (host, device, 0.0) if v is not None)
    if best < limits["compute_share"]:
        return None
    on_device = device is not None and device >= (host or 0.0)
    return new_verdict(
        COMPUTE_BOUND,
        INFO,
        f"Forward + Backward took {pct(best)}{' of GPU time' if on_device else ' of step time'}.",
        NEXT_STEPS[COMPUTE_BOUND],
        best,
        share=best,
        forward_share=view.shares.get(schema.FORWARD),
        backward_share=view.shares.get(schema.BACKWARD),
        gpu_compute_share=device,
    )


def no_clear_bottleneck(view: PhaseView) -> dict[str, Any]:
    largest = _largest_phase(view.shares)
    if largest is None:  # steps of zero length: no share to speak of
        why = "No phase dominates: the recorded steps took no measurable time."
    else:
        why = (
            f"No phase dominates: the largest, {schema.PHASE_LABELS[largest]}, took "
            f"{pct(view.shares[largest])} of step time."
        )
    return new_verdict(
        NO_CLEAR_BOTTLENECK,
        INFO,
        why,
        NEXT_STEPS[NO_CLEAR_BOTTLENECK],
        0.0,
        largest_phase=largest,
        largest_share=view.shares[largest] if largest else None,
    )


def noise_caveat(summary: dict[str, Any], thresholds: dict[str, float] | None = None) -> str | None:
    """A sentence for the report when step times are very uneven (p90 / median at or above
    the ``noisy_steps`` threshold), saying what that means for the verdict; else None."""
    limits = resolve_thresholds(
        thresholds or known_thresholds(summary.get(schema.SUMMARY_THRESHOLDS))
    )
    step = step_stats(summary)
    if not step or not step.get("median") or step["median"] <= 0:
        return None
    ratio = step["p90"] / step["median"]
    if ratio < limits["noisy_steps"]:
        return None
    return (
        f"step times are very uneven (p90 {step['p90']:.1f} ms is {ratio:.1f}x the median "
        f"{step['median']:.1f} ms; max {step['max']:.1f} ms). Shares are of the total time, so "
        "the slow steps weigh most: the verdict describes where they spend their time, not a "
        "typical step. See when they happen in report.html (--html): periodic spikes point at "
        "logging, checkpoints or garbage collection, a rising line at a leak."
    )


def outside_caveat(
    summary: dict[str, Any], thresholds: dict[str, float] | None = None
) -> str | None:
    """A sentence for the report when most of the time from the first step to the last was
    between steps (at or above the ``outside_steps`` threshold): no verdict and no steps/s
    sees it."""
    limits = resolve_thresholds(
        thresholds or known_thresholds(summary.get(schema.SUMMARY_THRESHOLDS))
    )
    overall = summary.get(schema.SUMMARY_OVERALL) or {}
    between, wall = overall.get(schema.BETWEEN_STEPS_MS), overall.get(schema.WALL_MS)
    if not between or not wall or between / wall < limits["outside_steps"]:
        return None
    integration = (summary.get(schema.SUMMARY_SETUP) or {}).get(schema.INTEGRATION)
    where = STEP_END_BY_INTEGRATION.get(integration, STEP_END_BY_INTEGRATION["torch"])
    return (
        f"{pct(between / wall)} of the time from the first step to the last "
        f"({between / 1000:.2f} s of {wall / 1000:.2f} s) was between steps, which the verdict "
        f"and the throughput leave out. {where}; validation, checkpoints and epoch ends too "
        "(each step's gap_ms in the rank files says which)."
    )


def _input_advice(
    summary: dict[str, Any], input_wait_ms: float, step_ms: float
) -> tuple[str, dict[str, Any]] | None:
    """INPUT_BOUND with the workers' breakdown: which part dominates, what to change, and by
    how much (traceml/analysis/input_pipeline.py)."""
    from traceml.analysis import input_pipeline

    setup = summary.get(schema.SUMMARY_SETUP) or {}
    micro = (summary.get(schema.SUMMARY_OVERALL) or {}).get(schema.PHASE_STATS) or {}
    microbatches = ((micro.get(schema.MICROBATCHES) or {}).get("mean")) or 1.0
    return input_pipeline.advice(
        summary.get(schema.SUMMARY_INPUT_PIPELINE),
        step_ms,
        input_wait_ms,
        integration=setup.get(schema.INTEGRATION),
        microbatches=microbatches,
    )


def _workers_hint(summary: dict[str, Any]) -> str:
    workers = (summary.get(schema.SUMMARY_SETUP) or {}).get("num_workers")
    return f" (now {workers})" if isinstance(workers, int) else ""


# Where a straggler's extra own time can lie, and the per-rank field that holds it: with comm
# timing, each phase minus the waits inside it (Backward then means gradient computation);
