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

import contextlib
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from traceml import schema
from traceml.analysis.diagnose import diagnose, label
from traceml.analysis.reduce import RankRecords, list_rank_files, parse_lines, reduce_records
from traceml.errors import UsageError
from traceml.files import display_path
from traceml.thresholds import resolve_thresholds

DEFAULT_WINDOW = 100  # steps per rank the provisional verdict looks at
DEFAULT_INTERVAL_S = 30.0  # plain-line period when the output is not a terminal
DEFAULT_COLLECT_S = 60.0  # least training time before the first provisional verdict
REDRAW_S = 1.0  # a terminal panel changes at most this often
ENV_INTERVAL = "TRACEML_LIVE_INTERVAL_S"
ENV_COLLECT = "TRACEML_LIVE_COLLECT_S"

# A rank file whose backlog is larger than this is not read whole: the reader takes the head
# (header, first step) and the last _TAIL_BYTES, which hold far more lines than a window (a
# step line is ~0.6 KB), so catching up on a day-old run costs the same as on a new one.
_TAIL_BYTES = 512 * 1024
_HEAD_BYTES = 64 * 1024
# A "line" this long without a newline is not a record being written: drop it.
_MAX_PENDING = 1024 * 1024
# A rank file that has not grown for this long, whose process is gone, is a dead rank.
_DEAD_AFTER_S = 5.0

WAITING = "waiting"
COLLECTING = "collecting"
PROVISIONAL = "provisional"
FINAL = "final"

_SHORT_PHASE = {phase: schema.PHASE_SHORT_LABELS[phase] for phase in schema.PHASES}


class LiveError(UsageError):
    """A problem with what the user asked of the live view; one line, exit code 2 (cli.main)."""


# ----------------------------------------------------------------------------------------------
# Reading: one rank file, then the whole run directory


@dataclass
class RankTail:
    """What has been read of one rank file so far, and its most recent steps."""

    rank: int
    path: Path
    window: int = DEFAULT_WINDOW
    offset: int = 0  # bytes of the file consumed (up to the end of the last complete line)
    pending: bytes = b""  # the start of a line whose newline has not been written yet
    header: dict[str, Any] | None = None
    footer: dict[str, Any] | None = None
    steps: int = 0  # steps the rank has recorded (from the records' own step index)
    first_t_ms: float | None = None  # start of the rank's first step, on its own clock
    last_end_ms: float | None = None  # end of its latest step
    bad_lines: int = 0
    recent: deque[dict[str, Any]] = field(default_factory=deque)
    grown_at: float | None = None  # monotonic time the file last grew (set by the follower)
    dead: bool = False  # its process is gone and it never wrote a footer

    def __post_init__(self) -> None:
        self.recent = deque(self.recent, maxlen=self.window)

    @property
    def closed(self) -> bool:
        return self.footer is not None

    def feed(self, data: bytes) -> int:
        """Consume appended bytes; returns how many complete records they finished."""
        if not data:
            return 0
        data = self.pending + data
        cut = data.rfind(b"\n")
        if cut < 0:
            self.pending = data if len(data) <= _MAX_PENDING else b""
            if len(data) > _MAX_PENDING:
                self.bad_lines += 1
            return 0
        self.pending = data[cut + 1 :]
        lines = [line for line in data[:cut].split(b"\n") if line.strip()]
        for record in parse_lines(lines):
            if record is None:
                self.bad_lines += 1
            else:
                self._take(record)
        return len(lines)

    def _take(self, record: dict[str, Any]) -> None:
        kind = record.get(schema.KIND)
        if kind == schema.KIND_STEP:
            index = record.get(schema.STEP_INDEX)
            self.steps = index + 1 if isinstance(index, int) else self.steps + 1
            start = record.get(schema.T_START_MS)
            if isinstance(start, (int, float)):
                if self.first_t_ms is None:
                    self.first_t_ms = float(start)
                self.last_end_ms = float(start) + float(record.get(schema.STEP) or 0.0)
            self.recent.append(record)
        elif kind == schema.KIND_HEADER and self.header is None:
            self.header = record
        elif kind == schema.KIND_FOOTER:
            self.footer = record


