"""End of process: footers for runs that never reached their teardown; the direct-launch report.

Every opened :class:`~traceml.capture.session.Session` registers here; one ``atexit`` handler
closes the files still open (status ``interrupted``) and, on global rank 0 of a direct launch,
runs the report in a child process (``run_end.report_in_child``). In an interactive session (a
notebook, ``python -i``) the interpreter may not exit for hours: a single-process training's
report comes as soon as its rank file is finished instead, and not again at exit.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any

from traceml import console, schema
from traceml.capture.guard import entry_point

_sessions: list[Any] = []
_registered = False
_exiting = False  # set by the exit handler: the reports are its own from then on


def register(session: Any) -> None:
    """``session``: anything with ``finish_at_exit()``, ``pid``, ``settings``, ``rank_info``."""
    global _registered
    _sessions.append(session)
    if not _registered:
        _registered = True
        atexit.register(at_exit)


class _Finished:
    """What the exit handler still needs of a session whose rank file is finished: its
    process, settings and place in the job (the direct-launch report), and nothing of the
    training. The session itself, and through it the user's trainer, model and data, can go."""

    __slots__ = ("pid", "rank_info", "reported", "settings")

    def __init__(self, session: Any) -> None:
        self.pid, self.settings, self.rank_info = session.pid, session.settings, session.rank_info
        self.reported = False

    def finish_at_exit(self) -> None:
        pass


def finished(session: Any) -> None:
    """``session``'s footer is written: keep only what the exit handler reads of it."""
    for index, registered in enumerate(_sessions):
        if registered is session:
            _sessions[index] = kept = _Finished(session)
            if not _exiting and interactive() and _reports_now(kept):
                kept.reported = True
                _report(kept, through_sys_stderr=True)


def interactive() -> bool:
    """Is a person at a prompt in this process: ``python -i``, the REPL, an IPython shell or a
    Jupyter kernel (neither of which sets ``sys.ps1`` or the interactive flag)."""
    if sys.flags.interactive or hasattr(sys, "ps1"):
        return True
    ipython = sys.modules.get("IPython")
    try:
        return getattr(ipython, "get_ipython", lambda: None)() is not None
    except Exception:
        return False


def _reports_now(session: Any) -> bool:
    # One process is the whole job: other ranks' files may still be written (rank 0 waits for
    # them at exit), and a launcher-managed run is reported by its launcher.
    single = (session.rank_info.get(schema.WORLD_SIZE) or 1) == 1
    return single and session.pid == os.getpid() and _reports(session)


def _reports(session: Any) -> bool:
    settings = session.settings
    return bool(settings.report) and not settings.launcher_managed


def _report(session: Any, *, through_sys_stderr: bool = False) -> None:
    """The report (global rank 0) or this node's partial (a node leader), in a child; a
    failure is one warning line."""
    node = session.rank_info.get(schema.NODE_RANK) or 0
    try:
        from traceml.capture import run_end

        if session.rank_info.get(schema.RANK, 0) == 0:
            run_end.report_in_child(session.settings, through_sys_stderr=through_sys_stderr)
        else:  # this node's share of the report, in a child (issue 24)
            run_end.node_partial_in_child(session.settings, node)
    except Exception as exc:
        console.warn(f"could not write the final report ({type(exc).__name__}: {exc})")


@entry_point("exit handler", "interpreter exit: footers and the direct-launch report", owner_arg=-1)
def at_exit() -> None:
    global _exiting
    _exiting = True
    for session in list(_sessions):
        try:
            session.finish_at_exit()
        except BaseException:  # a Ctrl-C here: the other sessions' files and the report
            pass
    for session in list(_sessions):
        if session.pid != os.getpid():
            continue
        is_rank_zero = session.rank_info.get(schema.RANK, 0) == 0
        node = session.rank_info.get(schema.NODE_RANK) or 0
        node_leader = node > 0 and session.rank_info.get(schema.LOCAL_RANK, 0) == 0
        reported = getattr(session, "reported", False)  # at its end, in an interactive session
        if (is_rank_zero or node_leader) and _reports(session) and not reported:
            _report(session)
        break
