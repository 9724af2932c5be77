"""The live view in words: one plain line for logs, or the lines of a terminal panel."""

from __future__ import annotations

import re
from pathlib import Path

from traceml import schema
from traceml.analysis.diagnose import label
from traceml.analysis.notes import rank_ranges
from traceml.files import display_path
from traceml.present.live_settings import DEFAULT_INTERVAL_S
from traceml.present.live_view import COLLECTING, FINAL, WAITING, LiveView
from traceml.present.printable import printable

# A rank number in the report's ranges ("1-3, 7 and 2 more ranges"), not the count of more.
_RANK_NUMBER = re.compile(r"(?<!\d)(\d+)(?!\d| more)")

_SHORT_PHASE = {phase: schema.PHASE_SHORT_LABELS[phase] for phase in schema.PHASES}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "not started"
    whole = int(seconds)
    if whole < 60:
        return f"{seconds:.0f}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def _steps_text(view: LiveView) -> str:
    steps = view.rank_steps
    if not steps:
        return ""  # the verdict slot says what is awaited
    if len(steps) <= 4:
        text = " ".join(f"r{rank}={count}" for rank, count in steps.items())
    else:
        low = min(steps, key=lambda rank: steps[rank])
        high = max(steps, key=lambda rank: steps[rank])
        text = f"{len(steps)} ranks {steps[low]}-{steps[high]} (fewest r{low})"
    if view.missing_ranks:
        text += " | no file yet: " + _ranks_text(view.missing_ranks)
    if view.dead_ranks:
        text += " | died: " + _ranks_text(view.dead_ranks)
    return "steps " + text


def _ranks_text(ranks: list[int]) -> str:
    """[1, 2, 3, 7] -> "r1-r3, r7": ranges as the report gives them, so a header claiming a
    million ranks still makes a short line."""
    return _RANK_NUMBER.sub(r"r\1", rank_ranges(ranks, most=8))


def _from_run(text: str | None) -> str:
    """Text a rank file supplied, made safe for a terminal and kept on one line."""
    return printable(" ".join((text or "").split()))


def _shares_text(view: LiveView) -> str:
    parts = [
        f"{_SHORT_PHASE[phase]} {share * 100:.0f}%"
        for phase, share in view.shares.items()
        if share is not None
    ]
    return " ".join(parts)


def _numbers_text(view: LiveView) -> str:
    parts = []
    if view.steps_per_s is not None:
        parts.append(f"{view.steps_per_s:.1f} steps/s")
    if view.median_step_ms is not None:
        scope = "whole run" if view.state == FINAL else f"last {view.window_steps}"
        parts.append(f"median step {view.median_step_ms:.1f} ms ({scope})")
    return " | ".join(parts)


def _slowest_text(view: LiveView) -> str:
    if view.slowest_rank is None or view.slowest_ratio is None:
        return ""
    return f"slowest rank {view.slowest_rank} +{(view.slowest_ratio - 1) * 100:.0f}%"


def _verdict_text(view: LiveView, *, why: bool) -> str:
    if view.state == WAITING:
        return view.collecting or "waiting for the first step"
    if view.state == COLLECTING:
        return f"collecting ({view.collecting}) before a provisional verdict"
    if view.verdict_kind is None:
        return ""
    if view.state == FINAL:
        prefix = "verdict (whole run)"
    else:
        prefix = f"provisional verdict (last {view.window_steps} steps/rank)"
    text = f"{prefix}: {label(view.verdict_kind)}"
    return f"{text} - {_from_run(view.verdict_why)}" if why and view.verdict_why else text


def render_line(view: LiveView) -> str:
    """One plain line (no terminal codes), for logs: every N seconds when not on a terminal."""
    parts = [
        f"traceml live {_from_run(view.run)} [{_duration(view.training_s)}]",
        _steps_text(view),
        _numbers_text(view),
        _shares_text(view),
        _slowest_text(view),
        _verdict_text(view, why=False),
    ]
    return " | ".join(part for part in parts if part)


def render_panel(view: LiveView, width: int) -> list[str]:
    """The terminal panel: three lines, each cut to ``width`` so none wraps (a wrapped line
    would scroll the panel itself)."""
    first = " | ".join(
        p
        for p in (
            f"traceml {_from_run(view.run)} [{_duration(view.training_s)}]",
            _steps_text(view),
            _numbers_text(view),
        )
        if p
    )
    second = " | ".join(p for p in ("  " + _shares_text(view), _slowest_text(view)) if p.strip())
    third = "  " + _verdict_text(view, why=True)
    return [fit(line, width) for line in (first, second, third)]


def fit(line: str, width: int) -> str:
    width = max(width, 10)
    return line if len(line) <= width else line[: width - 3] + "..."


def start_line(
    run_dir: Path, world_size: int, mode: str, interval_s: float = DEFAULT_INTERVAL_S
) -> str:
    """What ``traceml run`` says first: where the run goes and how to watch it."""
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    where = display_path(run_dir)
    how = {
        "tty": "live view below (--no-live: off)",
        "plain": f"live lines once warmed up, then every {interval_s:g} s (--live-interval)",
    }.get(mode, "live view off")
    return f"traceml: run directory {where} ({ranks}); {how}; elsewhere: traceml watch {where}"