class RunFollower:
    """Follows every ``ranks/rank_<R>.jsonl`` of a run directory, reading only what was appended.

    ``poll()`` costs a directory listing plus one ``stat`` per rank, and reads only new bytes
    (at most a head and a tail of a large backlog); memory is the window per rank.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        window: int = DEFAULT_WINDOW,
        clock: Callable[[], float] = time.monotonic,
        is_process_gone: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.window = window
        self.ranks: dict[int, RankTail] = {}
        self.bytes_read = 0
        self._clock = clock
        self._is_process_gone = is_process_gone or process_gone
        self._manifest_mtime: float | None = None
        self.launcher_ended = False

    def poll(self) -> bool:
        """Read what the ranks appended since the last poll. Returns whether anything changed."""
        changed = False
        now = self._clock()
        for rank, path in list_rank_files(self.run_dir).items():
            tail = self.ranks.get(rank)
            if tail is None:
                tail = self.ranks[rank] = RankTail(rank=rank, path=path, window=self.window)
                tail.grown_at = now
                changed = True
            try:
                size = os.stat(path).st_size
            except OSError:
                continue
            if size > tail.offset:
                changed = self._read(tail, size) or changed
                tail.grown_at = now
            elif self._has_died(tail, now):
                tail.dead = True
                changed = True
        changed = self._check_manifest() or changed
        return changed

    def _has_died(self, tail: RankTail, now: float) -> bool:
        """No footer, no growth for a while, and its process is gone (checked only then)."""
        if tail.closed or tail.dead or tail.header is None:
            return False
        if now - (tail.grown_at or now) < _DEAD_AFTER_S:
            return False
        return self._is_process_gone(tail.header)

    def _read(self, tail: RankTail, size: int) -> bool:
        try:
            with open(tail.path, "rb") as handle:
                backlog = size - tail.offset
                if tail.offset == 0 and backlog > _HEAD_BYTES + 2 * _TAIL_BYTES:
                    # The header and the first step (the start of the rank's clock) are at the
                    # head; the rest of a long backlog is older than any window.
                    head = handle.read(_HEAD_BYTES)
                    self.bytes_read += len(head)
                    tail.feed(head[: head.rfind(b"\n") + 1])
                    tail.offset = _HEAD_BYTES
                    backlog = size - tail.offset
                if backlog > 2 * _TAIL_BYTES:
                    handle.seek(size - _TAIL_BYTES)
                    data = handle.read(_TAIL_BYTES)
                    # The jump lands mid-line: everything up to the first newline is a fragment.
                    data = data[data.find(b"\n") + 1 :]
                    tail.pending = b""
                    tail.offset = size
                    self.bytes_read += _TAIL_BYTES
                else:
                    handle.seek(tail.offset)
                    data = handle.read(backlog)
                    tail.offset += len(data)
                    self.bytes_read += len(data)
        except OSError:
            return False
        tail.feed(data)
        return True

    def _check_manifest(self) -> bool:
        """``traceml run`` records its end in manifest.json: then no rank will write more."""
        path = self.run_dir / schema.MANIFEST_JSON
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            return False
        if mtime == self._manifest_mtime:
            return False
        self._manifest_mtime = mtime
        try:
            manifest = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return False
        ended = isinstance(manifest, dict) and manifest.get("ended_at") is not None
        changed = ended and not self.launcher_ended
        self.launcher_ended = self.launcher_ended or ended
        return changed

    def world_size(self) -> int | None:
        sizes = [
            tail.header.get(schema.WORLD_SIZE)
            for tail in self.ranks.values()
            if tail.header is not None and isinstance(tail.header.get(schema.WORLD_SIZE), int)
        ]
        return max(sizes) if sizes else None

    def finished(self, world_size: int | None = None) -> bool:
        """Every expected rank has closed its file (or died), or the launcher has ended."""
        if self.launcher_ended:
            return True
        size = world_size or self.world_size()
        if not size:
            return False
        return all(
            rank in self.ranks and (self.ranks[rank].closed or self.ranks[rank].dead)
            for rank in range(size)
        )


def process_gone(header: dict[str, Any]) -> bool:
    """Whether the process that wrote ``header`` has exited (only knowable on its own host)."""
    pid = header.get(schema.PID)
    if not isinstance(pid, int) or header.get(schema.HOST) != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by someone else
        return False
    return False


# ----------------------------------------------------------------------------------------------
# The view (pure: state in, numbers and text out)


@dataclass(frozen=True)
class LiveView:
    """Everything the live view shows at one moment."""

    run: str
    state: str  # WAITING, COLLECTING, PROVISIONAL or FINAL
    world_size: int | None
    rank_steps: dict[int, int]
    missing_ranks: list[int]
    closed_ranks: list[int]
    dead_ranks: list[int]
    window_steps: int  # steady steps per rank the numbers below come from (the smallest rank)
    training_s: float | None  # first step start to latest step end, the longest rank
    steps_per_s: float | None
    median_step_ms: float | None
    shares: dict[str, float | None]
    slowest_rank: int | None
    slowest_ratio: float | None  # its own time over the other ranks' median
    verdict_kind: str | None
    verdict_why: str | None
    collecting: str | None  # what the provisional verdict still waits for


def window_summary(
    tails: Mapping[int, RankTail], thresholds: dict[str, float] | None = None
) -> dict[str, Any]:
    """The summary of each rank's recent steady steps, as :func:`reduce.reduce_run` builds one.

    The window already leaves each rank's warm-up steps out, so the reducer skips none.
    """
    limits = resolve_thresholds(thresholds)
    warmup = int(limits["warmup_steps"])
    ranks = []
    for rank, tail in sorted(tails.items()):
        data = RankRecords(rank=rank, path=tail.path, header=tail.header)
        steady = _steady(tail, warmup)
        for name, column in data.columns.items():
            column.extend(record.get(name) for record in steady)
        ranks.append(data)
    return reduce_records(ranks, thresholds={**limits, "warmup_steps": 0}, run_name="live")


def _steady(tail: RankTail, warmup: int) -> list[dict[str, Any]]:
    return [
        record
        for record in tail.recent
        if not isinstance(record.get(schema.STEP_INDEX), int) or record[schema.STEP_INDEX] >= warmup
    ]


def _window_rate(tail: RankTail, warmup: int) -> float | None:
    """Steps per second over the window, validation and other pauses between steps included."""
    steady = _steady(tail, warmup)
    if len(steady) < 2:
        return None
    first, last = steady[0].get(schema.T_START_MS), steady[-1].get(schema.T_START_MS)
    if not isinstance(first, (int, float)) or not isinstance(last, (int, float)):
        return None
    span_ms = last + float(steady[-1].get(schema.STEP) or 0.0) - first
    return len(steady) * 1000.0 / span_ms if span_ms > 0 else None


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def build_view(
    tails: Mapping[int, RankTail],
    *,
    run: str,
    world_size: int | None = None,
    thresholds: dict[str, float] | None = None,
    collect_s: float = DEFAULT_COLLECT_S,
    final_summary: dict[str, Any] | None = None,
) -> LiveView:
    """What to show for ``tails``: numbers from the window's summary, and a provisional verdict
    once every rank has warm-up + ``min_steps`` steps and the run has trained ``collect_s``.

    With ``final_summary`` (the whole run, verdicts included) the view shows that instead.
    """
    limits = resolve_thresholds(thresholds)
    warmup = int(limits["warmup_steps"])
    common = _common_view_fields(tails, run, world_size)
    training_s = common["training_s"]
    expected = range(common["world_size"] or 0)
    if not any(common["rank_steps"].values()):
        return LiveView(
            **common,
            state=FINAL if final_summary is not None else WAITING,
            window_steps=0,
            steps_per_s=None,
            median_step_ms=None,
            shares={},
            slowest_rank=None,
            slowest_ratio=None,
            verdict_kind=None,
            verdict_why=None,
            collecting="waiting for the first step" if tails else "waiting for the first rank file",
        )

    if final_summary is not None:
        summary = final_summary
        verdicts = summary.get(schema.SUMMARY_VERDICTS) or diagnose(summary)
        state, collecting = FINAL, None
    else:
        summary = window_summary(tails, limits)
        waits = _still_collecting(tails, expected, training_s, collect_s, limits)
        verdicts = [] if waits else diagnose(summary)
        state = COLLECTING if waits else PROVISIONAL
        collecting = ", ".join(waits) if waits else None

    overall = summary.get(schema.SUMMARY_OVERALL) or {}
    step_stats = (overall.get(schema.PHASE_STATS) or {}).get(schema.STEP) or {}
    analysed = [
        e.get(schema.SUMMARY_STEPS_ANALYSED, 0) for e in summary.get(schema.SUMMARY_RANKS, [])
    ]
    if final_summary is not None:
        steps_per_s = overall.get(schema.STEPS_PER_S)
    else:
        steps_per_s = _median(
            [r for r in (_window_rate(t, warmup) for t in tails.values()) if r is not None]
        )
    slowest_rank, slowest_ratio = _slowest(summary)
    headline = verdicts[0] if verdicts else None
    return LiveView(
        **common,
        state=state,
        window_steps=min(analysed) if analysed else 0,
        steps_per_s=steps_per_s,
        median_step_ms=step_stats.get("median"),
        shares={p: (overall.get(schema.SHARES) or {}).get(p) for p in schema.PHASES},
        slowest_rank=slowest_rank,
        slowest_ratio=slowest_ratio,
        verdict_kind=headline["kind"] if headline else None,
        verdict_why=headline["why"] if headline else None,
        collecting=collecting,
    )


def _common_view_fields(
    tails: Mapping[int, RankTail], run: str, world_size: int | None
) -> dict[str, Any]:
    """What the view shows whatever the state: ranks, steps so far, training time."""
    headers = [t.header.get(schema.WORLD_SIZE) for t in tails.values() if t.header]
    sizes = [s for s in (world_size, *headers) if isinstance(s, int)]
    size = max(sizes) if sizes else (max(tails) + 1 if tails else None)
    spans = [
        (t.last_end_ms - t.first_t_ms) / 1000.0
        for t in tails.values()
        if t.first_t_ms is not None and t.last_end_ms is not None
    ]
    return {
        "run": _run_name(tails, run),
        "world_size": size,
        "rank_steps": {rank: tails[rank].steps for rank in sorted(tails)},
        "missing_ranks": [rank for rank in range(size or 0) if rank not in tails],
        "closed_ranks": [rank for rank, t in sorted(tails.items()) if t.closed],
        "dead_ranks": [rank for rank, t in sorted(tails.items()) if t.dead],
        "training_s": max(spans) if spans else None,
    }


def _still_collecting(
    tails: Mapping[int, RankTail],
    expected: range,
    training_s: float | None,
    collect_s: float,
    limits: dict[str, float],
) -> list[str]:
    """What a provisional verdict still waits for (warm-up + min_steps on every rank, and
    ``collect_s`` of training); empty when it can be given."""
    needed = int(limits["warmup_steps"]) + int(limits["min_steps"])
    short = [rank for rank in expected if rank not in tails or tails[rank].steps < needed]
    waits = []
    if short:
        fewest = min((tails[r].steps if r in tails else 0) for r in short)
        waits.append(f"{fewest}/{needed} steps on rank {short[0]}")
    if (training_s or 0.0) < collect_s:
        waits.append(f"{training_s or 0.0:.0f}/{collect_s:.0f} s")
    return waits


def _run_name(tails: Mapping[int, RankTail], fallback: str) -> str:
    for tail in tails.values():
        if tail.header and tail.header.get(schema.RUN):
            return str(tail.header[schema.RUN])
    return fallback


def _slowest(summary: dict[str, Any]) -> tuple[int | None, float | None]:
    """The slowest rank by its own time (step minus Backward, where DDP's fast ranks wait)."""
    fields = (summary.get(schema.SUMMARY_IMBALANCE) or {}).get(schema.IMBALANCE_FIELDS) or {}
    entry = fields.get(schema.OWN_MS) or fields.get(schema.STEP)
    if not entry or entry.get("max_over_others") is None:
        return None, None
    return entry["slowest_rank"], entry["max_over_others"]


# ----------------------------------------------------------------------------------------------
# Text


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
        text += " | no file yet: " + ",".join(f"r{rank}" for rank in view.missing_ranks)
    if view.dead_ranks:
        text += " | died: " + ",".join(f"r{rank}" for rank in view.dead_ranks)
    return "steps " + text


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
    return f"{text} - {view.verdict_why}" if why and view.verdict_why else text


def render_line(view: LiveView) -> str:
    """One plain line (no terminal codes), for logs: every N seconds when not on a terminal."""
    parts = [
        f"traceml live {view.run} [{_duration(view.training_s)}]",
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
            f"traceml {view.run} [{_duration(view.training_s)}]",
            _steps_text(view),
            _numbers_text(view),
        )
        if p
    )
    second = " | ".join(p for p in ("  " + _shares_text(view), _slowest_text(view)) if p.strip())
    third = "  " + _verdict_text(view, why=True)
    return [_fit(line, width) for line in (first, second, third)]


