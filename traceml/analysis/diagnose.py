"""Summary -> verdicts: what is slow, how sure we are, and what to try next. Pure.

Each verdict is a dict: ``kind``, ``severity`` (critical / warn / info), ``why`` (one sentence
with the number), ``next`` (one sentence: what to try) and ``evidence`` (the figures used).
They come ordered by severity, then by how much of the step they explain; the first is the
headline. Thresholds come from :mod:`traceml.thresholds` (overridable).
"""

from __future__ import annotations

import math
from typing import Any

from traceml import schema
from traceml.analysis import resources, stats
from traceml.thresholds import resolve_thresholds

# The kinds and severities are schema constants; these names are kept for readers' convenience.
INPUT_BOUND = schema.VERDICT_INPUT_BOUND
H2D_BOUND = schema.VERDICT_H2D_BOUND
COMPUTE_BOUND = schema.VERDICT_COMPUTE_BOUND
OPTIMIZER_HEAVY = schema.VERDICT_OPTIMIZER_HEAVY
RESIDUAL_HEAVY = schema.VERDICT_RESIDUAL_HEAVY
STRAGGLER = schema.VERDICT_STRAGGLER
COMM_BOUND = schema.VERDICT_COMM_BOUND
MEMORY_PRESSURE = schema.VERDICT_MEMORY_PRESSURE
INSUFFICIENT_DATA = schema.VERDICT_INSUFFICIENT_DATA
NO_CLEAR_BOTTLENECK = schema.VERDICT_NO_CLEAR_BOTTLENECK
NOT_TRACED = schema.VERDICT_NOT_TRACED

CRITICAL = schema.SEVERITY_CRITICAL
WARN = schema.SEVERITY_WARN
INFO = schema.SEVERITY_INFO
SEVERITY_ORDER = {severity: order for order, severity in enumerate(schema.SEVERITIES)}

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
    COMM_BOUND: (
        "Communicate less often or overlap it better: gradient accumulation (DDP skips the "
        "all-reduce on accumulating microbatches via no_sync), a larger bucket_cap_mb, "
        "gradient_as_bucket_view=True, a compression hook (fp16/bf16 or PowerSGD), fewer "
        "collectives in training_step (sync_dist logging), or a faster interconnect."
    ),
    NO_CLEAR_BOTTLENECK: (
        "Nothing stands out; change one thing at a time and check it with `traceml compare`."
    ),
}

_STRAGGLER_NEXT = {
    schema.INPUT_WAIT: "check that rank's data shard and its host's CPU and storage",
    schema.BACKWARD: (
        "check that rank's device (clocks, thermal throttling, other jobs on it) and any "
        "rank-specific gradient hooks"
    ),
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
        schema.VERDICT_KIND: kind,
        schema.VERDICT_SEVERITY: severity,
        schema.VERDICT_WHY: why,
        schema.VERDICT_NEXT: next_step,
        schema.VERDICT_EVIDENCE: evidence,
        "_weight": weight,
    }


def _level(value: float | None, warn: float, critical: float) -> str | None:
    if value is None:
        return None
    if value >= critical:
        return CRITICAL
    if value >= warn:
        return WARN
    return None


def diagnose(
    summary: dict[str, Any], thresholds: dict[str, float] | None = None
) -> list[dict[str, Any]]:
    """Verdicts for ``summary``, most important first (never empty)."""
    limits = resolve_thresholds(thresholds or summary.get(schema.SUMMARY_THRESHOLDS) or {})
    early = _no_data(summary) or _insufficient(summary, limits)
    if early is not None:
        return [_finish(early)]
    view = _PhaseView.of(summary)
    verdicts = _share_verdicts(summary, view, limits)
    compute = _compute_bound(view, limits)
    if compute is not None:
        verdicts.append(compute)
    straggler = _straggler(summary, limits)
    found = [straggler, _comm_bound(summary, limits), _memory(summary, limits)]
    verdicts.extend(verdict for verdict in found if verdict is not None)
    if not any(_is_finding(verdict) for verdict in verdicts):
        verdicts.append(_no_clear_bottleneck(view))
    verdicts.extend(resource_verdicts(summary, view, limits))
    verdicts.sort(key=lambda v: (SEVERITY_ORDER[v[schema.VERDICT_SEVERITY]], -v["_weight"]))
    return [_finish(v) for v in verdicts]


