"""A hand-written loop's microbatch's Input Wait, once its training forward took (or did not
take) the DataLoader fetches held for it (``torch_loop_fetches``)."""

from __future__ import annotations

from typing import Any

from traceml.capture.clock import clock_ns

from .torch_loop_notes import NOTE_FETCH_STOPPED, NOTE_FETCH_THREAD


def microbatch_fed(capture: Any, session: Any, pending: Any) -> None:
    """The fetches ``pending`` took; 0 for a later microbatch of a step whose first one took
    a DataLoader fetch (the HF Trainer fetches a window's batches before its first forward),
    or while the training iterator may still feed training (a batch trained on twice); else
    unmeasured (null, never 0): no DataLoader fed training yet, one read by another thread,
    or batches that no longer come from one (a generator after the first epoch,
    ``itertools.cycle`` replaying the batches it saved)."""
    if pending is not None:
        capture.window_fed = True
        session.fetched(pending[1], pending[1] + pending[2])
        return
    here = capture.thread
    fed = capture.window_fed or capture.fetches.training_alive()
    if fed and capture._fetch_thread == here:
        now = clock_ns()
        session.fetched(now, now)
        return
    if capture._fetch_thread not in (None, here):
        capture.note_once("fetch-thread", NOTE_FETCH_THREAD)
    elif capture.fetches.train_iterators:
        capture.note_once("fetch-stopped", NOTE_FETCH_STOPPED, level="info")
    session.fetched(None, clock_ns())