def _fit(line: str, width: int) -> str:
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
        "plain": f"a live line every {interval_s:g} s (--live-interval)",
    }.get(mode, "live view off")
    return f"traceml: run directory {where} ({ranks}); {how}; elsewhere: traceml watch {where}"


def interval_from_env(environ: Mapping[str, str] | None = None) -> float | None:
    """``TRACEML_LIVE_INTERVAL_S`` as seconds, or None when unset; LiveError when unusable."""
    return _seconds_from_env(ENV_INTERVAL, environ, minimum_exclusive=0.0)


def collect_from_env(environ: Mapping[str, str] | None = None) -> float | None:
    """``TRACEML_LIVE_COLLECT_S``: least training time before the first provisional verdict."""
    return _seconds_from_env(ENV_COLLECT, environ, minimum_exclusive=None)


def _seconds_from_env(
    name: str, environ: Mapping[str, str] | None, minimum_exclusive: float | None
) -> float | None:
    # The launcher's and watch's own knobs: read here, in the reading process, because no
    # training process ever needs them (settings.py holds what the ranks read).
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise LiveError(f"{name}={raw!r} is not a number of seconds") from None
    if value != value or value < 0 or (minimum_exclusive is not None and value <= 0):
        raise LiveError(f"{name}={raw!r} must be a positive number of seconds")
    return value


