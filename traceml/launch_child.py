"""``traceml run``'s child process: its process group, the terminal, signals, job control.

Started by an interactive shell (the launcher leads its own process group: the shell made it a
job), the script runs in a process group of its own, so that each signal reaches it exactly
once: the terminal's Ctrl-C and Ctrl-\\ reach its whole group directly (it has the terminal's
foreground, as a shell's job would), and every catchable signal sent to the launcher is passed
on to the script's process, as ``kill <pid>`` would reach it untraced (torchrun's agent passes
it on to its workers; DataLoader workers end with their parent).

Started by anything else (a shell script's loop, make, a Python sweep: the launcher is a member
of its caller's group), the script stays in the launcher's group, as ``python script.py`` would
be in its caller's: the terminal's Ctrl-C then reaches the script, the launcher and the caller
alike, and the caller stops its loop as it would untraced. The launcher does not pass on a
Ctrl-C or Ctrl-\\ that the terminal sent to the group it shares with the script (the script
had it already); every other signal it is sent, it passes on.

Either way the launcher then behaves, to whoever started it, as the script would have:

* the exit status is the script's: its exit code, or death by the signal that killed it (the
  launcher ends itself with that signal once the report is written, without a core dump of
  its own over the script's);
* when the script's group stops (Ctrl-Z, or reading the terminal from the background), the
  launcher stops too, so the shell sees its job stopped; continued (``fg``, ``bg``), it gives
  the terminal back to the script's group if the shell gave it the foreground, and continues
  the script (in a shared group the terminal stops and continues them all directly);
* a signal the caller ignores (``nohup``'s SIGHUP, SIGINT for a non-interactive shell's ``&``
  job) stays ignored: the launcher neither catches nor passes it on, and the script inherits
  it ignored;
* nothing is killed on the script's behalf: no timer escalates a forwarded signal, and what
  the script leaves running when it exits (an uploader it started on purpose) lives on. Only
  the launcher's own death while the script runs (SIGKILL leaves it no time to pass anything
  on) kills the script (Linux: ``PR_SET_PDEATHSIG``), as ``kill -9`` of the untraced script
  would.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
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
# What the terminal's keys send to its foreground group (Ctrl-C, Ctrl-\): in a group the
# launcher shares with the script, the script has it already.
KEYBOARD = (signal.SIGINT, signal.SIGQUIT)
# <linux/prctl.h>: the signal a process gets when the thread that created it dies.
PR_SET_PDEATHSIG = 1


def run_child(command: list[str], env: dict[str, str]) -> tuple[int, int | None]:
    """Run ``command`` until it ends, in a process group of its own when the launcher is a
    shell's job (else in the launcher's); returns its return code (``-N``: killed by signal N)
    and the first signal the launcher received (or None)."""
    received: list[int] = []
    own_group = os.getpgrp() == os.getpid()
    # A caught signal is reset to its default across exec, an ignored one stays ignored: the
    # launcher leaves the caller's ignored signals alone, for the script to inherit them.
    forwarded = [sig for sig in FORWARDED if signal.getsignal(sig) != signal.SIG_IGN]
    child = _start(command, env, own_group)
    tty = _terminal()
    job_tty = tty if own_group else None  # job control is the launcher's to do
    if job_tty is not None and _in_foreground(job_tty):
        _give_terminal(job_tty, child.pid)

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        if not own_group and signum in KEYBOARD and tty is not None and _in_foreground(tty):
            return  # the terminal sent it to the group the script shares: it has it already
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child.pid, signum)  # as `kill <pid>` would reach the script alone

    previous = {sig: signal.signal(sig, forward) for sig in forwarded}
    try:
        returncode = _wait(child, job_tty)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if job_tty is not None and _owned_by(job_tty, child.pid):
            _give_terminal(job_tty, os.getpgrp())
    return returncode, (received[0] if received else None)


def _start(command: list[str], env: dict[str, str], own_group: bool) -> subprocess.Popen:
    """Start ``command``, in a new process group when ``own_group``, set to die with the
    launcher where the system allows it."""
    before_exec: list[Callable[[], None]] = []
    options: dict[str, Any] = {}
    if own_group and sys.version_info >= (3, 11):
        options["process_group"] = 0
    elif own_group:  # pragma: no cover - Python 3.10
        before_exec.append(os.setpgrp)
    dies_with_launcher = _death_signal_setter()
    if dies_with_launcher is not None:
        before_exec.append(dies_with_launcher)
    if before_exec:

        def in_the_child() -> None:
            for step in before_exec:
                step()

        options["preexec_fn"] = in_the_child
    return subprocess.Popen(command, env=env, **options)


def _death_signal_setter() -> Callable[[], None] | None:
    """On Linux, a function for the child to run between fork and exec so that the launcher's
    death by SIGKILL (it can pass nothing on then) kills the script too, where it would
    otherwise train on, orphaned; None elsewhere or where libc's ``prctl`` is not found.

    A ``preexec_fn`` may deadlock in a process with threads (the live view's runs already)
    when it needs a lock another thread held at the fork. This one needs none: ``prctl`` is
    looked up here, before the fork (``dlsym`` takes the loader's lock); in the child it makes
    system calls only (prctl, getppid, at most a kill), and CPython re-creates its own locks
    (GIL, imports) in the child before it runs a ``preexec_fn``. Starting the child before
    the live view would need launch.py's order changed, for no lock fewer."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    launcher = os.getpid()
    kill = int(signal.SIGKILL)

    def set_death_signal() -> None:
        try:
            if prctl(PR_SET_PDEATHSIG, kill, 0, 0, 0) == 0 and os.getppid() != launcher:
                os.kill(os.getpid(), kill)  # the launcher died before prctl: too late to wait
        except Exception:  # the script starts regardless, as it did without this
            pass

    return set_death_signal


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
        # A core-dumping signal (SIGSEGV, SIGABRT, SIGQUIT) would dump the launcher's core,
        # over the script's where both write ./core: the script's is the one to keep.
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
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
