"""End of process: footers for runs that never reached their teardown; the direct-launch report.

Every opened :class:`~traceml.capture.session.Session` registers here; one ``atexit`` handler
closes the files still open (status ``interrupted``) and, on global rank 0 of a direct launch,
runs the report in a child process (``run_end.report_in_child``).
"""

from __future__ import annotations

import atexit
import os
from typing import Any

from traceml import console, schema
from traceml.capture.guard import entry_point

_sessions: list[Any] = []
_registered = False


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

    __slots__ = ("pid", "rank_info", "settings")

    def __init__(self, session: Any) -> None:
        self.pid, self.settings, self.rank_info = session.pid, session.settings, session.rank_info

    def finish_at_exit(self) -> None:
        pass


def finished(session: Any) -> None:
    """``session``'s footer is written: keep only what the exit handler reads of it."""
    for index, registered in enumerate(_sessions):
        if registered is session:
            _sessions[index] = _Finished(session)


@entry_point("exit handler", "interpreter exit: footers and the direct-launch report", owner_arg=-1)
def at_exit() -> None:
    for session in list(_sessions):
        try:
            session.finish_at_exit()
        except Exception:
            pass
    for session in list(_sessions):
        if session.pid != os.getpid():
            continue
        settings = session.settings
        is_rank_zero = session.rank_info.get(schema.RANK, 0) == 0
        node = session.rank_info.get(schema.NODE_RANK) or 0
        node_leader = node > 0 and session.rank_info.get(schema.LOCAL_RANK, 0) == 0
        if (is_rank_zero or node_leader) and settings.report and not settings.launcher_managed:
            try:
                from traceml.capture import run_end

                if is_rank_zero:
                    run_end.report_in_child(settings)
                else:  # this node's share of the report, in a child (issue 24)
                    run_end.node_partial_in_child(settings, node)
            except Exception as exc:
                console.warn(f"could not write the final report ({type(exc).__name__}: {exc})")
        break