# ----------------------------------------------------------------------------------------------
# Terminal output


class TerminalPanel:
    """A few lines pinned to the bottom of a terminal, under a scroll region.

    Other processes writing to the same terminal (the training script) scroll inside the region
    above the panel, so neither garbles the other. Each draw is one ``write``: the tty layer
    does not interleave one write with another process's writes, and the cursor is saved and
    restored around it, so the script's output continues where it was.
    """

    def __init__(self, fd: int, height: int = 3) -> None:
        self.fd = fd
        self.height = height
        self._size: tuple[int, int] | None = None
        self._open = False

    def _terminal_size(self) -> tuple[int, int]:
        try:
            size = os.get_terminal_size(self.fd)
            return size.columns, size.lines
        except OSError:
            return 80, 24

    def _write(self, text: str) -> None:
        with contextlib.suppress(OSError):
            os.write(self.fd, text.encode("utf-8", "replace"))

    def open(self) -> None:
        columns, rows = self._terminal_size()
        if rows <= self.height + 2:
            return
        self._size = (columns, rows)
        region = rows - self.height
        # Make room first (scroll the screen up by the panel's height), then confine scrolling
        # to the rows above the panel; setting a region homes the cursor, so save/restore it.
        self._write(
            "\n" * self.height + f"\x1b[{self.height}A" + "\x1b7" + f"\x1b[1;{region}r" + "\x1b8"
        )
        self._open = True

    def draw(self, lines: list[str]) -> None:
        if not self._open:
            return
        columns, rows = self._terminal_size()
        if (columns, rows) != self._size:  # resized: pin the panel to the new bottom
            self._size = (columns, rows)
            self._write(f"\x1b7\x1b[1;{rows - self.height}r\x1b8")
        out = ["\x1b7"]
        for index in range(self.height):
            text = _fit(lines[index], columns - 1) if index < len(lines) else ""
            out.append(f"\x1b[{rows - self.height + 1 + index};1H\x1b[2K{text}")
        out.append("\x1b8")
        self._write("".join(out))

    def close(self) -> None:
        """Give the whole screen back and blank the panel's rows."""
        if not self._open:
            return
        self._open = False
        _columns, rows = self._terminal_size()
        out = ["\x1b7", "\x1b[r"]  # the full screen scrolls again
        for index in range(self.height):
            out.append(f"\x1b[{rows - self.height + 1 + index};1H\x1b[2K")
        out.append("\x1b8")
        self._write("".join(out))


