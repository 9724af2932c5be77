"""Putting the live view on a terminal: a panel pinned under a scroll region, or a plain line
every N seconds; :class:`LiveMonitor` is the launcher's thread that polls and draws."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from traceml.present.live_follow import RunFollower
from traceml.present.live_settings import (
    DEFAULT_COLLECT_S,
    DEFAULT_INTERVAL_S,
    DEFAULT_WINDOW,
    REDRAW_S,
)
from traceml.present.live_text import fit, render_line, render_panel
from traceml.present.live_view import WAITING, LiveView, build_view

PANEL_HEIGHT = 3
MIN_COLUMNS = 20  # narrower than this, the panel's lines say nothing


class LineSchedule:
    """When a plain live line is due: as soon as there are numbers (the warm-up is over),
    whenever the state or the verdict changes, and every ``interval_s`` in between; so a short
    run shows something useful early, and a long one a line per interval."""

    def __init__(self, interval_s: float, now: float, *, first_now: bool = False) -> None:
        self.interval_s = interval_s
        self._next = now if first_now else now + interval_s
        self._shown: tuple[bool, str, str | None] = (False, WAITING, None)

    def time_is_up(self, now: float) -> bool:
        return now >= self._next

    def due(self, view: LiveView, now: float) -> bool:
        """Whether to print ``view`` now; if so, the next line is an interval away."""
        key = (view.median_step_ms is not None, view.state, view.verdict_kind)
        if key == self._shown and not self.time_is_up(now):
            return False
        self._shown = key
        self._next = now + self.interval_s
        return True


class TerminalPanel:
    """A few lines pinned to the bottom of a terminal, under a scroll region.

    Other processes writing to the same terminal (the training script) scroll inside the region
    above the panel, so neither garbles the other. Each draw is one ``write``: the tty layer
    does not interleave one write with another process's writes, and the cursor is saved and
    restored around it, so the script's output continues where it was.
    """

    def __init__(self, fd: int, height: int = PANEL_HEIGHT) -> None:
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

    def open(self) -> bool:
        """Pin the panel; False (nothing written) when the terminal is too small for it."""
        columns, rows = self._terminal_size()
        if rows <= self.height + 2 or columns < MIN_COLUMNS:
            return False
        self._size = (columns, rows)
        region = rows - self.height
        # Make room first (scroll the screen up by the panel's height), then confine scrolling
        # to the rows above the panel; setting a region homes the cursor, so save/restore it.
        self._write(
            "\n" * self.height + f"\x1b[{self.height}A" + "\x1b7" + f"\x1b[1;{region}r" + "\x1b8"
        )
        self._open = True
        return True

    def draw(self, lines: list[str]) -> None:
        if not self._open:
            return
        columns, rows = self._terminal_size()
        if (columns, rows) != self._size:  # resized: pin the panel to the new bottom
            self._size = (columns, rows)
            self._write(f"\x1b7\x1b[1;{rows - self.height}r\x1b8")
        out = ["\x1b7"]
        for index in range(self.height):
            text = fit(lines[index], columns - 1) if index < len(lines) else ""
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
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return "plain"
    # A pseudo-terminal nobody sized (`script` or `docker exec` started without a terminal, many
    # CI runners) reports 0x0: a panel there is never drawn, so plain lines instead.
    if size.columns < MIN_COLUMNS or size.lines <= PANEL_HEIGHT + 2:
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
        if self.panel is not None and not self.panel.open():
            self.panel, self.mode = None, "plain"  # too small after all: plain lines instead
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
        schedule = LineSchedule(self.interval_s, time.monotonic())
        dirty = True
        while not self._stop.wait(REDRAW_S):
            try:
                dirty = self.follower.poll() or dirty
                if self.panel is not None:
                    if dirty:
                        self.panel.draw(render_panel(self.view(), 10_000))
                        dirty = False
                elif dirty or schedule.time_is_up(time.monotonic()):
                    dirty = False
                    view = self.view()
                    if schedule.due(view, time.monotonic()):
                        self._print(render_line(view))
            except Exception as exc:  # the view must never take the launcher down
                self._print(f"traceml: live view stopped ({type(exc).__name__}: {exc})")
                return

    def _print(self, line: str) -> None:
        with contextlib.suppress(OSError):
            os.write(self.fd, (line + "\n").encode("utf-8", "replace"))
        self.lines_printed += 1
