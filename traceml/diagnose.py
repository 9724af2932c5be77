"""Summary -> verdicts: what is slow, how sure we are, and what to try next. Pure.

Each verdict is a dict: ``kind``, ``severity`` (critical / warn / info), ``why`` (one sentence
with the number), ``next`` (one sentence: what to try) and ``evidence`` (the figures used).
They come ordered by severity, then by how much of the step they explain; the first is the
headline. Thresholds come from :mod:`traceml.thresholds` (overridable).
"""

from __future__ import annotations

from typing import Any

from traceml import schema, stats
from traceml.thresholds import resolve_thresholds

INPUT_BOUND = "INPUT_BOUND"
H2D_BOUND = "H2D_BOUND"
COMPUTE_BOUND = "COMPUTE_BOUND"
OPTIMIZER_HEAVY = "OPTIMIZER_HEAVY"
RESIDUAL_HEAVY = "RESIDUAL_HEAVY"
STRAGGLER = "STRAGGLER"
MEMORY_PRESSURE = "MEMORY_PRESSURE"
INSUFFICIENT_DATA = "INSUFFICIENT_DATA"
NO_CLEAR_BOTTLENECK = "NO_CLEAR_BOTTLENECK"
NOT_TRACED = "NOT_TRACED"

SEVERITY_ORDER = {"critical": 0, "warn": 1, "info": 2}

_NEXT = {
    INPUT_BOUND: (
        "Feed the GPU faster: raise DataLoader num_workers{workers}, set pin_memory=True and "
        "persistent_workers=True, or make per-sample decoding and augmentation cheaper."
    ),
    H2D_BOUND: (
        "Use pinned memory with non_blocking copies, send smaller tensors (uint8 images, "
        "normalise on the device), or keep augmentation on the device light (RF-DETR's "
        "on_after_batch_transfer counts as H2D)."
    ),
    OPTIMIZER_HEAVY: (
        "Try a fused or foreach optimizer (e.g. AdamW(fused=True)), fewer parameter groups, "
        "or gradient accumulation to step less often; clipping and EMA updates count here too."
    ),
    RESIDUAL_HEAVY: (
        "Residual is the loss, Hungarian matching, logging and callbacks: profile "
        "training_step around the model call (torch.profiler) and log less often."
    ),
    COMPUTE_BOUND: (
        "The model is the bottleneck, as it should be: for more speed try mixed precision, "
        "a larger batch per device, channels_last, or a smaller resolution or model."
    ),
    MEMORY_PRESSURE: (
        "Lower the batch size or resolution, or use mixed precision or activation "
        "checkpointing: near capacity the allocator fragments, retries and slows down."
    ),
    NO_CLEAR_BOTTLENECK: (
        "Nothing stands out; change one thing at a time and check it with `traceml compare`."
    ),
}

_STRAGGLER_NEXT = {
    schema.INPUT_WAIT: "check that rank's data shard and its host's CPU and storage",
    schema.H2D: "check that rank's PCIe/NUMA placement (pinned memory, CPU affinity)",
    schema.FORWARD: "check that rank's device (clocks, thermal throttling, other jobs on it)",
    schema.OPTIMIZER: "check that rank's device and any rank-specific work in the step",
    schema.RESIDUAL: "look for rank-specific work in training_step (logging, saving on rank 0)",
}


def label(kind: str) -> str:
    """``INPUT_BOUND`` -> ``INPUT-BOUND`` (how verdicts are printed)."""
    return kind.replace("_", "-")


def _pct(value: float) -> str:
    return f"{value * 100:.0f}%"


def _verdict(
    kind: str, severity: str, why: str, next_step: str, weight: float, **evidence: Any
) -> dict[str, Any]:
    return {
        "kind": kind,
        "severity": severity,
        "why": why,
        "next": next_step,
        "evidence": evidence,
        "_weight": weight,
    }


def _level(value: float | None, warn: float, critical: float) -> str | None:
    if value is None:
        return None
    if value >= critical:
        return "critical"
    if value >= warn:
        return "warn"
    return None


