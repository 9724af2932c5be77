"""One rank's resource use from its rank file: the memory trend, host CPU and memory, the
allocator's counters, NVML, how busy the device was; and memory imbalance across ranks.

Pure (plain dicts and lists, no torch), called by the reducer for each rank. The memory trend
of the host (RSS) comes from the step records, which carry RSS every step (at most every
50 ms); the device's from the telemetry samples (current allocated bytes, about once a second:
the per-step peak in step records is a running maximum, which one early spike flattens).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

from traceml import schema
from traceml.analysis import trend
from traceml.analysis.clean import is_number

# Leave out the first 10% of the analysed steps from the trend: the working set is still being
# allocated (optimizer state after the first update, the allocator's pools, lazy modules).
SETTLE_SHARE = 0.10
CHART_POINTS = 200
MB = trend.MB


def _mean(values: list[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def _numbers(records: list[dict[str, Any]], key: str) -> list[float]:
    return [
        value
        for record in records
        # Telemetry is never negative (percentages, bytes, counts): a negative value is a
        # damaged sample, unmeasured, not 100% of memory in use. Past the step fields' bound
        # it is damage too, and int() of it could not be written to the summary.
        if is_number(value := record.get(key)) and value >= 0
    ]


def _last(records: list[dict[str, Any]], key: str) -> float | None:
    values = _numbers(records, key)
    return values[-1] if values else None


def telemetry_entries(summary: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(rank entry, its telemetry) for every rank of a summary that has telemetry."""
    return [
        (entry, entry[schema.TELEMETRY])
        for entry in summary.get(schema.SUMMARY_RANKS) or []
        if isinstance(entry.get(schema.TELEMETRY), dict)
    ]


