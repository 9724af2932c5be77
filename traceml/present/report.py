"""Summary -> the text a user reads (final_summary.txt, the terminal) and report.html. Pure.

Text fits 100 columns: the verdict first, then the phase table, per-rank rows when there is
more than one rank, then notes. The HTML page is self-contained (inline CSS and SVG, no script,
no network) with a per-rank timeline of step time stacked by phase.
"""

from __future__ import annotations

import html
import textwrap
from typing import Any

from traceml import schema
from traceml.analysis import resources
from traceml.analysis.diagnose import label, noise_caveat
from traceml.present.report_resources import html_section as resource_html
from traceml.present.report_resources import text_lines as resource_lines

WIDTH = 100
# Rows of missing ranks listed in the per-rank table; the notes give them all, as ranges.
MISSING_ROWS = 8


def _ms(value: float | None, width: int = 9) -> str:
    if value is None:
        return "-".rjust(width)
    if value >= 1000:
        return f"{value:,.0f}".rjust(width)
    if value >= 100:
        return f"{value:.1f}".rjust(width)
    return f"{value:.2f}".rjust(width)


def _share(value: float | None, width: int = 7) -> str:
    return ("-" if value is None else f"{value * 100:.1f}%").rjust(width)


def _bytes(value: float | None) -> str:
    if value is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def _wrap(text: str, first: str, rest: str | None = None) -> list[str]:
    return textwrap.wrap(
        text,
        width=WIDTH,
        initial_indent=first,
        subsequent_indent=rest if rest is not None else " " * len(first),
        break_on_hyphens=False,
    ) or [first.rstrip()]


def headline(summary: dict[str, Any]) -> str:
    ranks = summary.get(schema.WORLD_SIZE, 1)
    setup = summary.get(schema.SUMMARY_SETUP) or {}
    device = setup.get("device") or "unknown device"
    return (
        f"traceml: {summary.get(schema.RUN)} ({summary.get(schema.SUMMARY_STATUS)}; "
        f"{ranks} rank{'s' if ranks != 1 else ''}, {device}; "
        f"{summary.get(schema.SUMMARY_STEPS_ANALYSED, 0)} of "
        f"{summary.get(schema.SUMMARY_STEPS_RECORDED, 0)} steps analysed)"
    )


def banner() -> str:
    """The line that opens the report on a terminal, so it stands out from the training's own
    output and library warnings above it."""
    return " traceml report ".center(WIDTH, "=")


def for_terminal(text: str) -> str:
    """``text`` as printed after a run: a blank line and the banner first."""
    return f"\n{banner()}\n{text}"


def render_text(summary: dict[str, Any]) -> str:
    lines: list[str] = [*_wrap(headline(summary), ""), ""]
    sections = (_verdict_lines, _phase_lines, _input_lines, _rank_section, resource_lines)
    for section in (*sections, _note_lines):
        block = section(summary)
        if block:
            lines.extend([*block, ""])
    lines.append(f"Summary: {summary.get(schema.SUMMARY_RUN_DIR, '.')}/{schema.SUMMARY_JSON}")
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _input_lines(summary: dict[str, Any]) -> list[str]:
    """The input pipeline's breakdown (traceml/analysis/input_pipeline.py), when it was timed."""
    breakdown = summary.get(schema.SUMMARY_INPUT_PIPELINE)
    if not isinstance(breakdown, dict):
        return []
    workers = breakdown.get("num_workers") or 0
    where = (
        f"{workers} worker{'s' if workers != 1 else ''}"
        if workers
        else "the main process (num_workers=0)"
    )
    lines = [
        f"Input pipeline ({where}; {breakdown.get('batches')} batches, per batch)",
        f"  __getitem__ {breakdown['getitem_ms_per_batch']:.1f} ms (summed over its samples), "
        f"collate_fn {breakdown['collate_ms_per_batch']:.1f} ms, "
        f"busy {breakdown['busy_ms_per_batch']:.1f} ms",
    ]
    busy = breakdown.get("worker_busy_share")
    if busy is not None:
        per_worker = breakdown.get("batches_per_worker") or {}
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(per_worker.items()))
        lines.append(
            f"  workers busy {busy * 100:.0f}%, idle {(1 - busy) * 100:.0f}%; "
            f"batches per worker {counts}"
        )
    startups = breakdown.get("worker_startup_ms")
    if startups:
        each = ", ".join(f"{value / 1000:.2f}" for value in startups)
        lines.append(f"  worker start-up per epoch (s): {each}")
    return lines


