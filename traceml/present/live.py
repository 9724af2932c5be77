"""The live view: what a run is doing *while* it runs, read from its rank files.

Three parts, kept apart as in the rest of traceml:

* :class:`RunFollower` reads the rank files incrementally (offsets, only appended bytes, a
  partly written last line kept for the next read, rank files that appear late, a rank that
  died) and keeps, per rank, a bounded window of recent step records.
* Pure functions turn that state into a :class:`LiveView` (steps, steps/s, median step, phase
  shares, slowest rank, a *provisional* verdict from :func:`traceml.analysis.diagnose.diagnose`
  on the window's summary) and render it as one plain line or as a few terminal lines.
* :class:`TerminalPanel` and :class:`LiveMonitor` put it on a terminal (a panel below a scroll
  region, so the training script's own lines keep flowing above it) or as a plain line every
  N seconds (CI logs, Slurm, ``| tee``).

The training processes do no extra work for any of this: the launcher (``traceml run``) or
``traceml watch`` does the reading, in its own process.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from traceml import schema
from traceml.analysis.diagnose import diagnose
from traceml.files import display_path, newest_run

# The parts, re-exported: the launcher, the CLI and the tests import the live view from here.
from traceml.present.live_follow import (  # noqa: F401  # noqa: F401
    _HEAD_BYTES,
    _TAIL_BYTES,
    RankTail,
    RunFollower,
    process_gone,
)
from traceml.present.live_settings import (  # noqa: F401
    DEFAULT_COLLECT_S,
    DEFAULT_INTERVAL_S,
    DEFAULT_WINDOW,
    ENV_COLLECT,
    ENV_INTERVAL,
    REDRAW_S,
    LiveError,
    collect_from_env,
    interval_from_env,
)
from traceml.present.live_terminal import (  # noqa: F401
    LineSchedule,
    LiveMonitor,
    TerminalPanel,
    terminal_mode,
)
from traceml.present.live_text import render_line, render_panel, start_line  # noqa: F401
from traceml.present.live_view import (  # noqa: F401
    COLLECTING,
    FINAL,
    PROVISIONAL,
    WAITING,
    LiveView,
    build_view,
    window_summary,
)


def watch(
    run_dir: Path,
    *,
    thresholds: dict[str, float] | None = None,
    interval_s: float | None = None,
    collect_s: float | None = None,
    html: Path | None = None,
    out: Any = None,
    poll_s: float = REDRAW_S,
) -> int:
    """Follow ``run_dir`` until every rank's file is closed (or Ctrl-C); print the final state."""
    out = out or sys.stdout
    run_dir = Path(run_dir)
    if not (run_dir / schema.RANKS_DIR).is_dir():
        raise LiveError(_not_a_run_dir(run_dir))
    if html is not None and (Path(html).name in ("", ".", "..") or Path(html).is_dir()):
        raise LiveError(f"--html {html} is a directory: give a file name (report.html)")
    interval = interval_s or interval_from_env() or DEFAULT_INTERVAL_S
    collect = collect_s if collect_s is not None else collect_from_env()
    collect = DEFAULT_COLLECT_S if collect is None else collect
    # Ctrl-C may come at any point, the first read of a large run or the final report
    # included: always the same one line, never a traceback.
    try:
        _watch(run_dir, thresholds, interval, collect, html, out, poll_s)
    except KeyboardInterrupt:
        out.write("traceml: stopped watching (the run goes on)\n")
        out.flush()
    return 0


def _watch(
    run_dir: Path,
    thresholds: dict[str, float] | None,
    interval: float,
    collect: float,
    html: Path | None,
    out: Any,
    poll_s: float,
) -> None:
    follower = RunFollower(run_dir)
    follower.poll()
    if follower.finished():
        _print_final(follower, run_dir, thresholds, html, out)
        return
    fd = _fileno(out)
    mode = terminal_mode(fd) if fd is not None else "plain"
    panel = TerminalPanel(fd) if mode == "tty" and fd is not None else None
    out.write(f"traceml: watching {display_path(run_dir)} (Ctrl-C to stop)\n")
    out.flush()
    if panel is not None and not panel.open():
        panel = None  # too small for a panel after all: plain lines
    try:
        ended = _follow(follower, panel, out, thresholds, interval, collect, html, poll_s)
    finally:
        if panel is not None:
            panel.close()
    if ended:
        _print_final(follower, run_dir, thresholds, html, out)


