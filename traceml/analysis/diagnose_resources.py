"""Resource verdicts (issue 15): memory over the run, device idle time, the host's CPU and
memory. Each judges the rank entries' TELEMETRY (traceml/analysis/resources.py) and names the
worst rank."""

from __future__ import annotations

import math
from typing import Any

from traceml import schema
from traceml.analysis import resources
from traceml.analysis.diagnose_base import (
    CRITICAL,
    WARN,
    PhaseView,
    new_verdict,
    pct,
    severity_for,
)

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
    summary: dict[str, Any], view: PhaseView, limits: dict[str, float]
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
    return new_verdict(
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
    telemetry: list[tuple[int, dict[str, Any]]], view: PhaseView, limits: dict[str, float]
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
    severity = severity_for(idle, limits["device_idle_warn"], limits["device_idle_critical"])
    if severity is None:
        return None
    host = {phase: view.shares.get(phase) or 0.0 for phase in _HOST_PHASES}
    culprit = max(host, key=lambda phase: host[phase])
    return new_verdict(
        LOW_DEVICE_UTILIZATION,
        severity,
        f"The device ran traced work for only {pct(busy)} of step time on rank {rank}; the "
        f"largest host-side phase is {_HOST_PHASES[culprit]} at {pct(host[culprit])}.",
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
    view: PhaseView,
    limits: dict[str, float],
    num_workers: int | None = None,
) -> dict[str, Any] | None:
    """The input pipeline waits and the host has no CPU to give it. Only when the DataLoader
    workers themselves burn CPU: workers that mostly wait (I/O, a remote store, a sleep) do get
    faster with more of them however busy the cores are, and the input-pipeline advice stands."""
    input_share = view.shares.get(schema.INPUT_WAIT)
    input_level = severity_for(input_share, limits["input_warn"], limits["input_critical"])
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
    return new_verdict(
        HOST_CPU_SATURATED,
        input_level,
        f"The run waits on input ({pct(input_share)} of step time) while the host's "
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
    severity = severity_for(share, limits["host_memory_warn"], limits["host_memory_critical"])
    if severity is None:
        return None
    return new_verdict(
        HOST_MEMORY_PRESSURE,
        severity,
        f"Host memory reached {pct(share)} in use on rank {rank}'s host (as little as "
        f"{memory['available_min_bytes'] / 2**30:.1f} of {memory['total_bytes'] / 2**30:.1f} "
        "GiB available).",
        _RESOURCE_NEXT[HOST_MEMORY_PRESSURE],
        share,
        rank=rank,
        used_share=share,
        available_min_bytes=memory["available_min_bytes"],
        total_bytes=memory["total_bytes"],
    )