def _is_finding(verdict: dict[str, Any]) -> bool:
    """A verdict that says something: a warning, or the healthy COMPUTE_BOUND."""
    return (
        verdict[schema.VERDICT_SEVERITY] in (WARN, CRITICAL)
        or verdict[schema.VERDICT_KIND] == COMPUTE_BOUND
    )


def _step_stats(summary: dict[str, Any]) -> dict[str, Any] | None:
    overall = summary.get(schema.SUMMARY_OVERALL) or {}
    return (overall.get(schema.PHASE_STATS) or {}).get(schema.STEP)


def _no_data(summary: dict[str, Any]) -> dict[str, Any] | None:
    """NOT_TRACED or INSUFFICIENT_DATA when no step was recorded at all."""
    if _step_stats(summary):
        return None
    if summary.get(schema.SUMMARY_STATUS) == schema.RUN_UNSUPPORTED:
        reasons = [
            entry[schema.NOT_TRACED_REASON]
            for entry in summary.get(schema.SUMMARY_RANKS) or []
            if isinstance(entry.get(schema.NOT_TRACED_REASON), str)
        ]
        why = reasons[0] if reasons else "this configuration is not supported"
        return _verdict(
            NOT_TRACED,
            WARN,
            f"Nothing was measured: not traced: {why}.",
            "See the README's list of supported setups; training itself ran as usual.",
            1.0,
        )
    return _verdict(
        INSUFFICIENT_DATA,
        WARN,
        "No training step was recorded.",
        "Run at least a few dozen optimizer steps (check that training started).",
        1.0,
        steps=0,
    )


def _largest_phase(shares: dict[str, Any]) -> str | None:
    return max(
        (p for p in schema.PHASES if shares.get(p) is not None),
        key=lambda p: shares[p],
        default=None,
    )


def _insufficient(summary: dict[str, Any], limits: dict[str, float]) -> dict[str, Any] | None:
    """INSUFFICIENT_DATA when some rank has fewer steady steps than a verdict needs."""
    min_steps = int(limits["min_steps"])
    per_rank_steps = [
        e.get(schema.SUMMARY_STEPS_ANALYSED, 0)
        for e in summary.get(schema.SUMMARY_RANKS, [])
        if e.get(schema.SUMMARY_STEPS_RECORDED)
    ]
    fewest = min(per_rank_steps) if per_rank_steps else _step_stats(summary)["count"]
    if fewest >= min_steps:
        return None
    shares = (summary.get(schema.SUMMARY_OVERALL) or {}).get(schema.SHARES) or {}
    largest = _largest_phase(shares)
    hint = (
        f"; so far {schema.PHASE_LABELS[largest]} is the largest phase ({_pct(shares[largest])})"
        if largest
        else ""
    )
    return _verdict(
        INSUFFICIENT_DATA,
        WARN,
        f"Only {fewest} steady step{'s' if fewest != 1 else ''} per rank were "
        f"measured (at least {min_steps} are needed for a verdict){hint}.",
        "Train longer (or raise --trace-max-steps) before drawing conclusions.",
        1.0,
        steps_analysed=fewest,
        min_steps=min_steps,
    )