def clean_samples(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Samples with a usable step position (others' writers, damaged lines: left out)."""
    return [
        sample
        for sample in samples
        if type(sample.get(schema.AT_STEP)) is int and sample[schema.AT_STEP] >= 0
    ]


def rank_telemetry(
    columns: dict[str, list[Any]],
    samples: list[dict[str, Any]],
    header: dict[str, Any] | None,
    skipped: int,
) -> dict[str, Any] | None:
    """The rank's TELEMETRY entry (see schema.py), or None with no steps."""
    # A step's position is its row: records are written in order, and a sample's at_step
    # counts the rows written before it.
    steps = list(range(len(columns.get(schema.STEP) or [])))
    if not steps:
        return None
    samples = clean_samples(samples)
    analysed = [s for s in samples if s[schema.AT_STEP] >= skipped]
    device = (header or {}).get(schema.DEVICE) or {}
    on_cuda = device.get(schema.DEVICE_TYPE) == "cuda"
    capacity = device.get(schema.DEVICE_TOTAL_MEMORY)

    host_available = _last(samples, schema.HOST_MEM_AVAILABLE)
    trends: dict[str, Any] = {}
    rss = columns.get(schema.RSS) or []
    rss_trend = trend.memory_trend(
        steps[skipped:], rss[skipped:], headroom_bytes=host_available, settle_share=SETTLE_SHARE
    )
    if rss_trend is not None:
        trends["rss"] = rss_trend
    memory_chart = trend.downsample(
        steps, [None if v is None else v / MB for v in rss], CHART_POINTS
    )
    if on_cuda:
        device_chart = _device_memory_trend(analysed, capacity, trends)
        if device_chart:
            memory_chart = device_chart

    return {
        schema.MEMORY_TREND: trends,
        schema.HOST_CPU: _host_cpu(analysed),
        schema.HOST_MEMORY: _host_memory(analysed or samples),
        schema.DEVICE_MEMORY: _device_memory(samples) if on_cuda else None,
        schema.NVML: _nvml(analysed),
        schema.DEVICE_BUSY: _device_busy(columns, skipped) if on_cuda else None,
        schema.CHARTS: {
            "memory_basis": "device_allocated"
            if on_cuda and trends.get("device_allocated")
            else "rss",
            "memory": memory_chart,
            "cpu": _cpu_chart(samples),
        },
        "samples": len(samples),
        "sampler_cpu_pct": _sampler_cpu_pct(samples),
    }


def _device_memory_trend(
    analysed: list[dict[str, Any]], capacity: Any, trends: dict[str, Any]
) -> list[list[float]] | None:
    """Add the allocated device memory's trend to ``trends``; its chart, None without samples."""
    allocated = [
        (s[schema.AT_STEP], s.get(schema.DEVICE_MEM_ALLOCATED))
        for s in analysed
        if type(s.get(schema.DEVICE_MEM_ALLOCATED)) is int
    ]
    last_allocated = allocated[-1][1] if allocated else None
    headroom = capacity - last_allocated if capacity and last_allocated is not None else None
    device_trend = trend.memory_trend(
        [a[0] for a in allocated],
        [a[1] for a in allocated],
        headroom_bytes=headroom,
        settle_share=SETTLE_SHARE,
    )
    if device_trend is not None:
        trends["device_allocated"] = device_trend
    if not allocated:
        return None
    return [[step, value / MB] for step, value in allocated][-CHART_POINTS:]


def _host_cpu(samples: list[dict[str, Any]]) -> dict[str, Any] | None:
    system = sorted(_numbers(samples, schema.CPU_SYSTEM_PCT))
    process = _numbers(samples, schema.CPU_PROCESS_PCT)
    if not system and not process:
        return None
    workers = _numbers(samples, schema.WORKER_PROCESSES)
    return {
        "process_pct_mean": _mean(process),
        "workers_pct_mean": _mean(_numbers(samples, schema.CPU_WORKERS_PCT)),
        "system_pct_mean": _mean(system),
        "system_pct_p90": system[int(0.9 * (len(system) - 1))] if system else None,
        "worker_processes_max": int(max(workers)) if workers else None,
        schema.CPU_COUNT: _last(samples, schema.CPU_COUNT),
    }


def _host_memory(samples: list[dict[str, Any]]) -> dict[str, Any] | None:
    available = _numbers(samples, schema.HOST_MEM_AVAILABLE)
    total = _last(samples, schema.HOST_MEM_TOTAL)
    if not available or not total:
        return None
    least = min(available)
    return {"available_min_bytes": least, "total_bytes": total, "used_max_share": 1 - least / total}


def _device_memory(samples: list[dict[str, Any]]) -> dict[str, Any] | None:
    allocated = _numbers(samples, schema.DEVICE_MEM_ALLOCATED)
    reserved = _numbers(samples, schema.DEVICE_MEM_RESERVED)
    if not allocated and not reserved:
        return None
    retries = _numbers(samples, schema.ALLOC_RETRIES)
    ooms = _numbers(samples, schema.DEVICE_OOMS)
    last_allocated = allocated[-1] if allocated else None
    last_reserved = reserved[-1] if reserved else None
    return {
        "allocated_last_bytes": last_allocated,
        "reserved_last_bytes": last_reserved,
        # Reserved but unused: the caching allocator's free blocks (fragmentation, pools).
        "overhang_ratio": last_reserved / last_allocated
        if last_allocated and last_reserved is not None
        else None,
        "alloc_retries": int(max(retries)) if retries else None,
        "ooms": int(max(ooms)) if ooms else None,
    }


def _nvml(samples: list[dict[str, Any]]) -> dict[str, Any] | None:
    utilization = _numbers(samples, schema.NVML_GPU_UTIL_PCT)
    if not utilization:
        return None
    temperature = _numbers(samples, schema.NVML_TEMPERATURE_C)
    power = _numbers(samples, schema.NVML_POWER_W)
    return {
        "gpu_util_pct_mean": _mean(utilization),
        "temperature_c_max": max(temperature) if temperature else None,
        "power_w_max": max(power) if power else None,
    }


_DEVICE_PHASES = (schema.GPU_H2D, schema.GPU_FORWARD, schema.GPU_BACKWARD, schema.GPU_OPTIMIZER)
_HOST_PHASES = (schema.H2D, schema.FORWARD, schema.BACKWARD, schema.OPTIMIZER)


def _device_busy(columns: dict[str, list[Any]], skipped: int) -> dict[str, Any] | None:
    """Share of host step time the device spent in traced phases (CUDA events), over the
    analysed steps that have both. Event pairs bracket each phase on the stream, so a phase's
    device time includes stalls inside it: this is an upper bound on busy time, and
    1 - share a lower bound on the time the device waited for the host (input, H2D launches,
    Python between phases)."""
    steps = columns.get(schema.STEP) or []
    busy_total = host_total = 0.0
    used = 0
    none = [None] * len(steps)
    device = [(columns.get(field) or none)[skipped:] for field in _DEVICE_PHASES]
    analysed = steps[skipped:]
    if analysed and all(None not in column for column in (analysed, *device)) and min(analysed) > 0:
        # Every step timed on both sides (a CUDA run's usual case): the same sums, at C speed.
        busy = map(min, analysed, map(math.fsum, zip(*device, strict=True)))
        return {"share": _add(busy) / _add(analysed), "steps": len(analysed)}
    host = zip(*[(columns.get(field) or none)[skipped:] for field in _HOST_PHASES], strict=True)
    for step_ms, host_phases, *phases in zip(analysed, host, *device, strict=True):
        if step_ms is None or step_ms <= 0 or all(p is None for p in phases):
            continue
        # A phase the host timed but the device did not is unmeasured device time, not idle
        # time: that step's busy figure is unknown. (A phase the host did not see either, no
        # transfer or no optimizer step, took no device time.)
        if any(p is None and (h or 0) > 0 for p, h in zip(phases, host_phases, strict=True)):
            continue
        busy_total += min(step_ms, math.fsum(p for p in phases if p is not None))
        host_total += step_ms
        used += 1
    if not used:
        return None
    return {"share": busy_total / host_total, "steps": used}


def _add(values: Any) -> float:
    """Left to right, as ``+=`` in a loop does (``sum`` compensates rounding since 3.12)."""
    return functools.reduce(operator.add, values, 0.0)


def _cpu_chart(samples: list[dict[str, Any]]) -> list[list[Any]]:
    rows = [
        [
            s[schema.AT_STEP],
            s.get(schema.CPU_PROCESS_PCT),
            s.get(schema.CPU_WORKERS_PCT),
            s.get(schema.CPU_SYSTEM_PCT),
        ]
        for s in samples
        if s.get(schema.CPU_SYSTEM_PCT) is not None
    ]
    stride = max(1, math.ceil(len(rows) / CHART_POINTS))
    return rows[::stride]


def _sampler_cpu_pct(samples: list[dict[str, Any]]) -> float | None:
    """The sampler thread's own CPU over the time it ran, % of one core."""
    timed = [s for s in samples if type(s.get(schema.T_START_MS)) in (int, float)]
    if len(timed) < 2:
        return None
    cost_us = _last(timed, schema.TELEMETRY_CPU_US)
    span_ms = timed[-1][schema.T_START_MS] - timed[0][schema.T_START_MS]
    if cost_us is None or span_ms <= 0:
        return None
    return 100.0 * (cost_us / 1000.0) / span_ms


def memory_imbalance(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rank with the most memory (device reserved, else RSS) over the ranks' median."""
    by_rank = {}
    for entry in entries:
        value = entry.get(schema.PEAK_RESERVED) or entry.get(schema.PEAK_RSS)
        if value:
            by_rank[entry[schema.RANK]] = value
    if len(by_rank) < 2:
        return None
    ordered = sorted(by_rank.values())
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    heaviest = max(by_rank, key=lambda rank: by_rank[rank])
    return {
        "max_over_median": by_rank[heaviest] / median if median else None,
        "rank": heaviest,
        "bytes_by_rank": {str(rank): value for rank, value in by_rank.items()},
    }


# ----------------------------------------------------------------------------------------------
# compare: memory and utilization deltas between two sides (plain figures, no statistics:
# the samples are too few and too correlated for intervals; the step-time engine decides).


def _side_figure(side: list[dict[str, Any]], pick: Any) -> float | None:
    """The mean over a side's runs of the worst rank's figure (None where no run has it)."""
    per_run = []
    for summary in side:
        values = []
        for entry, telemetry in telemetry_entries(summary):
            try:
                value = pick(entry, telemetry)
            except (AttributeError, KeyError, TypeError, IndexError):
                continue  # a damaged or older summary: that rank has no figure
            if type(value) in (int, float) and math.isfinite(value):
                values.append(value)
        if values:
            per_run.append(max(values))
    return _mean(per_run)


def _trend_slope(entry: dict[str, Any], telemetry: dict[str, Any]) -> float | None:
    trends = telemetry.get(schema.MEMORY_TREND) or {}
    fit = trends.get("device_allocated") or trends.get("rss")
    return fit["slope_mb_per_1k_steps"] if fit else None


_DELTAS: tuple[tuple[str, str, Any], ...] = (
    ("memory_trend_mb_per_1k", "Memory trend (MB per 1,000 steps)", _trend_slope),
    (
        "process_cpu_pct",
        "Main process CPU (% of a core)",
        lambda e, t: (t.get(schema.HOST_CPU) or {}).get("process_pct_mean"),
    ),
    (
        "workers_cpu_pct",
        "DataLoader workers CPU (% of a core)",
        lambda e, t: (t.get(schema.HOST_CPU) or {}).get("workers_pct_mean"),
    ),
    (
        "host_cpu_pct",
        "Host CPU (% of all cores)",
        lambda e, t: (t.get(schema.HOST_CPU) or {}).get("system_pct_mean"),
    ),
    (
        "device_busy_pct",
        "Device busy (% of step time)",
        lambda e, t: (
            None if (busy := (t.get(schema.DEVICE_BUSY) or {}).get("share")) is None else busy * 100
        ),
    ),
    (
        "nvml_util_pct",
        "NVML GPU utilization (%)",
        lambda e, t: (t.get(schema.NVML) or {}).get("gpu_util_pct_mean"),
    ),
)


def resource_deltas(
    side_a: list[dict[str, Any]], side_b: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """{name: {label, a, b, change}} for the resource figures both sides have."""
    deltas = {}
    for name, label, pick in _DELTAS:
        a, b = _side_figure(side_a, pick), _side_figure(side_b, pick)
        if a is None or b is None:
            continue
        deltas[name] = {"label": label, "a": a, "b": b, "change": b - a}
    return deltas


def delta_lines(deltas: dict[str, dict[str, Any]]) -> list[str]:
    return [
        f"{d['label']}: {d['a']:,.1f} -> {d['b']:,.1f} ({d['change']:+,.1f})"
        for d in deltas.values()
    ]


def own_cost(summary: dict[str, Any]) -> tuple[float, float] | None:
    """traceml's own cost: (mean microseconds per step, fraction of the mean step)."""
    phases = (summary.get(schema.SUMMARY_OVERALL) or {}).get(schema.PHASE_STATS) or {}
    cost, step = phases.get(schema.TRACEML_COST_US), phases.get(schema.STEP)
    if not cost or not step or not step.get("mean"):
        return None
    return cost["mean"], cost["mean"] / 1000.0 / step["mean"]
