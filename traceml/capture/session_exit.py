"""A traced training's rank file finished: its footer, at the end of training or at exit.

The exit handler (``at_exit``) calls :func:`finish_at_exit` for a session whose footer was not
written: the script exited (or raised) before the framework's teardown, or the loop has no end
event of its own (any-loop capture, where the process's exit ends the training). Kept out of
``session``: it runs once per process, never on the step's path.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from traceml import schema
from traceml.capture import at_exit
from traceml.capture.lifecycle import DONE, TRACING

EXITED_EARLY = "the process exited before training finished"


def finish_file(session: Any) -> None:
    """Write the footer and close the rank file (once): the adapters' last words, the queued
    steps, the clock's overlap note, the telemetry sampler's last samples."""
    recorder = session.recorder
    if recorder is None or recorder.footer_written:
        return
    if not recorder.header_written:
        session.write_header(timing="host")
    for last_words in session.before_finish:
        with suppress(Exception):
            last_words()
    # Flushed first: the queued steps' records made, their overlaps counted, a bad one known.
    if recorder.flush() and recorder.bad_record is not None:
        session.disable(f"a step record could not be made ({recorder.bad_record})")
    if session.clock is not None and session.clock.overlaps:
        note = f"{session.clock.overlaps} steps had overlapping phase hooks; residual set to 0"
        recorder.event("warning", schema.EVENT_NOTE, note)
    sampler, session.telemetry = session.telemetry, None
    if sampler is not None:
        recorder.samples(list(sampler.stop()))
    try:
        recorder.finish()
    finally:
        reader, session._rss = session._rss, None  # no step reads RSS after the footer
        with suppress(Exception):
            reader.close()  # the procfs descriptor (rss_reader): nothing left open
    if session.life.state is TRACING:
        session.life.move(DONE)
    at_exit.finished(session)  # the exit handler lets go of the session (and the training)


def keep_stepped_step(session: Any, end: Callable[[], object]) -> None:
    """Training raised, before the framework's step end: ``end()`` (that step end) where the
    open microbatch's optimizer step returned, so its done update is a step (Lightning and
    the HF Trainer end a step only after every callback's batch-end hook, one of which may
    have raised); :meth:`Session.failed` then drops any other open step. Never raises."""
    with suppress(Exception):
        session.settle()  # the door events logged so far: the clock knows the open microbatch
        micro = getattr(session.clock, "_micro", None)
        stepped = micro is not None and micro.optimizer_end_ns is not None
        if stepped and session.life.state is TRACING:
            end()


def finish_at_exit(session: Any) -> None:
    """Write what is pending and the footer, with the status the exit implies."""
    recorder = session.recorder
    if recorder is None or recorder.footer_written or os.getpid() != session.pid:
        return
    # A Ctrl-C at exit (pressed as the script ends) may land in any of these: it skips that
    # one part, never the steps and the footer after it.
    _through(session.remove_instruments)
    _through(session.settle)  # the door events logged before the exit: their steps are written
    if session.clock is not None:
        _through(session.clock.abandon)
    _through(session._drain)
    exception = getattr(sys, "last_value", None)  # the script's uncaught exception, if any
    if recorder.status is None and session.ends_at_exit:
        if exception is not None:
            recorder.ended_by(exception)
    elif recorder.status is None:
        recorder.status = schema.STATUS_INTERRUPTED
        recorder.error = recorder.error or EXITED_EARLY
    session.finish()


def _through(part: Callable[[], object]) -> None:
    try:
        part()
    except BaseException:  # KeyboardInterrupt included: the exit goes on
        pass


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
