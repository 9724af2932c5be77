"""The resources part of the report (issue 15): memory trend, host CPU and memory, allocator
counters, NVML, device busy share; as text lines and as an HTML section with a memory chart
and a utilization chart per rank (inline SVG, like the step timeline)."""

from __future__ import annotations

import html
from typing import Any

from traceml import schema
from traceml.analysis import resources
from traceml.present.rank_rows import left_out_line, rows_worth_reading

_TREND_SHORT = {"rss": "RSS", "device_allocated": "dev"}
_CPU_COLORS = {"process": "#1f77b4", "workers": "#ff7f0e", "system": "#7f7f7f"}


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f} GiB"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def _trend_text(telemetry: dict[str, Any]) -> str:
    trends = telemetry.get(schema.MEMORY_TREND) or {}
    basis = "device_allocated" if "device_allocated" in trends else "rss"
    fit = trends.get(basis)
    if not fit:
        return "-"
    mark = "" if fit.get("significant") else "~"  # ~: not a sustained trend
    return f"{mark}{fit['slope_mb_per_1k_steps']:+,.1f} {_TREND_SHORT[basis]}"


def _allocator_counts(device: dict[str, Any]) -> str:
    """The allocator's retries and OOMs; a sample without them (an older torch, a failed read)
    did not measure them, which is not the same as none happening."""
    retries, ooms = device.get("alloc_retries"), device.get("ooms")
    if retries is None and ooms is None:
        return ", allocator retries and OOMs not measured"
    shown = ["n/a" if value is None else str(value) for value in (retries, ooms)]
    return f", {shown[0]} allocator retries, {shown[1]} OOMs"


_DAMAGE = (AttributeError, KeyError, TypeError, ValueError, IndexError)


def text_lines(summary: dict[str, Any]) -> list[str]:
    """The "Memory and host" section of the text report (empty when nothing was sampled and
    no memory was recorded, or when the summary's telemetry is damaged)."""
    try:
        return _text_lines(summary)
    except _DAMAGE:
        return ["Memory and host: not shown (the summary's telemetry is damaged)"]


# A rank holding this much more memory than the ranks' median is worth a line; under it the
# ranks are balanced and the line said nothing true (issue 25: "holds 1.00x the median").
MEMORY_IMBALANCE_SHOWN = 1.10


def _text_lines(summary: dict[str, Any]) -> list[str]:
    rows = resources.telemetry_entries(summary)
    if not rows:
        return []
    lines = [
        "Memory and host per rank (trend: MB per 1,000 steps; CPU: % of one core; host: of all)",
        f"  {'Rank':<5}{'Peak mem':>10}{'Trend':>16}{'Proc CPU':>10}{'Workers':>9}"
        f"{'Host CPU':>10}{'Host free':>11}{'Dev busy':>10}",
    ]
    every_row = rows
    rows, left = _worth_reading(every_row)
    for entry, telemetry in rows:
        peak = entry.get(schema.PEAK_RESERVED) or entry.get(schema.PEAK_RSS)
        cpu = telemetry.get(schema.HOST_CPU) or {}
        memory = telemetry.get(schema.HOST_MEMORY) or {}
        busy = (telemetry.get(schema.DEVICE_BUSY) or {}).get("share")
        lines.append(
            f"  {entry.get(schema.RANK)!s:<5}{_gib(peak):>10}{_trend_text(telemetry):>16}"
            f"{_pct(cpu.get('process_pct_mean')):>10}{_pct(cpu.get('workers_pct_mean')):>9}"
            f"{_pct(cpu.get('system_pct_mean')):>10}{_gib(memory.get('available_min_bytes')):>11}"
            f"{_pct(None if busy is None else busy * 100):>10}"
        )
    if left:
        lines.append(left_out_line(left, "most peak memory"))
    imbalance = (summary.get(schema.SUMMARY_IMBALANCE) or {}).get(schema.MEMORY_IMBALANCE)
    ratio = (imbalance or {}).get("max_over_median")
    if ratio is not None and ratio >= MEMORY_IMBALANCE_SHOWN:
        lines.append(
            f"  Memory imbalance: rank {imbalance['rank']} holds "
            f"{imbalance['max_over_median']:.2f}x the ranks' median"
        )
    lines.extend(_device_lines(rows))
    costs = [t.get("sampler_cpu_pct") for _, t in every_row if t.get("sampler_cpu_pct") is not None]
    if costs:
        lines.append(f"  traceml's sampler used {max(costs):.2f}% of one core (at most, per rank)")
    lines.append(
        "  ~: not sustained (noise, or not in both halves of the run); dev: allocated device memory"
    )
    return lines


def _worth_reading(
    rows: list[tuple[dict[str, Any], dict[str, Any]]],
) -> tuple[list[tuple[dict[str, Any], dict[str, Any]]], int]:
    """The ranks listed and charted (the most peak memory first, :mod:`rank_rows`)."""
    return rows_worth_reading(
        rows,
        lambda row: row[0].get(schema.PEAK_RESERVED) or row[0].get(schema.PEAK_RSS),
        lambda row: row[0].get(schema.STATUS) != schema.STATUS_COMPLETED,
    )