class _PhaseView:
    """The shares and mean times the phase verdicts judge. With comm timing, each phase is its
    own time: waiting on other ranks is the straggler's or the network's doing (STRAGGLER and
    COMM_BOUND say so), not the phase's."""

    def __init__(self, shares: dict[str, Any], means: dict[str, Any], own: bool) -> None:
        self.shares = shares
        self.means = means
        self.own = own

    @classmethod
    def of(cls, summary: dict[str, Any]) -> _PhaseView:
        overall = summary.get(schema.SUMMARY_OVERALL) or {}
        phase_stats = overall.get(schema.PHASE_STATS) or {}
        shares = dict(overall.get(schema.SHARES) or {})
        means = {f: (phase_stats.get(f) or {}).get("mean") for f in schema.TIMED_FIELDS}
        own = shares.get(schema.OWN_OF_PHASE[schema.BACKWARD]) is not None
        if own:
            for phase in schema.PHASES:
                shares[phase] = shares.get(schema.OWN_OF_PHASE[phase])
                means[phase] = (phase_stats.get(schema.OWN_OF_PHASE[phase]) or {}).get("mean")
        return cls(shares, means, own)

    def compute_shares(self) -> tuple[float | None, float | None]:
        """Forward + Backward on the host clock, and on the device clock (None: unmeasured)."""
        host = _sum_present(self.shares.get(schema.FORWARD), self.shares.get(schema.BACKWARD))
        device = _sum_present(
            self.shares.get(schema.GPU_FORWARD), self.shares.get(schema.GPU_BACKWARD)
        )
        return host, device


# Phase verdicts judged on share of step time: (kind, phase, threshold key prefix).
_SHARE_RULES: tuple[tuple[str, str, str], ...] = (
    (INPUT_BOUND, schema.INPUT_WAIT, "input"),
    (H2D_BOUND, schema.H2D, "h2d"),
    (OPTIMIZER_HEAVY, schema.OPTIMIZER, "optimizer"),
    (RESIDUAL_HEAVY, schema.RESIDUAL, "residual"),
)