def diagnose(
    summary: dict[str, Any], thresholds: dict[str, float] | None = None
) -> list[dict[str, Any]]:
    """Verdicts for ``summary``, most important first (never empty)."""
    limits = resolve_thresholds(thresholds or summary.get(schema.SUMMARY_THRESHOLDS) or {})
    overall = summary.get(schema.SUMMARY_OVERALL) or {}
    phase_stats = overall.get(schema.PHASE_STATS) or {}
    step = phase_stats.get(schema.STEP)
    verdicts: list[dict[str, Any]] = []

    if not step:
        if summary.get(schema.SUMMARY_STATUS) == "unsupported":
            reasons = [n for n in summary.get(schema.SUMMARY_NOTES, []) if "not traced" in n]
            why = reasons[0] if reasons else "this configuration is not supported"
            return [
                _finish(
                    _verdict(
                        NOT_TRACED,
                        "warn",
                        f"Nothing was measured: {why}.",
                        "See the README's list of supported setups; training itself ran as usual.",
                        1.0,
                    )
                )
            ]
        return [
            _finish(
                _verdict(
                    INSUFFICIENT_DATA,
                    "warn",
                    "No training step was recorded.",
                    "Run at least a few dozen optimizer steps (check that training started).",
                    1.0,
                    steps=0,
                )
            )
        ]

    min_steps = int(limits["min_steps"])
    per_rank_steps = [
        e.get(schema.SUMMARY_STEPS_ANALYSED, 0)
        for e in summary.get(schema.SUMMARY_RANKS, [])
        if e.get(schema.SUMMARY_STEPS_RECORDED)
    ]
    fewest = min(per_rank_steps) if per_rank_steps else step["count"]
    if fewest < min_steps:
        shares = overall.get(schema.SHARES) or {}
        largest = max(
            (p for p in schema.PHASES if shares.get(p) is not None),
            key=lambda p: shares[p],
            default=None,
        )
        hint = (
            f"; so far {schema.PHASE_LABELS[largest]} is the largest phase "
            f"({_pct(shares[largest])})"
            if largest
            else ""
        )
        return [
            _finish(
                _verdict(
                    INSUFFICIENT_DATA,
                    "warn",
                    f"Only {fewest} steady step{'s' if fewest != 1 else ''} per rank were "
                    f"measured (at least {min_steps} are needed for a verdict){hint}.",
                    "Train longer (or raise --trace-max-steps) before drawing conclusions.",
                    1.0,
                    steps_analysed=fewest,
                    min_steps=min_steps,
                )
            )
        ]

    shares = overall.get(schema.SHARES) or {}
    means = {f: (phase_stats.get(f) or {}).get("mean") for f in schema.TIMED_FIELDS}

    def share_verdict(kind: str, phase: str, key: str, extra: str = "") -> None:
        share = shares.get(phase)
        severity = _level(share, limits[f"{key}_warn"], limits[f"{key}_critical"])
        if severity is None:
            return
        name = schema.PHASE_LABELS[phase]
        why = (
            f"{name} took {_pct(share)} of step time "
            f"({means[phase]:.1f} ms of {means[schema.STEP]:.1f} ms per step){extra}."
        )
        verdicts.append(
            _verdict(
                kind,
                severity,
                why,
                _NEXT[kind].format(workers=_workers_hint(summary)),
                share,
                share=share,
                phase_mean_ms=means[phase],
                step_mean_ms=means[schema.STEP],
                warn_at=limits[f"{key}_warn"],
                critical_at=limits[f"{key}_critical"],
            )
        )

    share_verdict(INPUT_BOUND, schema.INPUT_WAIT, "input")
    share_verdict(H2D_BOUND, schema.H2D, "h2d")
    share_verdict(OPTIMIZER_HEAVY, schema.OPTIMIZER, "optimizer")

    compute = _sum_present(shares.get(schema.FORWARD), shares.get(schema.BACKWARD))
    gpu_compute = _sum_present(shares.get(schema.GPU_FORWARD), shares.get(schema.GPU_BACKWARD))
    compute_limit = limits["compute_share"]
    gpu_busy = gpu_compute is not None and gpu_compute >= compute_limit
    if not gpu_busy:
        share_verdict(RESIDUAL_HEAVY, schema.RESIDUAL, "residual")

    best_compute = max(v for v in (compute, gpu_compute, 0.0) if v is not None)
    if best_compute >= compute_limit:
        on_gpu = gpu_compute is not None and gpu_compute >= (compute or 0.0)
        where = " of GPU time" if on_gpu else " of step time"
        verdicts.append(
            _verdict(
                COMPUTE_BOUND,
                "info",
                f"Forward + Backward took {_pct(best_compute)}{where}.",
                _NEXT[COMPUTE_BOUND],
                best_compute,
                share=best_compute,
                forward_share=shares.get(schema.FORWARD),
                backward_share=shares.get(schema.BACKWARD),
                gpu_compute_share=gpu_compute,
            )
        )

    straggler = _straggler(summary, limits)
    if straggler is not None:
        verdicts.append(straggler)
    memory = _memory(summary, limits)
    if memory is not None:
        verdicts.append(memory)

    if not any(
        v["severity"] in ("warn", "critical") or v["kind"] == COMPUTE_BOUND for v in verdicts
    ):
        largest = max(
            (p for p in schema.PHASES if shares.get(p) is not None), key=lambda p: shares[p]
        )
        verdicts.append(
            _verdict(
                NO_CLEAR_BOTTLENECK,
                "info",
                f"No phase dominates: the largest, {schema.PHASE_LABELS[largest]}, took "
                f"{_pct(shares[largest])} of step time.",
                _NEXT[NO_CLEAR_BOTTLENECK],
                0.0,
                largest_phase=largest,
                largest_share=shares[largest],
            )
        )

    verdicts.sort(key=lambda v: (SEVERITY_ORDER[v["severity"]], -v["_weight"]))
    return [_finish(v) for v in verdicts]


