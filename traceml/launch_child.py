"""``traceml run``'s child process: its own process group, the terminal, signals, job control.

The script runs in a process group of its own, so that each signal reaches it exactly once:
the terminal's Ctrl-C and Ctrl-\\ reach its whole group directly (it has the terminal's
foreground, as a shell's job would), and every catchable signal sent to the launcher is passed
on to the script's process, as ``kill <pid>`` would reach it untraced (torchrun's agent passes
it on to its workers; DataLoader workers end with their parent). The launcher then behaves,
to whoever started it, as the script would have:

* the exit status is the script's: its exit code, or death by the signal that killed it (the
  launcher ends itself with that signal once the report is written);
* when the script's group stops (Ctrl-Z, or reading the terminal from the background), the
  launcher stops too, so the shell sees its job stopped; continued (``fg``, ``bg``), it gives
  the terminal back to the script's group if the shell gave it the foreground, and continues
  the script;
* nothing is killed on the script's behalf: no timer escalates a forwarded signal, and what
  the script leaves running when it exits (an uploader it started on purpose) lives on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Any

# Passed on to the script's group when the launcher receives them (a scheduler's SIGTERM or
# SIGUSR1, a closed terminal's SIGHUP). SIGTSTP, SIGCONT and SIGWINCH come from the terminal
# to the foreground group, which is the script's.
FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def run_child(command: list[str], env: dict[str, str]) -> tuple[int, int | None]:
    """Run ``command`` in its own process group until it ends; returns its return code
    (``-N``: killed by signal N) and the first signal the launcher passed on (or None)."""
    received: list[int] = []
    if sys.version_info >= (3, 11):
        child = subprocess.Popen(command, env=env, process_group=0)
    else:  # pragma: no cover - Python 3.10
        child = subprocess.Popen(command, env=env, preexec_fn=os.setpgrp)
    tty = _terminal()
    if tty is not None and _in_foreground(tty):
        _give_terminal(tty, child.pid)

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child.pid, signum)  # as `kill <pid>` would reach the script alone

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        returncode = _wait(child, tty)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if tty is not None and _owned_by(tty, child.pid):
            _give_terminal(tty, os.getpgrp())
    return returncode, (received[0] if received else None)


def _wait(child: subprocess.Popen, tty: int | None) -> int:
    """The child's return code; each time its group stops, :func:`_follow_stop`."""
    while True:
        _pid, status = os.waitpid(child.pid, os.WUNTRACED)  # a handled signal retries it
        if os.WIFSTOPPED(status):
            if tty is not None:  # job control: a terminal's stop, not a debugger's
                _follow_stop(child.pid, tty, os.WSTOPSIG(status))
            continue
        child.returncode = os.waitstatus_to_exitcode(status)
        return child.returncode


def _follow_stop(pgid: int, tty: int, stopped_by: int) -> None:
    """The script's group stopped. If the launcher has the terminal (the script read it from
    the background, and the shell has since brought the launcher's job to the foreground),
    the script gets it and goes on; otherwise the launcher stops as the script's job would,
    and once continued does the same check again."""
    while not _in_foreground(tty):
        if _owned_by(tty, pgid):
            _give_terminal(tty, os.getpgrp())  # the shell takes it from the stopped job
        if stopped_by == signal.SIGTSTP:  # Ctrl-Z: what the terminal would have stopped
            os.killpg(os.getpgrp(), signal.SIGTSTP)  # untraced (the caller's group too)
        else:
            os.kill(os.getpid(), signal.SIGSTOP)
        # Here once a SIGCONT (fg, bg) continued the launcher.
        if not _in_foreground(tty):  # bg: the script goes on in the background
            break
    if _in_foreground(tty):
        _give_terminal(tty, pgid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGCONT)


def die_like(returncode: int) -> None:
    """End this process by the signal that killed the script (``returncode`` ``-N``), so that
    a shell, ``subprocess`` or a scheduler sees what it would have seen untraced; returns
    only when the signal cannot end it (the caller then exits with 128 + N)."""
    if returncode >= 0:
        return
    signum = -returncode
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    with contextlib.suppress(OSError, ValueError):
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _terminal() -> int | None:
    """stdin's file descriptor when it is a terminal (job control applies), else None."""
    try:
        fd = sys.stdin.fileno()
        return fd if os.isatty(fd) else None
    except (OSError, ValueError, AttributeError):
        return None


def _in_foreground(tty: int) -> bool:
    return _owned_by(tty, os.getpgrp())


def _owned_by(tty: int, pgid: int) -> bool:
    try:
        return os.tcgetpgrp(tty) == pgid
    except OSError:
        return False


def _give_terminal(tty: int, pgid: int) -> None:
    """The terminal's foreground to ``pgid``, as a shell does for a job (SIGTTOU ignored
    meanwhile: a process outside the foreground may hand it over)."""
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(tty, pgid)
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, previous)