def _verdict_lines(summary: dict[str, Any]) -> list[str]:
    verdicts = summary.get(schema.SUMMARY_VERDICTS) or []
    if not verdicts:
        return []
    top = verdicts[0]
    lines = [f"Verdict: {label(top[schema.VERDICT_KIND])} ({top[schema.VERDICT_SEVERITY]})"]
    lines.extend(_wrap(top[schema.VERDICT_WHY], "  Why:  ", "        "))
    lines.extend(_wrap(top[schema.VERDICT_NEXT], "  Next: ", "        "))
    caveat = noise_caveat(summary)
    if caveat:
        lines.extend(_wrap(caveat, "  Caveat: ", "        "))
    for other in verdicts[1:]:
        text = (
            f"{label(other[schema.VERDICT_KIND])} ({other[schema.VERDICT_SEVERITY]}): "
            f"{other[schema.VERDICT_WHY]}"
        )
        lines.extend(_wrap(text, "  Also: "))
    return lines


def _phase_lines(summary: dict[str, Any]) -> list[str]:
    overall = summary.get(schema.SUMMARY_OVERALL) or {}
    phase_stats = overall.get(schema.PHASE_STATS) or {}
    shares = overall.get(schema.SHARES) or {}
    if not phase_stats.get(schema.STEP):
        return []
    has_gpu = any(phase_stats.get(f) for f in schema.GPU_FIELDS)
    lines = ["Phase breakdown per optimizer step (after warm-up)"]
    head = f"  {'Phase':<12}{'mean ms':>9}{'median':>9}{'p90':>9}{'max':>9}{'share':>8}"
    if has_gpu:
        head += f"{'GPU ms':>9}{'GPU share':>10}"
    lines.append(head)
    for fieldname in schema.TIMED_FIELDS:
        lines.append(_phase_row(fieldname, phase_stats, shares, has_gpu))
    lines.extend(_comm_lines(phase_stats, shares))
    lines.extend(
        _wrap(
            "The phase means add up to the step mean; medians and p90s are of each phase on "
            "its own (taken from different steps), so they need not add up.",
            "  ",
        )
    )
    return [*lines, "", *_throughput_lines(summary)]


def _phase_row(
    fieldname: str, phase_stats: dict[str, Any], shares: dict[str, Any], has_gpu: bool
) -> str:
    described = phase_stats.get(fieldname)
    share = 1.0 if fieldname == schema.STEP else shares.get(fieldname)
    row = f"  {schema.PHASE_LABELS[fieldname]:<12}"
    if described:
        row += "".join(_ms(described[k]) for k in ("mean", "median", "p90", "max"))
        row += _share(share, 8)
    else:
        row += "  not measured".ljust(44)
    if has_gpu:
        gpu_field = schema.GPU_OF_PHASE.get(fieldname)
        gpu = phase_stats.get(gpu_field) if gpu_field else None
        gpu_share = shares.get(gpu_field) if gpu_field else None
        if fieldname == schema.STEP and gpu:
            gpu_share = 1.0
        row += _ms(gpu["mean"] if gpu else None) + _share(gpu_share, 10)
    return row.rstrip()


def _rank_section(summary: dict[str, Any]) -> list[str]:
    ranks = summary.get(schema.SUMMARY_RANKS) or []
    if len(ranks) > 1 or summary.get(schema.SUMMARY_RANKS_MISSING):
        return _rank_lines(summary)
    return []


def _note_lines(summary: dict[str, Any]) -> list[str]:
    notes = summary.get(schema.SUMMARY_NOTES) or []
    if not notes:
        return []
    lines = ["Notes"]
    for note in notes:
        lines.extend(_wrap(str(note), "  - ", "    "))
    return lines


def _comm_lines(phase_stats: dict[str, Any], shares: dict[str, Any]) -> list[str]:
    """The waits on other ranks, which sit inside the phases above (so not added again)."""
    comm = phase_stats.get(schema.COMM)
    if not comm:
        return []
    row = (
        f"  {'Comm wait':<12}"
        + _ms(comm["mean"])
        + _ms(comm["median"])
        + _ms(comm["p90"])
        + _ms(comm["max"])
        + _share(shares.get(schema.COMM_SHARE), 8)
    )
    gpu = phase_stats.get(schema.GPU_COMM)
    if gpu:
        row += _ms(gpu["mean"]) + _share(shares.get(schema.GPU_COMM_SHARE), 10)
    where = [
        f"{schema.PHASE_LABELS[phase]} {(phase_stats.get(fieldname) or {}).get('mean', 0.0):.1f}"
        for phase, fieldname in schema.COMM_OF_PHASE.items()
        if ((phase_stats.get(fieldname) or {}).get("mean") or 0.0) >= 0.05
    ]
    note = "  (waiting on other ranks, inside the phases above"
    note += f": {', '.join(where)} ms)" if where else ")"
    return [row.rstrip(), *_wrap(note.strip(), "  ")]