def _share_verdicts(
    summary: dict[str, Any], view: _PhaseView, limits: dict[str, float]
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
    view: _PhaseView,
    limits: dict[str, float],
    kind: str,
    phase: str,
    key: str,
) -> dict[str, Any] | None:
    share = view.shares.get(phase)
    severity = _level(share, limits[f"{key}_warn"], limits[f"{key}_critical"])
    if severity is None:
        return None
    mean, step_mean = view.means[phase], view.means[schema.STEP]
    own = " (its own time, not counting waits on other ranks)" if view.own else ""
    next_step = _NEXT[kind].format(workers=_workers_hint(summary))
    input_advice = _input_advice(summary, mean, step_mean) if kind == INPUT_BOUND else None
    return _verdict(
        kind,
        severity,
        f"{schema.PHASE_LABELS[phase]} took {_pct(share)} of step time{own} "
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


def _compute_bound(view: _PhaseView, limits: dict[str, float]) -> dict[str, Any] | None:
    """COMPUTE_BOUND (the healthy case): Forward + Backward dominate, on either clock."""
    host, device = view.compute_shares()
    best = max(v for v in (host, device, 0.0) if v is not None)
    if best < limits["compute_share"]:
        return None
    on_device = device is not None and device >= (host or 0.0)
    return _verdict(
        COMPUTE_BOUND,
        INFO,
        f"Forward + Backward took {_pct(best)}{' of GPU time' if on_device else ' of step time'}.",
        _NEXT[COMPUTE_BOUND],
        best,
        share=best,
        forward_share=view.shares.get(schema.FORWARD),
        backward_share=view.shares.get(schema.BACKWARD),
        gpu_compute_share=device,
    )


def _no_clear_bottleneck(view: _PhaseView) -> dict[str, Any]:
    largest = _largest_phase(view.shares)
    if largest is None:  # steps of zero length: no share to speak of
        why = "No phase dominates: the recorded steps took no measurable time."
    else:
        why = (
            f"No phase dominates: the largest, {schema.PHASE_LABELS[largest]}, took "
            f"{_pct(view.shares[largest])} of step time."
        )
    return _verdict(
        NO_CLEAR_BOTTLENECK,
        INFO,
        why,
        _NEXT[NO_CLEAR_BOTTLENECK],
        0.0,
        largest_phase=largest,
        largest_share=view.shares[largest] if largest else None,
    )


def noise_caveat(summary: dict[str, Any], thresholds: dict[str, float] | None = None) -> str | None:
    """A sentence for the report when step times are very uneven (p90 / median at or above
    the ``noisy_steps`` threshold), saying what that means for the verdict; else None."""
    limits = resolve_thresholds(thresholds or summary.get(schema.SUMMARY_THRESHOLDS) or {})
    step = _step_stats(summary)
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


def _finish(verdict: dict[str, Any]) -> dict[str, Any]:
    verdict.pop("_weight", None)
    return verdict


def _sum_present(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


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
# on CUDA the device-side own times (NCCL waits are invisible to the host clock).
_OWN_PHASE_FIELDS = {phase: schema.OWN_OF_PHASE[phase] for phase in schema.PHASES}
_GPU_OWN_PHASE_FIELDS = {
    schema.INPUT_WAIT: schema.OWN_OF_PHASE[schema.INPUT_WAIT],
    **{phase: field for phase, field in schema.GPU_OWN_OF_PHASE.items()},
}
# Without comm timing (older files): phases as measured; Backward is left out because it holds
# DDP's wait for the other ranks on gloo.
_LEGACY_PHASE_FIELDS = {
    phase: phase
    for phase in (schema.INPUT_WAIT, schema.H2D, schema.FORWARD, schema.OPTIMIZER, schema.RESIDUAL)
}


def _straggler_basis(fields: dict[str, Any]) -> tuple[str, dict[str, str], str] | None:
    """(own-time field, phase -> field for the cause, how own time was measured)."""
    if _compared(fields, schema.GPU_OWN_MS):
        return schema.GPU_OWN_MS, _GPU_OWN_PHASE_FIELDS, "device"
    if _compared(fields, schema.OWN_OF_PHASE[schema.BACKWARD]):
        return schema.OWN_MS, _OWN_PHASE_FIELDS, "waits"
    candidates = [f for f in (schema.OWN_MS, schema.STEP) if _compared(fields, f)]
    if not candidates:
        return None
    # Older files: step minus Backward (DDP's wait on gloo), or the step itself when the ranks
    # do not synchronise; whichever separates the slowest rank more.
    basis = max(candidates, key=lambda f: fields[f]["max_over_others"])
    return basis, _LEGACY_PHASE_FIELDS, "legacy"


def _compared(fields: dict[str, Any], fieldname: str) -> bool:
    entry = fields.get(fieldname)
    return bool(entry) and entry.get("max_over_others") is not None


def _phase_excess(fields: dict[str, Any], phase_fields: dict[str, str], rank: int) -> dict:
    """Per phase: the rank's median own time minus the other ranks' median of it."""
    excess: dict[str, float] = {}
    for phase, fieldname in phase_fields.items():
        entry = fields.get(fieldname)
        if not entry:
            continue
        medians = entry["rank_medians_ms"]
        value = medians.get(str(rank))
        others = [v for key, v in medians.items() if key != str(rank)]
        if value is None or not others:
            continue
        excess[phase] = value - stats.quantile_sorted(sorted(others), 0.5)
    return excess


def _straggler(summary: dict[str, Any], limits: dict[str, float]) -> dict[str, Any] | None:
    """The rank the others wait for: the most own time (step minus its waits on the others),
    against the other ranks' median, beyond both a ratio and an absolute threshold."""
    imbalance = summary.get(schema.SUMMARY_IMBALANCE) or {}
    fields = imbalance.get(schema.IMBALANCE_FIELDS) or {}
    chosen = _straggler_basis(fields)
    if chosen is None:
        return None
    basis, phase_fields, method = chosen
    entry = fields[basis]
    ratio = entry["max_over_others"]
    slowest = entry["slowest_rank"]
    reference = entry["median_of_others_ms"]
    slow_value = entry["rank_medians_ms"][str(slowest)]
    cost = slow_value - reference
    if cost < limits["straggler_min_ms"]:
        return None
    severity = _level(ratio, limits["straggler_warn"], limits["straggler_critical"])
    if severity is None:
        return None
    excess = _phase_excess(fields, phase_fields, slowest)
    cause = max(excess, key=lambda p: excess[p]) if excess else None
    if cause is not None and excess[cause] <= 0:
        cause = None
    cause_label = _cause_label(cause, method)
    what = {
        "device": "its own time (device time not spent waiting on other ranks, plus Input Wait)",
        "waits": "its own time (step minus its waits on other ranks)",
        "legacy": (
            "its own work (step minus Backward)" if basis == schema.OWN_MS else "its step time"
        ),
    }[method]
    cause_text = f", mostly in {cause_label} (+{excess[cause]:.1f} ms)" if cause else ""
    waits = _others_wait(fields, slowest, method)
    wait_text = (
        f" (the other ranks' median wait: {waits[0]:.1f} ms per step, rank {slowest}'s: "
        f"{waits[1]:.1f} ms)"
        if waits
        else ""
    )
    advice = _STRAGGLER_NEXT.get(cause, "check that rank's host and device")
    return _verdict(
        STRAGGLER,
        severity,
        f"Rank {slowest} is slow: {what} is {ratio:.2f}x the other ranks' median "
        f"({slow_value:.1f} ms vs {reference:.1f} ms){cause_text}. It costs the job about "
        f"{cost:.1f} ms per step{wait_text}.",
        f"The other ranks wait for rank {slowest} every step: {advice}.",
        ratio - 1.0,
        rank=slowest,
        ratio=ratio,
        basis=basis,
        method=method,
        rank_ms=slow_value,
        others_median_ms=reference,
        cost_ms_per_step=cost,
        cause_phase=cause,
        excess_ms=excess,
    )


def _cause_label(cause: str | None, method: str) -> str:
    if cause is None:
        return ""
    if cause == schema.BACKWARD and method != "legacy":
        return "Backward compute"
    return schema.PHASE_LABELS[cause]


def _others_wait(fields: dict[str, Any], slowest: int, method: str) -> tuple[float, float] | None:
    entry = fields.get(schema.GPU_COMM if method == "device" else schema.COMM)
    if method == "legacy" or not entry:
        return None
    medians = entry["rank_medians_ms"]
    others = [v for key, v in medians.items() if key != str(slowest)]
    if str(slowest) not in medians or not others:
        return None
    return stats.quantile_sorted(sorted(others), 0.5), medians[str(slowest)]


def _comm_bound(summary: dict[str, Any], limits: dict[str, float]) -> dict[str, Any] | None:
    """Waiting on communication that every rank pays: the rank that waits least still waits
    this much, so it is not a straggler's doing (a straggler itself hardly waits)."""
    ranks = [e for e in summary.get(schema.SUMMARY_RANKS) or [] if e.get(schema.SHARES)]
    device = any((e[schema.SHARES] or {}).get(schema.GPU_COMM_SHARE) is not None for e in ranks)
    key = schema.GPU_COMM_SHARE if device else schema.COMM_SHARE
    shares = {
        e[schema.RANK]: e[schema.SHARES][key]
        for e in ranks
        if e[schema.SHARES].get(key) is not None
    }
    if len(shares) < 2:
        return None
    least = min(shares.values())
    severity = _level(least, limits["comm_warn"], limits["comm_critical"])
    if severity is None:
        return None
    overall = summary.get(schema.SUMMARY_OVERALL) or {}
    phase_stats = overall.get(schema.PHASE_STATS) or {}
    comm_stats = phase_stats.get(schema.GPU_COMM if device else schema.COMM) or {}
    count = (phase_stats.get(schema.COMM_COUNT) or {}).get("mean")
    nbytes = (phase_stats.get(schema.COMM_BYTES) or {}).get("mean")
    where = _comm_where(phase_stats)
    volume = ""
    if count is not None and nbytes is not None:
        volume = f"; {count:.0f} collectives and {nbytes / 2**20:.1f} MiB per step"
    clock = "device time" if device else "step time"
    return _verdict(
        COMM_BOUND,
        severity,
        f"Every rank spends at least {_pct(least)} of {clock} waiting in communication "
        f"({comm_stats.get('mean', 0.0):.1f} ms per step on average{where}{volume}), and no "
        "single rank is making the others wait.",
        _NEXT[COMM_BOUND],
        least,
        least_share=least,
        rank_shares={str(rank): share for rank, share in shares.items()},
        comm_mean_ms=comm_stats.get("mean"),
        collectives_per_step=count,
        bytes_per_step=nbytes,
        warn_at=limits["comm_warn"],
        critical_at=limits["comm_critical"],
    )


def _comm_where(phase_stats: dict[str, Any]) -> str:
    sums = {
        phase: (phase_stats.get(fieldname) or {}).get("sum") or 0.0
        for phase, fieldname in schema.COMM_OF_PHASE.items()
    }
    total = sum(sums.values())
    if total <= 0:
        return ""
    phase = max(sums, key=lambda p: sums[p])
    return f", {_pct(sums[phase] / total)} of it in {schema.PHASE_LABELS[phase]}"


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


# ----------------------------------------------------------------------------------------------
# Resources (issue 15): memory over the run, device idle time, the host's CPU and memory.
# Each judges the rank entries' TELEMETRY (traceml/analysis/resources.py) and names the worst rank.

MEMORY_CREEP = schema.VERDICT_MEMORY_CREEP
LOW_DEVICE_UTILIZATION = schema.VERDICT_LOW_DEVICE_UTILIZATION
HOST_CPU_SATURATED = schema.VERDICT_HOST_CPU_SATURATED
HOST_MEMORY_PRESSURE = schema.VERDICT_HOST_MEMORY_PRESSURE

_TREND_LABELS = {"rss": "Host memory (RSS)", "device_allocated": "Allocated device memory"}

_RESOURCE_NEXT = {
    MEMORY_CREEP: (
        "Look for state that grows every step: tensors kept in lists (losses without .item() "
        "or .detach(), outputs collected for metrics), caches keyed by batch, autograd graphs "
        "kept alive; torch.cuda.memory._record_memory_history or tracemalloc show who holds it."
    ),
    LOW_DEVICE_UTILIZATION: (
        "The device waits for the host: fix the phase named above first (more DataLoader "
        "workers or pinned memory for Input Wait and H2D; less Python, logging and syncs "
        "such as .item() in training_step for Residual); CUDA graphs cut launch overhead."
    ),
    HOST_CPU_SATURATED: (
        "The host's cores are busy, so more DataLoader workers will not help: make decoding "
        "and augmentation cheaper (smaller images on disk, GPU augmentation such as DALI or "
        "kornia), cache decoded samples, or move to a host with more cores per GPU."
    ),
    HOST_MEMORY_PRESSURE: (
        "The host is near its memory limit (swap or the OOM killer next): fewer or lighter "
        "DataLoader workers (each holds a copy of Python-object datasets), smaller "
        "prefetch_factor, or memory-mapped datasets."
    ),
}


def _telemetry_of(summary: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    return [
        (entry.get(schema.RANK), telemetry)
        for entry, telemetry in resources.telemetry_entries(summary)
    ]


def resource_verdicts(
    summary: dict[str, Any], view: _PhaseView, limits: dict[str, float]
) -> list[dict[str, Any]]:
    telemetry = _telemetry_of(summary)
    checks = [
        lambda basis=basis: _memory_creep(telemetry, basis, limits) for basis in _TREND_LABELS
    ]
    checks += [
        lambda: _low_device_utilization(telemetry, view, limits),
        lambda: _host_cpu_saturated(telemetry, view, limits, _num_workers(summary)),
        lambda: _host_memory_pressure(telemetry, limits),
    ]
    found = []
    for check in checks:
        # A damaged summary (hand-edited, another writer's) loses that verdict, not the rest.
        try:
            found.append(check())
        except (AttributeError, KeyError, TypeError, ValueError, IndexError):
            continue
    return [verdict for verdict in found if verdict is not None]


def _memory_creep(
    telemetry: list[tuple[int, dict[str, Any]]], basis: str, limits: dict[str, float]
) -> dict[str, Any] | None:
    creeping = []
    for rank, entry in telemetry:
        fit = (entry.get(schema.MEMORY_TREND) or {}).get(basis)
        if fit and fit.get("significant") and fit["growth_mb"] >= limits["memory_creep_min_mb"]:
            creeping.append((rank, fit))
    if not creeping:
        return None

    def runway(item: tuple[int, dict[str, Any]]) -> float:
        projected = item[1].get("projected_exhaustion_step")
        return projected - item[1]["last_step"] if projected is not None else math.inf

    rank, fit = min(creeping, key=lambda item: (runway(item), -item[1]["slope_mb_per_1k_steps"]))
    left = runway((rank, fit))
    if left <= limits["memory_creep_critical_steps"]:
        severity = CRITICAL
    elif left <= limits["memory_creep_warn_steps"] or fit.get("headroom_bytes") is None:
        severity = WARN
    else:
        return None  # it grows, but would take more steps than any run to run out
    slope = fit["slope_mb_per_1k_steps"]
    why = (
        f"{_TREND_LABELS[basis]} grows by {slope:,.1f} MB per 1,000 steps on rank {rank} "
        f"({fit['growth_mb']:,.0f} MB over steps {fit['first_step']}-{fit['last_step']})"
    )
    if fit.get("projected_exhaustion_step") is not None:
        why += (
            f"; at that rate its {fit['headroom_bytes'] / 2**30:,.1f} GiB of headroom runs out "
            f"around step {fit['projected_exhaustion_step']:,}"
        )
    return _verdict(
        MEMORY_CREEP,
        severity,
        why + ".",
        _RESOURCE_NEXT[MEMORY_CREEP],
        fit["growth_mb"],
        rank=rank,
        basis=basis,
        slope_mb_per_1k_steps=slope,
        growth_mb=fit["growth_mb"],
        headroom_bytes=fit.get("headroom_bytes"),
        projected_exhaustion_step=fit.get("projected_exhaustion_step"),
        ranks=[r for r, _ in creeping],
    )


# Host-side phases that leave the device waiting, and what the verdict calls them.
_HOST_PHASES = {
    schema.INPUT_WAIT: "Input Wait (the DataLoader)",
    schema.H2D: "H2D (the batch transfer and on_after_batch_transfer)",
    schema.RESIDUAL: "Residual (Python in training_step outside the model: loss, logging)",
}


def _low_device_utilization(
    telemetry: list[tuple[int, dict[str, Any]]], view: _PhaseView, limits: dict[str, float]
) -> dict[str, Any] | None:
    shares = [
        (rank, busy["share"])
        for rank, entry in telemetry
        if isinstance(busy := entry.get(schema.DEVICE_BUSY), dict) and busy.get("share") is not None
    ]
    if not shares:
        return None
    rank, busy = min(shares, key=lambda item: item[1])
    idle = 1.0 - busy
    severity = _level(idle, limits["device_idle_warn"], limits["device_idle_critical"])
    if severity is None:
        return None
    host = {phase: view.shares.get(phase) or 0.0 for phase in _HOST_PHASES}
    culprit = max(host, key=lambda phase: host[phase])
    return _verdict(
        LOW_DEVICE_UTILIZATION,
        severity,
        f"The device ran traced work for only {_pct(busy)} of step time on rank {rank}; the "
        f"largest host-side phase is {_HOST_PHASES[culprit]} at {_pct(host[culprit])}.",
        _RESOURCE_NEXT[LOW_DEVICE_UTILIZATION],
        idle,
        rank=rank,
        busy_share=busy,
        idle_share=idle,
        host_phase=culprit,
        host_phase_share=host[culprit],
    )


def _num_workers(summary: dict[str, Any]) -> int | None:
    workers = (summary.get(schema.SUMMARY_SETUP) or {}).get("num_workers")
    return workers if isinstance(workers, int) and not isinstance(workers, bool) else None


def _host_cpu_saturated(
    telemetry: list[tuple[int, dict[str, Any]]],
    view: _PhaseView,
    limits: dict[str, float],
    num_workers: int | None = None,
) -> dict[str, Any] | None:
    """The input pipeline waits and the host has no CPU to give it. Only when the DataLoader
    workers themselves burn CPU: workers that mostly wait (I/O, a remote store, a sleep) do get
    faster with more of them however busy the cores are, and the input-pipeline advice stands."""
    input_share = view.shares.get(schema.INPUT_WAIT)
    input_level = _level(input_share, limits["input_warn"], limits["input_critical"])
    if input_level is None:
        return None
    busiest = [
        (rank, cpu["system_pct_mean"], cpu)
        for rank, entry in telemetry
        if isinstance(cpu := entry.get(schema.HOST_CPU), dict)
        and cpu.get("system_pct_mean") is not None
    ]
    if not busiest:
        return None
    rank, system_pct, cpu = max(busiest, key=lambda item: item[1])
    if system_pct / 100.0 < limits["host_cpu_busy"]:
        return None
    workers = cpu.get("workers_pct_mean")
    if not num_workers:
        return None  # loading in the main process: more workers is the first thing to try
    cores = cpu.get(schema.CPU_COUNT) or num_workers
    # Half a core per worker (as many as there are cores) counts as CPU-bound loading.
    if workers is None or workers < 50.0 * min(num_workers, cores):
        return None
    return _verdict(
        HOST_CPU_SATURATED,
        input_level,
        f"The run waits on input ({_pct(input_share)} of step time) while the host's "
        f"{cpu.get(schema.CPU_COUNT) or '?'} cores are {system_pct:.0f}% busy (rank {rank}'s "
        f"host; its DataLoader workers use {workers or 0:.0f}% of a core): the CPUs are the "
        "limit, not the worker count.",
        _RESOURCE_NEXT[HOST_CPU_SATURATED],
        system_pct / 100.0,
        rank=rank,
        system_cpu_pct=system_pct,
        workers_cpu_pct=workers,
        input_share=input_share,
    )


def _host_memory_pressure(
    telemetry: list[tuple[int, dict[str, Any]]], limits: dict[str, float]
) -> dict[str, Any] | None:
    used = [
        (rank, memory)
        for rank, entry in telemetry
        if isinstance(memory := entry.get(schema.HOST_MEMORY), dict)
    ]
    if not used:
        return None
    rank, memory = max(used, key=lambda item: item[1]["used_max_share"])
    share = memory["used_max_share"]
    severity = _level(share, limits["host_memory_warn"], limits["host_memory_critical"])
    if severity is None:
        return None
    return _verdict(
        HOST_MEMORY_PRESSURE,
        severity,
        f"Host memory reached {_pct(share)} in use on rank {rank}'s host (as little as "
        f"{memory['available_min_bytes'] / 2**30:.1f} of {memory['total_bytes'] / 2**30:.1f} "
        "GiB available).",
        _RESOURCE_NEXT[HOST_MEMORY_PRESSURE],
        share,
        rank=rank,
        used_share=share,
        available_min_bytes=memory["available_min_bytes"],
        total_bytes=memory["total_bytes"],
    )
