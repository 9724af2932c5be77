"""Summary -> report.html: self-contained (inline CSS and SVG, no script, no network), with the
verdicts, the phase table, the per-rank table, a per-rank timeline of step time stacked by
phase, the resources, the notes and the report's text. Pure."""

from __future__ import annotations

import html
from typing import Any

from traceml import schema
from traceml.analysis.diagnose import label
from traceml.present.rank_rows import left_out_line, rows_worth_reading
from traceml.present.report import (
    format_ms,
    format_share,
    headline,
    input_lines,
    render_text,
)
from traceml.present.report_resources import html_section as resource_html

_COLORS = {
    schema.INPUT_WAIT: "#e4572e",
    schema.H2D: "#f3a712",
    schema.FORWARD: "#29335c",
    schema.BACKWARD: "#4f6d7a",
    schema.OPTIMIZER: "#669bbc",
    schema.RESIDUAL: "#a8c686",
}


_STYLE = [
    "body{font-family:system-ui,sans-serif;margin:2em;max-width:70em;color:#222}",
    ".verdict{border-left:6px solid #888;padding:.5em 1em;margin:1em 0;background:#f6f6f6}",
    ".critical{border-color:#c0392b}.warn{border-color:#e67e22}.info{border-color:#2980b9}",
    "table{border-collapse:collapse}td,th{padding:.2em .8em;text-align:right}",
    "th:first-child,td:first-child{text-align:left}tr:nth-child(even){background:#f4f4f4}",
    ".legend span{display:inline-block;margin-right:1em}",
    ".swatch{display:inline-block;width:.9em;height:.9em;margin-right:.3em;vertical-align:middle}",
    "pre{background:#f6f6f6;padding:1em;overflow:auto}",
]


def render_html(summary: dict[str, Any]) -> str:
    esc = html.escape
    verdicts = summary.get(schema.SUMMARY_VERDICTS) or []
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>traceml: {esc(str(summary.get(schema.RUN)))}</title>",
        "<style>",
        *_STYLE,
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
    parts.extend(_timelines_html(summary))
    parts.append(resource_html(summary))
    notes = summary.get(schema.SUMMARY_NOTES) or []
    if notes:
        parts.append("<h2>Notes</h2><ul>")
        parts.extend(f"<li>{esc(note)}</li>" for note in notes)
        parts.append("</ul>")
    parts.append("<h2>Report text</h2><pre>" + esc(render_text(summary)) + "</pre>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _timelines_html(summary: dict[str, Any]) -> list[str]:
    """Each charted rank's step timeline, on one scale (:mod:`rank_rows` picks the ranks)."""
    esc = html.escape
    parts = ["<h2>Step time per rank, stacked by phase</h2>"]
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
    charted, left = rows_worth_reading(
        ranks,
        lambda e: ((e.get(schema.PHASE_STATS) or {}).get(schema.STEP) or {}).get("median"),
        lambda e: e.get(schema.STATUS) != schema.STATUS_COMPLETED,
    )
    for entry in charted:
        parts.append(_timeline_svg(entry, tallest or 1.0))
    if left:
        parts.append(f"<p>{esc(left_out_line(left, 'longest step').strip())}</p>")
    return parts


def _input_html(summary: dict[str, Any]) -> str:
    """The input pipeline's breakdown as a section of report.html (empty when not timed)."""
    lines = input_lines(summary)
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
            [format_ms(described[k]).strip() for k in ("mean", "median", "p90", "max")]
            if described
            else ["-"] * 4
        )
        rows.append(
            f"<tr><td>{html.escape(schema.PHASE_LABELS[fieldname])}</td>"
            + "".join(f"<td>{c}</td>" for c in cells)
            + f"<td>{format_share(share).strip()}</td></tr>"
        )
    comm = phase_stats.get(schema.COMM)
    if comm:
        # Inside the phases above (not added to them): time blocked on the other ranks.
        rows.append(
            '<tr><td title="time blocked waiting on other ranks, inside the phases above">'
            "Comm wait (inside)</td>"
            + "".join(
                f"<td>{format_ms(comm[k]).strip()}</td>" for k in ("mean", "median", "p90", "max")
            )
            + f"<td>{format_share(shares.get(schema.COMM_SHARE)).strip()}</td></tr>"
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
        cells = [format_ms((stats.get(f) or {}).get("median")).strip() for f in fields]
        share = format_share((entry.get(schema.SHARES) or {}).get(schema.COMM_SHARE)).strip()
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
