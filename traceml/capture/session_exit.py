"""A traced training's rank file, finished at interpreter exit when training never closed it.

The exit handler (``at_exit``) calls this for a session whose footer was not written: the
script exited (or raised) before the framework's teardown, or the loop has no end event of its
own (any-loop capture, where the process's exit ends the training). Kept out of ``session``:
it runs once per process, never on the step's path.
"""

from __future__ import annotations

import os
import sys
from contextlib import suppress
from typing import Any

from traceml import schema

EXITED_EARLY = "the process exited before training finished"


def finish_at_exit(session: Any) -> None:
    """Write what is pending and the footer, with the status the exit implies."""
    recorder = session.recorder
    if recorder is None or recorder.footer_written or os.getpid() != session.pid:
        return
    session.remove_instruments()
    if session.clock is not None:
        session.clock.abandon()
    with suppress(Exception):
        session._drain()
    exception = getattr(sys, "last_value", None)  # the script's uncaught exception, if any
    if recorder.status is None and session.ends_at_exit:
        if exception is not None:
            recorder.ended_by(exception)
    elif recorder.status is None:
        recorder.status = schema.STATUS_INTERRUPTED
        recorder.error = recorder.error or EXITED_EARLY
    session.finish()
