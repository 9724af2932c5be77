"""Verdicts that compare ranks: STRAGGLER (whose own time is longest, and in which phase),
COMM_BOUND (time waiting on other ranks) and MEMORY_PRESSURE."""

from __future__ import annotations

from typing import Any

from traceml import schema
from traceml.analysis import stats
from traceml.analysis.diagnose_base import (
    COMM_BOUND,
    MEMORY_PRESSURE,
    NEXT_STEPS,
    STRAGGLER,
    STRAGGLER_NEXT,
    new_verdict,
    pct,
    severity_for,
)

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


def _straggler_basis(
    fields: dict[str, Any], one_basis: bool = True
) -> tuple[str, dict[str, str], str] | None:
    """(own-time field, phase -> field for the cause, how own time was measured).
    ``one_basis``: every rank's own time was derived the same way (all with comm timing or
    none); ranks whose own time is step minus comm and ranks whose is step minus Backward
    are compared by their step times only."""
    if _compared(fields, schema.GPU_OWN_MS):
        return schema.GPU_OWN_MS, _GPU_OWN_PHASE_FIELDS, "device"
    if one_basis and _compared(fields, schema.OWN_OF_PHASE[schema.BACKWARD]):
        return schema.OWN_MS, _OWN_PHASE_FIELDS, "waits"
    fallback = (schema.OWN_MS, schema.STEP) if one_basis else (schema.STEP,)
    candidates = [f for f in fallback if _compared(fields, f)]
    if not candidates:
        return None
    # Older files: step minus Backward (DDP's wait on gloo), or the step itself when the ranks
    # do not synchronise; whichever separates the slowest rank more.
    basis = max(candidates, key=lambda f: fields[f]["max_over_others"])
    return basis, _LEGACY_PHASE_FIELDS, "legacy"


def _one_own_basis(summary: dict[str, Any]) -> bool:
    """Whether the ranks with steps all had comm timing, or none did (see reduce_rank's
    own time: step minus comm, else step minus Backward)."""
    with_comm = {
        bool((entry.get(schema.PHASE_STATS) or {}).get(schema.COMM))
        for entry in summary.get(schema.SUMMARY_RANKS) or []
        if (entry.get(schema.PHASE_STATS) or {}).get(schema.STEP)
    }
    return len(with_comm) <= 1


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


def straggler_verdict(summary: dict[str, Any], limits: dict[str, float]) -> dict[str, Any] | None:
    """The rank the others wait for: the most own time (step minus its waits on the others),
    against the other ranks' median, beyond both a ratio and an absolute threshold."""
    imbalance = summary.get(schema.SUMMARY_IMBALANCE) or {}
    fields = imbalance.get(schema.IMBALANCE_FIELDS) or {}
    chosen = _straggler_basis(fields, _one_own_basis(summary))
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
    severity = severity_for(ratio, limits["straggler_warn"], limits["straggler_critical"])
    if severity is None:
        return None
    statistic, waits = _shown_waits(fields, slowest, method)
    if not _others_wait_for_it(fields, slowest, method, limits["straggler_wait_share"] * cost):
        # Its own time is longer, yet the others do not wait for it: noise, not a straggler.
        return None
    excess = _phase_excess(fields, phase_fields, slowest)
    cause = max(excess, key=lambda p: excess[p]) if excess else None
    if cause is not None and excess[cause] <= 0:
        cause = None
    cause_text = (
        f", mostly in {_cause_label(cause, method)} (+{excess[cause]:.1f} ms)" if cause else ""
    )
    wait_text = (
        f" (the other ranks wait {waits[0]:.1f} ms per step, by the {statistic} over steps of "
        f"each, rank {slowest} {waits[1]:.1f} ms)"
        if waits
        else ""
    )
    advice = STRAGGLER_NEXT.get(cause, "check that rank's host and device")
    return new_verdict(
        STRAGGLER,
        severity,
        f"Rank {slowest} is slow: {_own_time_words(method, basis)} is {ratio:.2f}x the other "
        f"ranks' median ({slow_value:.1f} ms vs {reference:.1f} ms){cause_text}. It costs the "
        "job about "
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
        others_wait_ms=waits[0] if waits else None,
        rank_wait_ms=waits[1] if waits else None,
        wait_statistic=statistic if waits else None,
    )