def _follow(
    follower: RunFollower,
    panel: TerminalPanel | None,
    out: Any,
    thresholds: dict[str, float] | None,
    interval: float,
    collect: float,
    html: Path | None,
    poll_s: float,
) -> bool:
    """Poll and show the run until it has finished (True), or until nobody reads the output
    and no --html page is being written (False: ``| head -1`` has what it wanted)."""
    schedule = LineSchedule(interval, time.monotonic(), first_now=True)  # a first line now
    next_html = time.monotonic()
    first = True  # watch() already polled once: a quiet run's first poll finds nothing new
    view, shown_ends, html_due = None, None, True
    while True:
        changed = follower.poll() or first
        first = False
        if follower.finished():
            return True
        if html is None and getattr(out, "broken", False):  # a GuardedStream's reader left
            return False
        # The view is made from the ranks' records alone: with nothing new (and no rank newly
        # ended or taken as dead) the last one stands. Made every poll, a quiet 256-rank run
        # cost 0.65 s of CPU a second (helper review).
        ends = [(tail.closed, tail.dead) for tail in follower.ranks.values()]
        made = view is None or changed or ends != shown_ends
        if made:
            view = build_view(
                follower.ranks, run=follower.run_dir.name, thresholds=thresholds, collect_s=collect
            )
            shown_ends, html_due = ends, True
        now = time.monotonic()
        if panel is not None:
            if made:
                panel.draw(render_panel(view, 10_000))
        elif schedule.due(view, now):
            out.write(render_line(view) + "\n")
            out.flush()
        if html is not None and html_due and now >= next_html and any(view.rank_steps.values()):
            next_html, html_due = now + 5.0, False
            _write_html(html, follower.ranks, thresholds, refresh=True)
        time.sleep(poll_s)


def _fileno(stream: Any) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _print_final(
    follower: RunFollower,
    run_dir: Path,
    thresholds: dict[str, float] | None,
    html: Path | None,
    out: Any,
) -> None:
    """The run is over: the whole run's numbers and verdict, as ``traceml report`` would give."""
    from traceml.analysis.partials import usable_cpu_count
    from traceml.analysis.reduce import ReduceError, reduce_run

    try:  # as `traceml report` by default: the cores this process may use (a 256-rank run: ~50 s
        # in one process)
        summary = reduce_run(run_dir, thresholds=thresholds, jobs=usable_cpu_count())
    except ReduceError as exc:
        raise LiveError(str(exc)) from None
    summary[schema.SUMMARY_VERDICTS] = diagnose(summary)
    view = build_view(
        follower.ranks, run=run_dir.name, thresholds=thresholds, final_summary=summary
    )
    for line in render_panel(view, 10_000):
        if line.strip():  # a run without steps has no numbers: no blank lines for them
            out.write(line.rstrip() + "\n")
    out.write(f"traceml: the run has ended; full report: traceml report {display_path(run_dir)}\n")
    out.flush()
    if html is not None:
        try:
            _write_html_summary(html, summary, refresh=False)
        except OSError as exc:
            raise LiveError(f"cannot write {html}: {exc.strerror or exc}") from None
        out.write(f"traceml: wrote {display_path(html)}\n")


def _write_html(
    path: Path,
    tails: Mapping[int, RankTail],
    thresholds: dict[str, float] | None,
    *,
    refresh: bool,
) -> None:
    summary = window_summary(tails, thresholds)
    summary[schema.SUMMARY_VERDICTS] = diagnose(summary)
    _write_html_summary(path, summary, refresh=refresh)


def _write_html_summary(path: Path, summary: dict[str, Any], *, refresh: bool) -> None:
    from traceml.files import write_atomically
    from traceml.present.report_html import render_html

    page = render_html(summary)
    if refresh:  # the browser reloads the page while the watch rewrites it
        page = page.replace("<head>", '<head><meta http-equiv="refresh" content="5">', 1)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(Path(path), page.encode())
    except OSError:
        if not refresh:  # the last write: the caller says it could not be written
            raise
        # While the run goes on, a failed rewrite leaves the last page; the end says why.


def _not_a_run_dir(path: Path) -> str:
    if not path.exists():
        return f"{path} does not exist"
    newest = newest_run(path)  # (None for a file)
    if newest is not None:
        return (
            f"{path} is not a run directory but holds runs; the newest: "
            f"traceml watch {display_path(newest)}"
        )
    return f"{path} is not a run directory (no {schema.RANKS_DIR}/ folder in it)"
