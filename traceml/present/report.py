"""Summary -> the text a user reads (final_summary.txt, the terminal) and report.html. Pure.

Text fits 100 columns: the verdict first, then the phase table, per-rank rows when there is
more than one rank, then notes. The HTML page is :mod:`traceml.present.report_html`.
"""

from __future__ import annotations

import textwrap
from typing import Any

from traceml import schema
from traceml.analysis import resources
from traceml.analysis.diagnose import label, noise_caveat, outside_caveat
from traceml.present.outside_steps import outside_steps_text
from traceml.present.printable import printable
from traceml.present.rank_rows import left_out_line, rows_worth_reading
from traceml.present.report_resources import text_lines as resource_lines

WIDTH = 100
# Rows of missing ranks listed in the per-rank table; the notes give them all, as ranges.
MISSING_ROWS = 8


def format_ms(value: float | None, width: int = 9) -> str:
    if value is None:
        return "-".rjust(width)
    if value >= 1000:
        return f"{value:,.0f}".rjust(width)
    if value >= 100:
        return f"{value:.1f}".rjust(width)
    return f"{value:.2f}".rjust(width)


def format_share(value: float | None, width: int = 7) -> str:
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
        f"{ranks} rank{'s' if ranks != 1 else ''}, {device}; {_steps_analysed(summary)})"
    )


def _steps_analysed(summary: dict[str, Any]) -> str:
    """ "N of M steps analysed", per rank when there are several (the run's totals would count
    each step once per rank: issue 25's "44 of 48" for 22 of 24 steps on each of 2 ranks)."""
    entries = [e for e in summary.get(schema.SUMMARY_RANKS) or [] if isinstance(e, dict)]
    if len(entries) < 2:
        return (
            f"{summary.get(schema.SUMMARY_STEPS_ANALYSED, 0)} of "
            f"{summary.get(schema.SUMMARY_STEPS_RECORDED, 0)} steps analysed"
        )
    analysed = [e.get(schema.SUMMARY_STEPS_ANALYSED) or 0 for e in entries]
    recorded = [e.get(schema.SUMMARY_STEPS_RECORDED) or 0 for e in entries]
    return f"{_span(analysed)} of {_span(recorded)} steps per rank analysed"


def _span(values: list[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"


def banner() -> str:
    """The line that opens the report on a terminal, so it stands out from the training's own
    output and library warnings above it."""
    return " traceml report ".center(WIDTH, "=")


def for_terminal(text: str) -> str:
    """``text`` as printed after a run: a blank line and the banner first."""
    return f"\n{banner()}\n{text}"


def render_text(summary: dict[str, Any]) -> str:
    lines: list[str] = [*_wrap(headline(summary), ""), ""]
    sections = (_verdict_lines, _phase_lines, input_lines, _rank_section, resource_lines)
    for section in (*sections, _note_lines):
        block = section(summary)
        if block:
            lines.extend([*block, ""])
    lines.append(f"Summary: {summary.get(schema.SUMMARY_RUN_DIR, '.')}/{schema.SUMMARY_JSON}")
    return printable("\n".join(line.rstrip() for line in lines) + "\n")


def input_lines(summary: dict[str, Any]) -> list[str]:
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
    for caveat in (noise_caveat(summary), outside_caveat(summary)):
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
    lines.extend(_wrap(_adding_up(phase_stats), "  "))
    return [*lines, "", *_throughput_lines(summary)]


def _adding_up(phase_stats: dict[str, Any]) -> str:
    """Whether the phase means add up to the step mean, as the table shows them: only when
    every phase was measured on every step (rule 2: a phase measured on some steps only has
    its mean over those, and the sentence would be false)."""
    step = phase_stats[schema.STEP]
    fewer = [
        f"{schema.PHASE_LABELS[fieldname]} on {described['count']:,} of {step['count']:,}"
        for fieldname in schema.PHASES
        if (described := phase_stats.get(fieldname)) and described["count"] < step["count"]
    ]
    if fewer:
        return (
            f"Some phases were measured on fewer steps than the step time ({', '.join(fewer)}): "
            "their means and shares are over those steps, so the phase means need not add up "
            "to the step mean."
        )
    total = sum(d["mean"] for f in schema.PHASES if (d := phase_stats.get(f)))
    if abs(total - step["mean"]) > 0.005 * step["mean"] + 0.01:
        return (
            f"The phase means add up to {total:.2f} ms of the step mean's {step['mean']:.2f} "
            "ms; medians and p90s are of each phase on its own (taken from different steps)."
        )
    return (
        "The phase means add up to the step mean; medians and p90s are of each phase on its "
        "own (taken from different steps), so they need not add up."
    )


def _phase_row(
    fieldname: str, phase_stats: dict[str, Any], shares: dict[str, Any], has_gpu: bool
) -> str:
    described = phase_stats.get(fieldname)
    share = 1.0 if fieldname == schema.STEP else shares.get(fieldname)
    row = f"  {schema.PHASE_LABELS[fieldname]:<12}"
    if described:
        row += "".join(format_ms(described[k]) for k in ("mean", "median", "p90", "max"))
        row += format_share(share, 8)
    else:
        row += "  not measured".ljust(44)
    if has_gpu:
        gpu_field = schema.GPU_OF_PHASE.get(fieldname)
        gpu = phase_stats.get(gpu_field) if gpu_field else None
        gpu_share = shares.get(gpu_field) if gpu_field else None
        if fieldname == schema.STEP and gpu:
            gpu_share = 1.0
        row += format_ms(gpu["mean"] if gpu else None) + format_share(gpu_share, 10)
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
        + format_ms(comm["mean"])
        + format_ms(comm["median"])
        + format_ms(comm["p90"])
        + format_ms(comm["max"])
        + format_share(shares.get(schema.COMM_SHARE), 8)
    )
    gpu = phase_stats.get(schema.GPU_COMM)
    if gpu:
        row += format_ms(gpu["mean"]) + format_share(shares.get(schema.GPU_COMM_SHARE), 10)
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
    outside = outside_steps_text(summary)
    lines = _wrap(";  ".join(parts), "  ") + (_wrap(outside, "  ") if outside else [])
    return lines + own_cost_lines(summary)


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
    by = schema.OWN_MS if with_comm else schema.STEP
    shown, left = rows_worth_reading(
        entries,
        lambda e: ((e.get(schema.PHASE_STATS) or {}).get(by) or {}).get("median"),
        lambda e: e.get(schema.STATUS) != schema.STATUS_COMPLETED,
    )
    for entry in shown:
        stats = entry.get(schema.PHASE_STATS) or {}
        node = entry.get(schema.NODE_RANK)
        row = f"  {entry[schema.RANK]:<5}"
        if show_node:
            row += f"{'-' if node is None else node:<5}"
        row += f"{entry.get(schema.SUMMARY_STEPS_ANALYSED, 0):>6}"
        for fieldname in columns:
            described = stats.get(fieldname)
            row += format_ms(described["median"] if described else None, width)
        if with_comm:
            row += format_share((entry.get(schema.SHARES) or {}).get(schema.COMM_SHARE), width)
        status = entry.get(schema.STATUS) or "no footer"
        if slowest == entry[schema.RANK] and len(entries) > 1:
            status += " (slowest)"
        lines.append(f"{row}  {status}")
    if left:
        lines.append(left_out_line(left, "longest " + ("own time" if with_comm else "step")))
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