def _throughput_lines(summary: dict[str, Any]) -> list[str]:
    overall = summary.get(schema.SUMMARY_OVERALL) or {}
    parts = []
    steps_per_s = overall.get(schema.STEPS_PER_S)
    if steps_per_s:
        text = f"Throughput: {steps_per_s:.2f} steps/s per rank"
        samples = overall.get(schema.SAMPLES_PER_S)
        if samples:
            text += f" ({samples:.1f} samples/s in total)"
        parts.append(text)
    parts.append(f"Peak RSS: {_bytes(overall.get(schema.PEAK_RSS))}")
    reserved = overall.get(schema.PEAK_RESERVED)
    if reserved is not None:
        parts.append(
            f"Peak device memory: {_bytes(overall.get(schema.PEAK_ALLOCATED))} allocated, "
            f"{_bytes(reserved)} reserved"
        )
    return _wrap(";  ".join(parts), "  ") + _between_steps_lines(overall) + own_cost_lines(summary)


def own_cost_lines(summary: dict[str, Any]) -> list[str]:
    measured = resources.own_cost(summary)
    if measured is None:
        return []
    micros, fraction = measured
    return _wrap(
        f"traceml's own cost: {micros:.0f} us per step ({fraction * 100:.2f}% of step time; "
        "time inside its hooks and writes, on the same clock)",
        "  ",
    )


def _between_steps_lines(overall: dict[str, Any]) -> list[str]:
    """Training time outside the steps: between them, and after the last one until training
    ended (final validation, checkpoints), when the rank files say when that was."""
    between = overall.get(schema.BETWEEN_STEPS_MS)
    wall = overall.get(schema.WALL_MS)
    after = overall.get(schema.AFTER_LAST_STEP_MS)
    if between is None or not wall:
        return []
    if after is None:
        text = (
            f"Between steps (validation, checkpoints, epoch ends): {between / 1000:.2f} s of "
            f"{wall / 1000:.2f} s from the first step's start to the last step's end "
            f"({between / wall * 100:.0f}%); the time after the last step is unknown (no "
            "footer with an end time)"
        )
    else:
        total = wall + after
        outside = between + after
        text = (
            f"Outside steps (validation, checkpoints, epoch ends): {outside / 1000:.2f} s of "
            f"{total / 1000:.2f} s from the first step to the end of training "
            f"({outside / total * 100:.0f}%): {between / 1000:.2f} s between steps, "
            f"{after / 1000:.2f} s after the last step"
        )
    return _wrap(text, "  ")


_RANK_COLUMNS = schema.PHASE_SHORT_LABELS


def _rank_lines(summary: dict[str, Any]) -> list[str]:
    entries = summary.get(schema.SUMMARY_RANKS) or []
    with_comm = any((e.get(schema.PHASE_STATS) or {}).get(schema.COMM) for e in entries)
    columns = dict(_RANK_COLUMNS)
    if with_comm:
        # Own = step minus waits on other ranks: the rank with the most is the slowest.
        columns[schema.COMM] = "Comm"
        columns[schema.OWN_MS] = "Own"
    width = 7 if with_comm else 8
    nodes = {e.get(schema.NODE_RANK) for e in entries}
    show_node = len(nodes) > 1 or not with_comm
    lines = ["Per rank (median ms per step)"]
    head = f"  {'Rank':<5}" + (f"{'Node':<5}" if show_node else "") + f"{'Steps':>6}"
    for name in columns.values():
        head += f"{name:>{width}}"
    if with_comm:
        head += f"{'Comm%':>{width}}"
    head += "  Status"
    lines.append(head)
    imbalance = summary.get(schema.SUMMARY_IMBALANCE) or {}
    slowest = imbalance.get(schema.SLOWEST_RANK)
    for entry in entries:
        stats = entry.get(schema.PHASE_STATS) or {}
        node = entry.get(schema.NODE_RANK)
        row = f"  {entry[schema.RANK]:<5}"
        if show_node:
            row += f"{'-' if node is None else node:<5}"
        row += f"{entry.get(schema.SUMMARY_STEPS_ANALYSED, 0):>6}"
        for fieldname in columns:
            described = stats.get(fieldname)
            row += _ms(described["median"] if described else None, width)
        if with_comm:
            row += _share((entry.get(schema.SHARES) or {}).get(schema.COMM_SHARE), width)
        status = entry.get(schema.STATUS) or "no footer"
        if slowest == entry[schema.RANK] and len(entries) > 1:
            status += " (slowest)"
        lines.append(f"{row}  {status}")
    missing = summary.get(schema.SUMMARY_RANKS_MISSING) or []
    for rank in missing[:MISSING_ROWS]:
        lines.append(f"  {rank:<5}" + (f"{'-':<5}" if show_node else "") + f"{'-':>6}  missing")
    if len(missing) > MISSING_ROWS:
        lines.append(f"  ... and {len(missing) - MISSING_ROWS} more missing ranks (see Notes)")
    if with_comm:
        lines.extend(
            _wrap(
                "Comm: time blocked waiting on other ranks (inside the phases); Own: step minus "
                "Comm; (slowest): the rank with the most own time",
                "  ",
            )
        )
    return lines


