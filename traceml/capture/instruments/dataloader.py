"""Worker-side timing of the traced training DataLoader: ``__getitem__``, ``collate_fn``, idle.

What is timed, per batch, where the batch is made (each DataLoader worker, or the main process
when ``num_workers=0``): the dataset's items (``__getitem__`` per sample or ``__getitems__``),
the ``collate_fn`` call, and the batch's busy span (fetch started to collate ended). A worker's
idle time is the rest of its life after its first batch started: waiting for an index, and
handing the batch to the main process (pickling into shared memory).

Transparency first: the dataset, the DataLoader and its ``collate_fn`` keep their class and
attributes, so pickling, ``copy.deepcopy``, ``torch.save``, validation loaders over the same
dataset and the user's worker code see what they would untraced. Timing lives beside them, in
torch's own per-iterator machinery:

* ``DataLoader._get_iterator`` is wrapped (class attribute, for the traced fit only) and acts on
  the one traced loader, found by identity. With ``num_workers=0`` the new iterator's dataset
  fetcher (torch-internal, never pickled) gets a timing ``collate_fn`` and is timed by a door
  on its class (:mod:`input_fetch`).
* With workers, the loader's ``worker_init_fn`` is a picklable wrapper only while the iterator
  starts its workers. In each worker it sets that door and has torch's
  ``_DatasetKind.create_fetcher`` time the fetchers it makes, then runs the user's
  ``worker_init_fn``.

Counters travel through a shared map (:mod:`input_counters`). Supported: map-style datasets,
``num_workers`` 0 or more, persistent workers, ``fork``, ``spawn`` and ``forkserver``. Not
supported (untimed, noted in the rank file): iterable datasets, more than MAX_WORKERS workers.
A validation loader sharing the dataset is not counted (its fetchers are not the traced one's).

Inside a worker a failure turns that worker's timing off and never reaches the batch; in the
main process, a door's (``dataloader.iterator``, ``dataloader.batch``) turns tracing off.
"""

from __future__ import annotations

import os
import weakref
from types import SimpleNamespace
from typing import Any

from traceml.capture.clock import clock_ns
from traceml.capture.guard import entry_point
from traceml.capture.instruments import input_counters
from traceml.capture.instruments.input_counters import MAX_WORKERS, ProcessCounters
from traceml.capture.instruments.input_fetch import BATCH_DOOR, door_on_fetch, time_fetcher
from traceml.capture.instruments.input_record import (
    input_record,
    producers_since,
    start_method,
    unsupported_reason,
)
from traceml.capture.undo import undo_all

# The timing of the traced DataLoader (one per process); forked workers inherit it.
_active: InputTiming | None = None


def _forget_parent_counters() -> None:
    """In a forked child (a DataLoader worker): the parent's counters are not the child's."""
    if _active is not None:
        _active.counters = None


os.register_at_fork(after_in_child=_forget_parent_counters)


def _worker_slot() -> int | None:
    """This process's slot: worker id + 1 in a DataLoader worker, 0 in the main process."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None:
        return 0
    return info.id + 1 if info.id < MAX_WORKERS else None


_NONE = object()


def _instance_attribute(obj: Any, name: str) -> Any:
    """``obj``'s own attribute ``name``, or ``_NONE`` when its class (or a base) defines the
    name, or the object lacks it. Read through ``object`` so that neither the object's
    ``__dict__`` is made (its attributes stay inline, as untraced) nor a subclass's
    ``__getattr__`` / ``__setattr__`` runs."""
    if any(name in vars(klass) for klass in type(obj).__mro__):
        return _NONE
    try:
        return object.__getattribute__(obj, name)
    except AttributeError:
        return _NONE


class WorkerStart:
    """``worker_init_fn`` of the traced DataLoader while it starts its workers: the worker
    times the fetchers it makes, then runs the user's ``worker_init_fn``. Picklable (spawned
    workers unpickle it); the loader itself keeps the user's ``worker_init_fn``."""

    def __init__(self, user_init: Any, map_path: str | None, main_pid: int) -> None:
        self.user_init = user_init
        self.map_path = map_path
        self.main_pid = main_pid

    def __call__(self, worker_id: int) -> None:
        try:
            _time_this_worker(self.map_path, self.main_pid)
        except Exception:
            pass  # this worker stays untimed; nothing reaches its batches
        if self.user_init is not None:
            self.user_init(worker_id)