def _own_time_words(method: str, basis: str) -> str:
    if method == "device":
        return "its own time (device time not spent waiting on other ranks, plus Input Wait)"
    if method == "waits":
        return "its own time (step minus its waits on other ranks)"
    return "its own work (step minus Backward)" if basis == schema.OWN_MS else "its step time"


def _cause_label(cause: str | None, method: str) -> str:
    if cause is None:
        return ""
    if cause == schema.BACKWARD and method != "legacy":
        return "Backward compute"
    return schema.PHASE_LABELS[cause]


def _others_wait(
    fields: dict[str, Any], slowest: int, method: str, per_step: str = "rank_medians_ms"
) -> tuple[float, float] | None:
    """(the median over the other ranks of their ``per_step`` wait, the slowest rank's), where
    waits are timed."""
    entry = fields.get(schema.GPU_COMM if method == "device" else schema.COMM)
    if method == "legacy" or not entry or per_step not in entry:
        return None
    values = entry[per_step]
    others = [v for key, v in values.items() if key != str(slowest)]
    if str(slowest) not in values or not others:
        return None
    return stats.quantile_sorted(sorted(others), 0.5), values[str(slowest)]


def _shown_waits(
    fields: dict[str, Any], slowest: int, method: str
) -> tuple[str, tuple[float, float] | None]:
    """The waits a verdict shows: the mean per step, which decides (``_others_wait_for_it``);
    summaries made before ``rank_means_ms`` existed show the median."""
    means = _others_wait(fields, slowest, method, "rank_means_ms")
    if means is not None:
        return "mean", means
    return "median", _others_wait(fields, slowest, method)


def _others_wait_for_it(fields: dict[str, Any], slowest: int, method: str, needed: float) -> bool:
    """Whether the others wait longer than the slowest rank by ``needed`` ms per step, on
    average (a wait every few steps, periodic syncs, counts spread over the steps); True where
    waits are not timed (older files) or ``needed`` is 0 (straggler_wait_share=0: no check)."""
    means = _others_wait(fields, slowest, method, "rank_means_ms")
    if means is None or needed <= 0:
        return True
    return means[0] - means[1] >= needed


def comm_bound(summary: dict[str, Any], limits: dict[str, float]) -> dict[str, Any] | None:
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
    severity = severity_for(least, limits["comm_warn"], limits["comm_critical"])
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
        plural = "" if round(count) == 1 else "s"
        volume = f"; {count:.0f} collective{plural} and {nbytes / 2**20:.1f} MiB per step"
    clock = "device time" if device else "step time"
    return new_verdict(
        COMM_BOUND,
        severity,
        f"Every rank spends at least {pct(least)} of {clock} waiting in communication "
        f"({comm_stats.get('mean', 0.0):.1f} ms per step on average{where}{volume}), and no "
        "single rank is making the others wait.",
        NEXT_STEPS[COMM_BOUND],
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
    return f", {pct(sums[phase] / total)} of it in {schema.PHASE_LABELS[phase]}"


def memory_pressure(summary: dict[str, Any], limits: dict[str, float]) -> dict[str, Any] | None:
    overall = summary.get(schema.SUMMARY_OVERALL) or {}
    setup = summary.get(schema.SUMMARY_SETUP) or {}
    capacity = setup.get(schema.DEVICE_TOTAL_MEMORY)
    peak = overall.get(schema.PEAK_RESERVED) or overall.get(schema.PEAK_ALLOCATED)
    if not capacity or not peak:
        return None
    fraction = peak / capacity
    severity = severity_for(fraction, limits["memory_warn"], limits["memory_critical"])
    if severity is None:
        return None
    return new_verdict(
        MEMORY_PRESSURE,
        severity,
        f"Peak reserved device memory reached {pct(fraction)} of capacity "
        f"({peak / 2**30:.1f} of {capacity / 2**30:.1f} GiB).",
        NEXT_STEPS[MEMORY_PRESSURE],
        fraction,
        peak_bytes=peak,
        capacity_bytes=capacity,
        fraction=fraction,
    )