# ----------------------------------------------------------------------------------------------
# HTML

_COLORS = {
    schema.INPUT_WAIT: "#e4572e",
    schema.H2D: "#f3a712",
    schema.FORWARD: "#29335c",
    schema.BACKWARD: "#4f6d7a",
    schema.OPTIMIZER: "#669bbc",
    schema.RESIDUAL: "#a8c686",
}


def render_html(summary: dict[str, Any]) -> str:
    esc = html.escape
    verdicts = summary.get(schema.SUMMARY_VERDICTS) or []
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>traceml: {esc(str(summary.get(schema.RUN)))}</title>",
        "<style>",
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:70em;color:#222}",
        ".verdict{border-left:6px solid #888;padding:.5em 1em;margin:1em 0;background:#f6f6f6}",
        ".critical{border-color:#c0392b}.warn{border-color:#e67e22}.info{border-color:#2980b9}",
        "table{border-collapse:collapse}td,th{padding:.2em .8em;text-align:right}",
        "th:first-child,td:first-child{text-align:left}tr:nth-child(even){background:#f4f4f4}",
        ".legend span{display:inline-block;margin-right:1em}",
        ".swatch{display:inline-block;width:.9em;height:.9em;margin-right:.3em;"
        "vertical-align:middle}",
        "pre{background:#f6f6f6;padding:1em;overflow:auto}",
        "</style></head><body>",
        f"<h1>traceml: {esc(str(summary.get(schema.RUN)))}</h1>",
        f"<p>{esc(headline(summary))}</p>",
    ]
    for index, verdict in enumerate(verdicts):
        tag = "h2" if index == 0 else "h3"
        parts.append(
            f'<div class="verdict {esc(verdict["severity"])}"><{tag}>'
            f"{esc(label(verdict['kind']))} ({esc(verdict['severity'])})</{tag}>"
            f"<p><b>Why:</b> {esc(verdict['why'])}</p>"
            f"<p><b>Next:</b> {esc(verdict['next'])}</p></div>"
        )
    parts.append(_html_table(summary))
    parts.append(_input_html(summary))
    parts.append(_html_rank_table(summary))
    parts.append("<h2>Step time per rank, stacked by phase</h2>")
    parts.append(
        '<p class="legend">'
        + "".join(
            f'<span><i class="swatch" style="background:{color}"></i>'
            f"{esc(schema.PHASE_LABELS[phase])}</span>"
            for phase, color in _COLORS.items()
        )
        + "</p>"
    )
    ranks = summary.get(schema.SUMMARY_RANKS) or []
    # One scale for every rank, so a slow rank looks slow.
    tallest = max(
        (
            b.get(schema.STEP) or 0.0
            for e in ranks
            for b in (e.get(schema.TIMELINE) or {}).get("bins", [])
        ),
        default=0.0,
    )
    for entry in ranks:
        parts.append(_timeline_svg(entry, tallest or 1.0))
    parts.append(resource_html(summary))
    notes = summary.get(schema.SUMMARY_NOTES) or []
    if notes:
        parts.append("<h2>Notes</h2><ul>")
        parts.extend(f"<li>{esc(note)}</li>" for note in notes)
        parts.append("</ul>")
    parts.append("<h2>Report text</h2><pre>" + esc(render_text(summary)) + "</pre>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _input_html(summary: dict[str, Any]) -> str:
    """The input pipeline's breakdown as a section of report.html (empty when not timed)."""
    lines = _input_lines(summary)
    if not lines:
        return ""
    items = "".join(f"<li>{html.escape(line.strip())}</li>" for line in lines[1:])
    return f"<h2>{html.escape(lines[0])}</h2><ul>{items}</ul>"


def _html_table(summary: dict[str, Any]) -> str:
    overall = summary.get(schema.SUMMARY_OVERALL) or {}
    phase_stats = overall.get(schema.PHASE_STATS) or {}
    shares = overall.get(schema.SHARES) or {}
    rows = [
        "<table><tr><th>Phase</th><th>mean ms</th><th>median ms</th><th>p90 ms</th>"
        "<th>max ms</th><th>share</th></tr>"
    ]
    for fieldname in schema.TIMED_FIELDS:
        described = phase_stats.get(fieldname)
        share = 1.0 if fieldname == schema.STEP else shares.get(fieldname)
        cells = (
            [_ms(described[k]).strip() for k in ("mean", "median", "p90", "max")]
            if described
            else ["-"] * 4
        )
        rows.append(
            f"<tr><td>{html.escape(schema.PHASE_LABELS[fieldname])}</td>"
            + "".join(f"<td>{c}</td>" for c in cells)
            + f"<td>{_share(share).strip()}</td></tr>"
        )
    comm = phase_stats.get(schema.COMM)
    if comm:
        # Inside the phases above (not added to them): time blocked on the other ranks.
        rows.append(
            '<tr><td title="time blocked waiting on other ranks, inside the phases above">'
            "Comm wait (inside)</td>"
            + "".join(f"<td>{_ms(comm[k]).strip()}</td>" for k in ("mean", "median", "p90", "max"))
            + f"<td>{_share(shares.get(schema.COMM_SHARE)).strip()}</td></tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def _html_rank_table(summary: dict[str, Any]) -> str:
    entries = summary.get(schema.SUMMARY_RANKS) or []
    if len(entries) < 2:
        return ""
    slowest = (summary.get(schema.SUMMARY_IMBALANCE) or {}).get(schema.SLOWEST_RANK)
    fields = [schema.STEP, schema.COMM, schema.OWN_MS]
    rows = [
        "<h2>Per rank</h2><table><tr><th>Rank</th><th>median step ms</th>"
        "<th>median comm wait ms</th><th>median own ms</th><th>comm share</th><th>status</th></tr>"
    ]
    for entry in entries:
        stats = entry.get(schema.PHASE_STATS) or {}
        cells = [_ms((stats.get(f) or {}).get("median")).strip() for f in fields]
        share = _share((entry.get(schema.SHARES) or {}).get(schema.COMM_SHARE)).strip()
        status = str(entry.get(schema.STATUS) or "no footer")
        if entry.get(schema.RANK) == slowest:
            status += " (slowest)"
        rows.append(
            f"<tr><td>{html.escape(str(entry.get(schema.RANK)))}</td>"
            + "".join(f"<td>{c}</td>" for c in cells)
            + f"<td>{share}</td><td>{html.escape(status)}</td></tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def _timeline_svg(entry: dict[str, Any], tallest: float) -> str:
    timeline = entry.get(schema.TIMELINE) or {}
    bins = timeline.get("bins") or []
    rank = entry.get(schema.RANK)
    if not bins:
        return f"<p>Rank {rank}: no steps recorded.</p>"
    width, height, left, bottom = 900, 180, 50, 20
    bar = (width - left) / len(bins)
    per_bin = timeline.get("steps_per_bin", 1)
    warmup_bars = -(-int(timeline.get("warmup_steps", 0)) // per_bin)
    shapes = []
    if warmup_bars:
        shapes.append(
            f'<rect x="{left}" y="0" width="{warmup_bars * bar:.2f}" height="{height - bottom}" '
            'fill="#eeeeee"><title>warm-up: not in the statistics</title></rect>'
        )
    for index, entry_bin in enumerate(bins):
        y = height - bottom
        x = left + index * bar
        for phase in schema.PHASES:
            value = entry_bin.get(phase)
            if not value:
                continue
            h = value / tallest * (height - bottom - 10)
            y -= h
            shapes.append(
                f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(bar - 0.5, 0.5):.2f}" '
                f'height="{h:.2f}" fill="{_COLORS[phase]}"/>'
            )
    caption = (
        f"Rank {rank}: {len(bins)} bars of {per_bin} step{'s' if per_bin != 1 else ''} each "
        f"(mean per bar; grey: warm-up); scale {tallest:.1f} ms"
    )
    axis = (
        f'<line x1="{left}" y1="{height - bottom}" x2="{width}" y2="{height - bottom}" '
        'stroke="#333"/>'
        f'<text x="0" y="14" font-size="11">{tallest:.1f} ms</text>'
        f'<text x="{left}" y="{height - 4}" font-size="11">step 0</text>'
    )
    return (
        f'<figure><svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" role="img" aria-label="{html.escape(caption)}">'
        + axis
        + "".join(shapes)
        + f"</svg><figcaption>{html.escape(caption)}</figcaption></figure>"
    )