def _device_lines(rows: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[str]:
    """Each listed rank's device memory and NVML lines."""
    lines: list[str] = []
    for entry, telemetry in rows:
        device = telemetry.get(schema.DEVICE_MEMORY)
        if device:
            overhang = device.get("overhang_ratio")
            lines.append(
                f"  Rank {entry.get(schema.RANK)} device memory: allocated "
                f"{_gib(device.get('allocated_last_bytes'))}, reserved "
                f"{_gib(device.get('reserved_last_bytes'))}"
                + (f" ({overhang:.2f}x allocated)" if overhang else "")
                + _allocator_counts(device)
            )
        nvml = telemetry.get(schema.NVML)
        if nvml:
            extra = ""
            if nvml.get("temperature_c_max") is not None:
                extra += f", up to {nvml['temperature_c_max']:.0f} C"
            if nvml.get("power_w_max") is not None:
                extra += f", up to {nvml['power_w_max']:.0f} W"
            lines.append(
                f"  Rank {entry.get(schema.RANK)} NVML: GPU utilization "
                f"{nvml['gpu_util_pct_mean']:.0f}% mean{extra}"
            )
    return lines


# ----------------------------------------------------------------------------------------------
# HTML


def _polyline(points: list[tuple[float, float]], color: str) -> str:
    if not points:
        return ""
    coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    return f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{coords}"/>'


def _chart(
    series: dict[str, list[tuple[float, float]]],
    colors: dict[str, str],
    last_step: float,
    top: float,
    unit: str,
    caption: str,
) -> str:
    width, height, left, bottom = 900, 140, 60, 20
    span_x = max(last_step, 1.0)
    top = top or 1.0

    def place(step: float, value: float) -> tuple[float, float]:
        return (
            left + step / span_x * (width - left),
            height - bottom - value / top * (height - bottom - 10),
        )

    lines = "".join(
        _polyline([place(x, y) for x, y in points], colors[name]) for name, points in series.items()
    )
    axis = (
        f'<line x1="{left}" y1="{height - bottom}" x2="{width}" y2="{height - bottom}" '
        'stroke="#333"/>'
        f'<text x="0" y="14" font-size="11">{top:,.0f} {unit}</text>'
        f'<text x="{left}" y="{height - 4}" font-size="11">step 0</text>'
        f'<text x="{width - 80}" y="{height - 4}" font-size="11">step {last_step:,.0f}</text>'
    )
    return (
        f'<figure><svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="{html.escape(caption)}">{axis}{lines}</svg>'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


def html_section(summary: dict[str, Any]) -> str:
    """Memory over steps and utilization per rank, plus the text table (empty without data)."""
    try:
        return _html_section(summary)
    except _DAMAGE:
        return "<p>Memory and host: not shown (the summary's telemetry is damaged).</p>"


def _html_section(summary: dict[str, Any]) -> str:
    rows = resources.telemetry_entries(summary)
    if not rows:
        return ""
    parts = ["<h2>Memory over steps and utilization, per rank</h2>"]
    parts.append("<pre>" + html.escape("\n".join(text_lines(summary))) + "</pre>")
    parts.append(
        '<p class="legend">'
        + "".join(
            f'<span><i class="swatch" style="background:{color}"></i>{name}</span>'
            for name, color in (
                ("main process CPU", _CPU_COLORS["process"]),
                ("DataLoader workers CPU", _CPU_COLORS["workers"]),
                ("host CPU (all cores)", _CPU_COLORS["system"]),
            )
        )
        + "</p>"
    )
    rows, left = _worth_reading(rows)
    if left:
        parts.append(f"<p>{html.escape(left_out_line(left, 'most peak memory').strip())}</p>")
    for entry, telemetry in rows:
        rank = entry.get(schema.RANK)
        charts = telemetry.get(schema.CHARTS) or {}
        last_step = max(0, (entry.get(schema.SUMMARY_STEPS_RECORDED) or 1) - 1)
        memory_chart = _memory_chart(entry, telemetry, charts, last_step)
        if memory_chart:
            parts.append(memory_chart)
        cpu = charts.get("cpu") or []
        if cpu:
            series = {
                name: [
                    (float(row[0]), float(row[column])) for row in cpu if row[column] is not None
                ]
                for name, column in (("process", 1), ("workers", 2), ("system", 3))
            }
            top = max([100.0] + [y for points in series.values() for _, y in points])
            parts.append(
                _chart(
                    series,
                    _CPU_COLORS,
                    last_step,
                    top,
                    "%",
                    f"Rank {rank}: CPU utilization over steps (% of one core; host: % of all)",
                )
            )
    return "\n".join(parts)


def _memory_chart(
    entry: dict[str, Any], telemetry: dict[str, Any], charts: dict[str, Any], last_step: int
) -> str:
    """One rank's memory over steps, with its trend (empty when not sampled)."""
    rank = entry.get(schema.RANK)
    memory = [(float(x), float(y)) for x, y in charts.get("memory") or []]
    if not memory:
        return ""
    basis = "allocated device memory" if charts.get("memory_basis") != "rss" else "RSS"
    fit = (telemetry.get(schema.MEMORY_TREND) or {}).get(
        "rss" if basis == "RSS" else "device_allocated"
    )
    trend = (
        f"; trend {fit['slope_mb_per_1k_steps']:+,.1f} MB per 1,000 steps"
        + ("" if fit.get("significant") else " (not sustained)")
        if fit
        else ""
    )
    return _chart(
        {"memory": memory},
        {"memory": "#2ca02c"},
        last_step,
        max(y for _, y in memory) * 1.05,
        "MB",
        f"Rank {rank}: {basis} over steps (MB){trend}",
    )