def terminal_mode(fd: int) -> str:
    """How to show the live view on ``fd``: ``"tty"`` (a redrawn panel), ``"plain"`` (a line
    every N seconds, no terminal codes) or ``"off"``."""
    try:
        if not os.isatty(fd):
            return "plain"
    except OSError:
        return "plain"
    try:
        import termios

        # The launcher hands the terminal's foreground to the script's process group; with
        # `stty tostop` any write from the launcher would then stop it with SIGTTOU.
        if termios.tcgetattr(fd)[3] & termios.TOSTOP:
            return "off"
        if os.tcgetpgrp(fd) != os.getpgrp():  # started in the background (`&`): no panel
            return "plain"
    except (ImportError, OSError):
        return "plain"
    if os.environ.get("TERM", "") in ("", "dumb"):  # no cursor movement
        return "plain"
    return "tty"


class LiveMonitor:
    """The live view of ``traceml run``: a thread in the launcher that polls the run directory
    while the script runs, and draws a panel (terminal) or prints a line every ``interval_s``."""

    def __init__(
        self,
        run_dir: Path,
        *,
        mode: str,
        fd: int = 2,
        world_size: int | None = None,
        thresholds: dict[str, float] | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        collect_s: float = DEFAULT_COLLECT_S,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        self.follower = RunFollower(run_dir, window=window)
        self.mode = mode
        self.fd = fd
        self.world_size = world_size
        self.thresholds = thresholds
        self.interval_s = interval_s
        self.collect_s = collect_s
        self.panel = TerminalPanel(fd) if mode == "tty" else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lines_printed = 0

    def start(self) -> None:
        if self.panel is not None:
            self.panel.open()
        self._thread = threading.Thread(target=self._loop, name="traceml-live", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.panel is not None:
            self.panel.close()

    def view(self) -> LiveView:
        return build_view(
            self.follower.ranks,
            run=self.follower.run_dir.name,
            world_size=self.world_size,
            thresholds=self.thresholds,
            collect_s=self.collect_s,
        )

    def _loop(self) -> None:
        next_line = time.monotonic() + self.interval_s
        dirty = True
        while not self._stop.wait(REDRAW_S):
            try:
                dirty = self.follower.poll() or dirty
                if self.panel is not None:
                    if dirty:
                        self.panel.draw(render_panel(self.view(), 10_000))
                        dirty = False
                elif time.monotonic() >= next_line:
                    next_line += self.interval_s
                    self._print(render_line(self.view()))
            except Exception as exc:  # the view must never take the launcher down
                self._print(f"traceml: live view stopped ({type(exc).__name__}: {exc})")
                return

    def _print(self, line: str) -> None:
        with contextlib.suppress(OSError):
            os.write(self.fd, (line + "\n").encode("utf-8", "replace"))
        self.lines_printed += 1


# ----------------------------------------------------------------------------------------------
# traceml watch


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
    interval = interval_s or interval_from_env() or DEFAULT_INTERVAL_S
    collect = collect_s if collect_s is not None else collect_from_env()
    collect = DEFAULT_COLLECT_S if collect is None else collect
    follower = RunFollower(run_dir)
    follower.poll()
    if follower.finished():
        _print_final(follower, run_dir, thresholds, html, out)
        return 0

    fd = _fileno(out)
    mode = terminal_mode(fd) if fd is not None else "plain"
    panel = TerminalPanel(fd) if mode == "tty" and fd is not None else None
    out.write(f"traceml: watching {display_path(run_dir)} (Ctrl-C to stop)\n")
    out.flush()
    if panel is not None:
        panel.open()
    next_line = time.monotonic()  # a first line straight away, then every interval
    next_html = time.monotonic()
    try:
        while True:
            changed = follower.poll()
            if follower.finished():
                break
            view = build_view(
                follower.ranks, run=run_dir.name, thresholds=thresholds, collect_s=collect
            )
            now = time.monotonic()
            if panel is not None:
                if changed:
                    panel.draw(render_panel(view, 10_000))
            elif now >= next_line:
                next_line = now + interval
                out.write(render_line(view) + "\n")
                out.flush()
            if html is not None and now >= next_html and any(view.rank_steps.values()):
                next_html = now + 5.0
                _write_html(html, follower.ranks, thresholds, refresh=True)
            time.sleep(poll_s)
    except KeyboardInterrupt:
        if panel is not None:
            panel.close()
        out.write("traceml: stopped watching (the run goes on)\n")
        return 0
    if panel is not None:
        panel.close()
    _print_final(follower, run_dir, thresholds, html, out)
    return 0


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
    from traceml.analysis.reduce import ReduceError, reduce_run

    try:
        summary = reduce_run(run_dir, thresholds=thresholds)
    except ReduceError as exc:
        raise LiveError(str(exc)) from None
    summary[schema.SUMMARY_VERDICTS] = diagnose(summary)
    view = build_view(
        follower.ranks, run=run_dir.name, thresholds=thresholds, final_summary=summary
    )
    for line in render_panel(view, 10_000):
        out.write(line.rstrip() + "\n")
    out.write(f"traceml: the run has ended; full report: traceml report {display_path(run_dir)}\n")
    out.flush()
    if html is not None:
        _write_html_summary(html, summary, refresh=False)
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
    from traceml.present.report import render_html

    page = render_html(summary)
    if refresh:  # the browser reloads the page while the watch rewrites it
        page = page.replace("<head>", '<head><meta http-equiv="refresh" content="5">', 1)
    with contextlib.suppress(OSError):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(Path(path), page.encode())


def _not_a_run_dir(path: Path) -> str:
    if not path.exists():
        return f"{path} does not exist"
    if path.is_dir():
        runs = sorted(
            (p for p in path.iterdir() if (p / schema.RANKS_DIR).is_dir()),
            key=lambda p: p.stat().st_mtime,
        )
        if runs:
            return (
                f"{path} is not a run directory but holds runs; the newest: "
                f"traceml watch {display_path(runs[-1])}"
            )
    return f"{path} is not a run directory (no {schema.RANKS_DIR}/ folder in it)"