def _finish(verdict: dict[str, Any]) -> dict[str, Any]:
    verdict.pop("_weight", None)
    return verdict


def _sum_present(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _workers_hint(summary: dict[str, Any]) -> str:
    workers = (summary.get(schema.SUMMARY_SETUP) or {}).get("num_workers")
    return f" (now {workers})" if isinstance(workers, int) else ""


def _straggler(summary: dict[str, Any], limits: dict[str, float]) -> dict[str, Any] | None:
    imbalance = summary.get(schema.SUMMARY_IMBALANCE) or {}
    fields = imbalance.get(schema.IMBALANCE_FIELDS) or {}
    # Under DDP the fast ranks wait for the slow one inside Backward (the gradient
    # all-reduce), so whole-step times even out; a rank's own time (step minus Backward)
    # shows who is slow. Without synchronisation the step time shows it directly.
    best = None
    for basis in (schema.OWN_MS, schema.STEP):
        entry = fields.get(basis)
        if not entry or entry.get("max_over_others") is None:
            continue
        if best is None or entry["max_over_others"] > best[1]["max_over_others"]:
            best = (basis, entry)
    if best is None:
        return None
    basis, entry = best
    ratio = entry["max_over_others"]
    slowest = entry["slowest_rank"]
    reference = entry["median_of_others_ms"]
    slow_value = entry["rank_medians_ms"][str(slowest)]
    if slow_value - reference < limits["straggler_min_ms"]:
        return None
    severity = _level(ratio, limits["straggler_warn"], limits["straggler_critical"])
    if severity is None:
        return None
    excess: dict[str, float] = {}
    for phase in (schema.INPUT_WAIT, schema.H2D, schema.FORWARD, schema.OPTIMIZER, schema.RESIDUAL):
        phase_entry = fields.get(phase)
        if not phase_entry:
            continue
        value = phase_entry["rank_medians_ms"].get(str(slowest))
        if value is None:
            continue
        others = [v for rank, v in phase_entry["rank_medians_ms"].items() if rank != str(slowest)]
        excess[phase] = value - stats.quantile_sorted(sorted(others), 0.5) if others else 0.0
    cause = max(excess, key=lambda p: excess[p]) if excess else None
    if cause is not None and excess[cause] <= 0:
        cause = None
    what = "its own work (step minus Backward)" if basis == schema.OWN_MS else "its step time"
    cause_text = (
        f", mostly in {schema.PHASE_LABELS[cause]} (+{excess[cause]:.1f} ms)" if cause else ""
    )
    advice = _STRAGGLER_NEXT.get(cause, "check that rank's host and device")
    return _verdict(
        STRAGGLER,
        severity,
        f"Rank {slowest} is slow: {what} is {ratio:.2f}x the other ranks' median "
        f"({slow_value:.1f} ms vs {reference:.1f} ms){cause_text}.",
        f"The other ranks wait for rank {slowest} every step: {advice}.",
        ratio - 1.0,
        rank=slowest,
        ratio=ratio,
        basis=basis,
        rank_ms=slow_value,
        others_median_ms=reference,
        cause_phase=cause,
        excess_ms=excess,
    )


def _memory(summary: dict[str, Any], limits: dict[str, float]) -> dict[str, Any] | None:
    overall = summary.get(schema.SUMMARY_OVERALL) or {}
    setup = summary.get(schema.SUMMARY_SETUP) or {}
    capacity = setup.get(schema.DEVICE_TOTAL_MEMORY)
    peak = overall.get(schema.PEAK_RESERVED) or overall.get(schema.PEAK_ALLOCATED)
    if not capacity or not peak:
        return None
    fraction = peak / capacity
    severity = _level(fraction, limits["memory_warn"], limits["memory_critical"])
    if severity is None:
        return None
    return _verdict(
        MEMORY_PRESSURE,
        severity,
        f"Peak reserved device memory reached {_pct(fraction)} of capacity "
        f"({peak / 2**30:.1f} of {capacity / 2**30:.1f} GiB).",
        _NEXT[MEMORY_PRESSURE],
        fraction,
        peak_bytes=peak,
        capacity_bytes=capacity,
        fraction=fraction,
    )
