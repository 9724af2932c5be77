"""The timed batch fetch: torch's map-style dataset fetcher, timed on its class.

torch's ``_MapDatasetFetcher.fetch`` (``_utils/fetch.py``) runs the dataset's item calls, then
``collate_fn``. The traced loader's fetchers (one per iterator in the main process, one per
worker and epoch in a worker) get a :class:`TimedCollate` as their ``collate_fn``, an attribute
they already have; the class's ``fetch`` is a door that times exactly those fetchers. The
fetch's start, the collate's start and its end split a batch into item and collate time.

On the class, not the fetcher: a ``__class__`` swap or a new instance attribute would make the
fetcher's ``__dict__``, and every later attribute load on it the slow kind
(:mod:`traceml.capture.class_doors`). Every other fetcher (a validation loader's, another
loader's) goes straight through the door after one type check.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import FunctionType
from typing import Any

from traceml.capture.class_doors import look_like
from traceml.capture.clock import clock_ns

BATCH_DOOR = "dataloader.batch"


class TimedCollate:
    """A timed fetcher's ``collate_fn``: calls the user's exactly once and notes when it
    started (the dataset's item calls ended there)."""

    __slots__ = ("started", "user_collate")

    def __init__(self, user_collate: Any) -> None:
        self.user_collate = user_collate
        self.started = 0

    def __call__(self, batch: Any) -> Any:
        self.started = clock_ns()
        return self.user_collate(batch)  # user errors pass through untouched


def time_fetcher(fetcher: Any) -> Callable[[], None]:
    """Have ``fetcher`` (torch-internal, one per iterator or worker) timed by the door;
    returns the undo, which gives the fetcher its ``collate_fn`` back (if it is still ours):
    once tracing stops mid-epoch, the epoch's remaining batches skip TimedCollate's frame."""
    collate = fetcher.collate_fn
    if isinstance(collate, TimedCollate):
        return lambda: None
    timed = fetcher.collate_fn = TimedCollate(collate)
    held = weakref.ref(fetcher)  # the undo keeps no finished epoch's fetcher alive

    def untime() -> None:
        timed_fetcher = held()
        if timed_fetcher is not None and getattr(timed_fetcher, "collate_fn", None) is timed:
            timed_fetcher.collate_fn = collate

    return untime


class _Disarmed:
    on = False  # what a door left on the class after its undo reads as its timing


def _timed_fetch(untimed: Any, timing: Any) -> tuple[Any, Any]:
    """``untimed`` (the class's ``fetch``), timed for ``timing`` (an ``InputTiming``) on the
    fetchers whose ``collate_fn`` is a :class:`TimedCollate`; and its disarm, which lets go of
    ``timing`` (as ``class_doors``' undo does: a patch stacked on the door since keeps it on
    the class, timing nothing and keeping nothing alive)."""

    def fetch(self, possibly_batched_index):
        collate = self.collate_fn
        if type(collate) is not TimedCollate:  # another loader's fetcher
            return untimed(self, possibly_batched_index)
        start = collate.started = clock_ns()
        batch = untimed(self, possibly_batched_index)  # errors pass through
        if timing.on:
            if not self.auto_collation:
                samples = 1
            elif hasattr(possibly_batched_index, "__len__"):
                samples = len(possibly_batched_index)
            else:  # a batch sampler that yields iterators: no count, so no breakdown of it
                return batch
            log = timing.log
            if log is not None:  # the session's event log (InputTiming.log_events)
                log((BATCH_DOOR, start, collate.started, clock_ns(), samples))
            else:
                timing.batch_made(start, collate.started, samples)
        return batch

    def disarm() -> None:
        nonlocal timing
        timing = _Disarmed

    look_like(fetch, untimed)
    return fetch, disarm


_door: Any = None  # the door on torch's fetcher class, while it is there


def door_on_fetch(timing: Any) -> Any:
    """Set the timed ``fetch`` on torch's map-style fetcher class for ``timing`` (once);
    returns the undo."""
    global _door
    from torch.utils.data._utils.fetch import _MapDatasetFetcher as fetcher_class

    current = fetcher_class.__dict__.get("fetch")
    if current is not None and current is _door:
        return lambda: None  # already there: one door a process, never a door on a door
    if not isinstance(current, FunctionType):
        raise TypeError("torch's _MapDatasetFetcher.fetch is not a plain function")
    door, disarm = _timed_fetch(current, timing)
    fetcher_class.fetch = _door = door

    def restore() -> None:
        global _door
        disarm()
        if fetcher_class.__dict__.get("fetch") is door:  # else someone replaced it since
            fetcher_class.fetch = current
        if _door is door:
            _door = None

    return restore