def _time_this_worker(map_path: str | None, main_pid: int) -> None:
    """In a worker, before torch makes its fetcher: time every fetcher this worker makes."""
    global _active
    from torch.utils.data import _DatasetKind

    if map_path is not None:  # spawned: nothing inherited; open the training process's map
        shared = input_counters.open_map_file(map_path)
        # The main process's pid, not this one's: a failure here stays in this worker.
        _active = InputTiming(None, None, shared=shared, main_pid=main_pid)
    elif _active is None:
        return
    door_on_fetch(_active)  # this worker's own torch, for its life
    make_fetcher = _DatasetKind.create_fetcher

    def create_timed_fetcher(*args: Any, **kwargs: Any) -> Any:
        fetcher = make_fetcher(*args, **kwargs)
        try:
            if type(fetcher).__name__ == "_MapDatasetFetcher":
                time_fetcher(fetcher)
        except Exception:
            pass
        return fetcher

    # This worker's own torch (a DataLoader worker runs only the loader's code); persistent
    # workers make a new fetcher every epoch.
    _DatasetKind.create_fetcher = staticmethod(create_timed_fetcher)


_original_get_iterator: Any = None


def _timed_get_iterator(self: Any) -> Any:
    """``DataLoader._get_iterator`` while a fit is traced: the traced loader's iterators are
    timed, every other loader's pass straight through."""
    timing = _active
    if timing is None or timing.loader is not self or not timing.on:
        return _original_get_iterator(self)
    token = timing.iterator_starting()
    iterator = None
    try:
        iterator = _original_get_iterator(self)  # the user's errors pass through unchanged
    finally:
        if token is not None:
            timing.iterator_made(token, iterator)
    return iterator


def _wrap_get_iterator(loader_class: type) -> Any:
    """Wrap ``DataLoader._get_iterator`` (once); returns the undo."""
    global _original_get_iterator
    if loader_class.__dict__.get("_get_iterator") is _timed_get_iterator:
        return lambda: None
    _original_get_iterator = loader_class.__dict__["_get_iterator"]
    original = _original_get_iterator
    loader_class._get_iterator = _timed_get_iterator

    def restore() -> None:
        if loader_class.__dict__.get("_get_iterator") is _timed_get_iterator:
            loader_class._get_iterator = original

    return restore


def _no_loader() -> None:
    return None  # a spawned worker's timing: the loader stayed in the training process


