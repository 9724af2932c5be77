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
    with suppress(Exception):
        session.settle()  # the door events logged before the exit: their steps are written
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


def drain_device(session: Any) -> None:
    """Write the steps still waiting for their CUDA events (end of training only). After a
    sticky CUDA error the events cannot be read: those steps keep their host times."""
    gpu = session.gpu
    if gpu is None:
        return
    session.gpu = None
    if session.comm is not None:
        session.comm.gpu = None
    for record in gpu.drain():
        session._write_step(record)
    if gpu.unreadable and session.recorder is not None:
        note = f"the device could not report its timings for the last {gpu.unreadable} steps"
        note += f" ({gpu.unreadable_reason}); their host times are kept"
        session.recorder.event("warning", schema.EVENT_NOTE, note)