class InputTiming:
    """The timing installed on one training DataLoader, and how to take it away again."""

    # num_workers=0 under one-door timing: the session's event log (log_events).
    log: Any = None

    def __init__(
        self,
        loader: Any,
        observer: Any,
        *,
        shared: Any = None,
        main_pid: int | None = None,
    ) -> None:
        """``shared`` and ``main_pid`` are given inside a spawned worker (the map it opened,
        the training process's pid); the main process makes its own map."""
        # Weakly: the session outlives the fit's loaders (a loader Lightning reloads each epoch,
        # its persistent workers with it, must go when Lightning lets go of it).
        self._loader = weakref.ref(loader) if loader is not None else _no_loader
        # What the epoch's record says about the loader, read once: it may be gone by then.
        self._facts = SimpleNamespace(
            num_workers=getattr(loader, "num_workers", 0),
            persistent_workers=getattr(loader, "persistent_workers", False),
            pin_memory=getattr(loader, "pin_memory", False),
            multiprocessing_context=getattr(loader, "multiprocessing_context", None),
        )
        self.observer = observer  # the callback: failures in the main process go to it
        self.main_pid = os.getpid() if main_pid is None else main_pid
        self.on = True
        self.own_cost_ns = 0
        self.num_workers = int(getattr(loader, "num_workers", 0) or 0)
        self.map_path: str | None = None
        self.shared = shared
        self.counters: ProcessCounters | None = None
        # Main-process bookkeeping: last reading per worker pid, epoch start.
        self._seen: dict[int, tuple[int, ...]] = {}
        self._iterator_ms: float | None = None
        self._iterator_start_ns: int | None = None
        self._undo: list[Any] = []
        # The current epoch's fetcher's undo (num_workers=0): one, not one per epoch kept.
        self._untime_fetcher: Any = lambda: None

    @property
    def loader(self) -> Any:
        """The traced DataLoader (None once the user's code and Lightning let go of it)."""
        return self._loader()

    # -- installing ------------------------------------------------------------------------

    def install(self) -> None:
        """Make the counters map and wrap the iterator factory; undone by :meth:`uninstall`
        (also after a failure half-way: the caller uninstalls)."""
        from torch.utils.data import DataLoader

        if self.num_workers and start_method(self.loader) != "fork":
            # Spawned workers open the map by name (its path travels in their worker_init_fn).
            self.shared, self.map_path = input_counters.file_backed_map()
            map_path = self.map_path
            self._undo.append(lambda: input_counters.remove_map_file(map_path))
        else:
            self.shared = input_counters.anonymous_map()
        if not self.num_workers:  # batches are fetched in this process
            self._undo.append(door_on_fetch(self))
        self._undo.append(_wrap_get_iterator(DataLoader))

    def uninstall(self) -> None:
        """Undo every change (idempotent); the map stays readable for a last collect."""
        global _active
        self.on = False
        untime, self._untime_fetcher = self._untime_fetcher, lambda: None
        self._undo.append(untime)
        undo_all(self._undo)
        if _active is self:
            _active = None

    # -- the main process: the traced loader's iterators -----------------------------------

    @entry_point("dataloader.iterator", "the traced DataLoader making an epoch iterator")
    def iterator_starting(self) -> tuple[int, Any] | None:
        """Before the iterator exists: workers about to start get the timing worker_init_fn
        (in the loader only until :meth:`iterator_made`)."""
        loader = self.loader
        restore = None
        user_init = _instance_attribute(loader, "worker_init_fn") if self.num_workers else _NONE
        if user_init is not _NONE:
            wrapper = WorkerStart(user_init, self.map_path, self.main_pid)
            object.__setattr__(loader, "worker_init_fn", wrapper)

            def restore() -> None:
                object.__setattr__(loader, "worker_init_fn", user_init)

        return clock_ns(), restore

    def iterator_made(self, token: tuple[int, Any], iterator: Any) -> None:
        start, restore = token
        if restore is not None:
            restore()  # not guarded: the user's worker_init_fn must come back whatever happens
        self._iterator_made(start, iterator)

    @entry_point("dataloader.iterator_made", "the traced DataLoader, its epoch iterator made")
    def _iterator_made(self, start: int, iterator: Any) -> None:
        end = clock_ns()
        if iterator is None:
            return
        fetcher = getattr(iterator, "_dataset_fetcher", None)  # num_workers=0
        if fetcher is not None and type(fetcher).__name__ == "_MapDatasetFetcher":
            self._untime_fetcher = time_fetcher(fetcher)  # the previous epoch's is done
        self._iterator_start_ns = start
        self._iterator_ms = (self._iterator_ms or 0.0) + (end - start) / 1e6

    # -- the door (workers, or the main process when num_workers=0) ------------------------

    def _entry_failed(self, name: str, exc: BaseException) -> None:
        self.on = False
        if os.getpid() == self.main_pid:
            self.observer._entry_failed(name, exc)
        # In a worker: that worker's timing is off; nothing may reach the user's batch, and
        # the worker must not write to the rank file (its descriptor is the parent's).

    def _here(self) -> ProcessCounters | None:
        # A forked worker starts with no counters (_forget_parent_counters): no getpid()
        # system call per batch to find out which process this is.
        counters = self.counters
        if counters is None:
            slot = _worker_slot()
            if slot is None:
                self.on = False
                return None
            counters = self.counters = ProcessCounters(os.getpid(), slot)
        return counters

    def log_events(self, session: Any) -> bool:
        """``num_workers=0`` under one-door timing: the batch door logs an event that the
        session's replay counts (:meth:`count`, ``step_events``); False with workers."""
        if self.num_workers or session.event_log is None:
            return False
        session.replay.add_side_door(BATCH_DOOR, self.count, self.count_many)
        self.log = session.event_log
        return True

    @entry_point(BATCH_DOOR, "after the traced DataLoader's fetch (items, collate)", per_step=True)
    def batch_made(self, start: int, collate_start: int, samples: int) -> None:
        self.count(start, collate_start, clock_ns(), samples)

    def count(self, start: int, collate_start: int, end: int, samples: int) -> None:
        """One batch made in this process: its items, its collate, its busy span."""
        counters = self.counters
        if counters is None:
            counters = self._here()
            if counters is None:
                return
        counters.samples += samples
        counters.getitem_ns += collate_start - start
        counters.collate_ns += end - collate_start
        counters.batches += 1
        if not counters.first_start_ns:
            counters.first_start_ns = start
            counters.first_end_ns = end
        counters.last_end_ns = end
        if counters.slot:  # a worker; the training process publishes its own slot when read
            counters.publish(self.shared)

    def count_many(self, events: list[tuple[Any, ...]]) -> None:
        """:meth:`count` of several batches' events (the main process's, read not published)."""
        if (counters := self.counters or self._here()) is not None:
            counters.add_batches(events)

    # -- the main process ------------------------------------------------------------------

    def read_slots(self) -> dict[int, tuple[int, ...]]:
        """slot -> the SLOT_FIELDS of the process writing it (consistent reads only)."""
        counters = self.counters
        if counters is not None and counters.slot == 0:
            # num_workers=0: this process's own loading, published now rather than per batch
            # (three struct writes on a cold cache, every batch, for a once-an-epoch read).
            counters.publish(self.shared)
        return input_counters.read_slots(self.shared)

    def epoch_record(self, epoch: Any) -> dict[str, Any] | None:
        """What each producer made since the previous call, as an ``input`` record."""
        workers, started = producers_since(self.read_slots(), self._seen)
        iterator_ms, self._iterator_ms = self._iterator_ms, None
        origin, self._iterator_start_ns = self._iterator_start_ns, None
        if not workers and iterator_ms is None:
            return None
        record = input_record(self._facts, epoch, workers, iterator_ms)
        if started and origin is not None:
            # Worker start-up: the iterator started them, until the first one began a batch
            # (imports, worker_init_fn, dataset copies); the first batch is ready after that.
            record["worker_startup_ms"] = max(0, min(s for s, _ in started) - origin) / 1e6
            record["first_batch_ms"] = max(0, min(e for _, e in started) - origin) / 1e6
        return record


def install_input_timing(loader: Any, observer: Any) -> tuple[InputTiming | None, str | None]:
    """Time ``loader``'s workers for ``observer`` (the callback): (timing, None) or (None, why)."""
    global _active
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader):
        return None, "the training dataloader is not one torch DataLoader"
    reason = unsupported_reason(loader)
    if reason is not None:
        return None, reason
    timing = InputTiming(loader, observer)
    try:
        timing.install()
    except BaseException:
        timing.uninstall()  # nothing half-installed stays behind (the map file included)
        raise
    _active = timing
    return timing, None
