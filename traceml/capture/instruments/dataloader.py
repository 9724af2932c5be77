"""Worker-side timing of the traced training DataLoader: ``__getitem__``, ``collate_fn``, idle.

What is timed, per batch, where the batch is made (each DataLoader worker, or the main process
when ``num_workers=0``): the dataset's ``__getitem__`` (or ``__getitems__``) summed over the
batch's samples, the ``collate_fn`` call, and the batch's busy span (first sample started to
collate ended). A worker's idle time is the rest of its life after its first batch started:
waiting for an index, and handing the batch to the main process (pickling into shared memory).

How it gets there: the one training DataLoader instance gets, before its epoch iterator exists,

* its dataset's ``__class__`` swapped for a timing subclass (per instance, like the fetcher in
  ``lightning_instruments``): ``__getitem__`` calls the user's method exactly once, returns its
  object, and lets its exceptions through;
* its ``collate_fn`` attribute replaced by a timing wrapper around the user's function.

Workers are forked when the epoch's iterator is created, so they inherit both, and an anonymous
shared memory map (one slot of counters per worker, plus slot 0 for the main process). A worker
writes its slot once per batch (``struct.pack_into``, guarded by a sequence counter so the main
process never reads half a write); the main process reads the slots once per epoch. Measured
(benchmarks/dataloader_transport.py, 2-core CPU, per batch): the shared map 0.3 us per write
(two per batch), never blocks and needs nothing read on the other side until the epoch ends; a
multiprocessing queue 0.7 us per put plus the pickling in a feeder thread started in every
worker and a reader in the main process; a per-worker file 0.75 us (a system call) and files to
clean up.

Spawned workers (the ``spawn`` and ``forkserver`` start methods) inherit nothing: they unpickle
the dataset, the ``collate_fn`` and the ``worker_init_fn``. There the dataset's class stays the
user's in the main process (a swapped class could not be pickled), the ``collate_fn`` wrapper is
a picklable class, and the ``worker_init_fn`` is wrapped so that each worker swaps its own
dataset copy's class and opens the same map, backed by a small temporary file (in /dev/shm where
it exists) whose path it carries; the file is removed when the timing is uninstalled.

Supported: map-style datasets, ``num_workers`` 0 or more, persistent workers, the ``fork``,
``spawn`` and ``forkserver`` start methods. Not supported (left untimed, with a note in the rank
file): iterable datasets (no per-sample call), datasets whose class cannot be swapped
(``__slots__`` without ``__dict__``, C types), and more than MAX_WORKERS workers. A dataset
object shared with a validation DataLoader is counted there too (forked workers, or
``num_workers=0``).

Everything traceml does inside a worker is fail-open: a failure turns that worker's timing off
and never reaches the batch. In the main process the two doors (``dataloader.getitem``,
``dataloader.collate``) are guarded entry points whose failure turns tracing off with one warning.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from typing import Any

from traceml.capture.guard import entry_point

clock_ns = time.perf_counter_ns

MAX_WORKERS = 255
# One slot: seq, pid, samples, batches, getitem_ns, collate_ns, busy_ns, first_start_ns,
# first_end_ns, last_end_ns. seq is odd while the writer is inside a write.
_SLOT = struct.Struct("<10q")
_SEQ = struct.Struct("<q")
_MAP_SIZE = _SLOT.size * (MAX_WORKERS + 1)
SLOT_FIELDS = (
    "pid",
    "samples",
    "batches",
    "getitem_ns",
    "collate_ns",
    "busy_ns",
    "first_start_ns",
    "first_end_ns",
    "last_end_ns",
)

_timed_datasets: dict[type, type] = {}
# The timing of the traced DataLoader (one per process); workers inherit it through fork.
_active: InputTiming | None = None


class _ProcessCounters:
    """What this process (a worker, or the main process) has made so far."""

    __slots__ = (
        "batch_start_ns",
        "batches",
        "busy_ns",
        "collate_ns",
        "first_end_ns",
        "first_start_ns",
        "getitem_ns",
        "last_end_ns",
        "pid",
        "samples",
        "seq",
        "slot",
    )

    def __init__(self, pid: int, slot: int) -> None:
        self.pid, self.slot = pid, slot
        self.samples = self.batches = self.getitem_ns = self.collate_ns = self.busy_ns = 0
        self.first_start_ns = self.first_end_ns = self.last_end_ns = 0
        self.batch_start_ns: int | None = None
        self.seq = 0


def _forget_parent_counters() -> None:
    """In a forked child (a DataLoader worker): the counters copied from the parent are the
    parent's; the child counts in a slot of its own."""
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


_timed_loaders: dict[type, type] = {}


def timed_loader_class(base: type) -> type:
    """A subclass of the DataLoader class ``base`` whose epoch iterators report their start."""
    if base not in _timed_loaders:

        def _get_iterator(self):
            start = clock_ns()
            iterator = super(timed, self)._get_iterator()
            timing = self.__dict__.get("_traceml_timing")
            if timing is not None and timing.on:
                timing.iterator_created(start, clock_ns())
            return iterator

        timed = type(
            f"TraceMLTimed{base.__name__}",
            (base,),
            {"_get_iterator": _get_iterator, "__module__": __name__},
        )
        _timed_loaders[base] = timed
    return _timed_loaders[base]


def timed_dataset_class(base: type) -> type:
    """A subclass of the dataset class ``base`` whose item calls report their time."""
    if base in _timed_datasets:
        return _timed_datasets[base]

    def __getitem__(self, index):
        start = clock_ns()
        item = super(timed, self).__getitem__(index)  # user errors pass through untouched
        timing = _active
        if timing is not None and timing.on:
            timing.sample_made(start, 1)
        return item

    # torch's fetcher calls __getitems__(indices) for a batch when the dataset has one, and
    # that is what a batched loader calls here either way: one clock pair and one entry point
    # per batch, not per sample (a batch of 64 on num_workers=0 would otherwise pay 64 times
    # on the training critical path). Without the user's own __getitems__, the batch is the
    # user's __getitem__ per index, exactly what torch's fetcher would have done.
    if callable(getattr(base, "__getitems__", None)):

        def fetch_many(self, indices):
            return super(timed, self).__getitems__(indices)

    else:

        def fetch_many(self, indices):
            getitem = super(timed, self).__getitem__
            return [getitem(index) for index in indices]

    def __getitems__(self, indices):
        start = clock_ns()
        items = fetch_many(self, indices)  # user errors pass through untouched
        timing = _active
        if timing is not None and timing.on:
            timing.sample_made(start, len(indices))
        return items

    namespace: dict[str, Any] = {
        "__getitem__": __getitem__,
        "__getitems__": __getitems__,
        "__module__": __name__,
    }
    timed = type(f"TraceMLTimed{base.__name__}", (base,), namespace)
    _timed_datasets[base] = timed
    return timed


class TimedCollate:
    """The traced DataLoader's ``collate_fn``: calls the user's exactly once and reports the
    time to this process's timing. A class, not a closure, so that spawned workers can unpickle
    it (the user's function must be picklable there anyway)."""

    __slots__ = ("user_collate",)

    def __init__(self, user_collate: Any) -> None:
        self.user_collate = user_collate

    def __call__(self, batch: Any) -> Any:
        start = clock_ns()
        result = self.user_collate(batch)  # user errors pass through untouched
        timing = _active
        if timing is not None and timing.on:
            timing.batch_made(start)
        return result


class SpawnedWorkerStart:
    """``worker_init_fn`` of a traced DataLoader whose workers are spawned (spawn, forkserver):
    the worker times its own copy of the dataset, then runs the user's ``worker_init_fn``."""

    def __init__(self, user_init: Any, map_path: str | None, main_pid: int) -> None:
        self.user_init = user_init
        self.map_path = map_path
        self.main_pid = main_pid

    def __call__(self, worker_id: int) -> None:
        try:
            _time_this_spawned_worker(self.map_path, self.main_pid)
        except Exception:
            pass  # this worker stays untimed; nothing reaches its batches
        if self.user_init is not None:
            self.user_init(worker_id)


def _time_this_spawned_worker(map_path: str | None, main_pid: int) -> None:
    global _active
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None or map_path is None:
        return
    with open(map_path, "r+b") as file:
        shared = mmap.mmap(file.fileno(), _MAP_SIZE)
    # The main process's pid, not this one's: a failure here stays in this worker.
    timing = InputTiming(None, None, shared=shared, main_pid=main_pid)
    dataset = info.dataset
    dataset.__class__ = timed_dataset_class(type(dataset))
    _active = timing


def _file_backed_map() -> tuple[mmap.mmap, str]:
    """A zeroed shared map backed by a small temporary file (in memory where /dev/shm
    exists), and the file's path."""
    import tempfile

    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="traceml-input-", dir=directory)
    try:
        os.ftruncate(fd, _MAP_SIZE)
        return mmap.mmap(fd, _MAP_SIZE), path
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)


class InputTiming:
    """The timing installed on one training DataLoader, and how to take it away again."""

    def __init__(
        self,
        loader: Any,
        observer: Any,
        *,
        shared: mmap.mmap | None = None,
        main_pid: int | None = None,
    ) -> None:
        """``shared`` and ``main_pid`` are given inside a spawned worker (the map it opened,
        the training process's pid); the main process makes its own map."""
        self.loader = loader
        self.observer = observer  # the callback: failures in the main process go to it
        self.main_pid = os.getpid() if main_pid is None else main_pid
        self.on = True
        self.own_cost_ns = 0
        self.num_workers = int(getattr(loader, "num_workers", 0) or 0)
        # Forked workers inherit an anonymous map; spawned ones (spawn, forkserver) open a
        # small file by name instead (its path travels in their worker_init_fn).
        self.map_path: str | None = None
        if shared is not None:
            self.shared = shared
        elif (
            self.num_workers
            and _start_method(getattr(loader, "multiprocessing_context", None)) != "fork"
        ):
            self.shared, self.map_path = _file_backed_map()
        else:
            self.shared = mmap.mmap(-1, _MAP_SIZE)
        self.counters: _ProcessCounters | None = None
        # Main-process bookkeeping: last reading per worker pid, epoch start.
        self._seen: dict[int, tuple[int, ...]] = {}
        self._iterator_ms: float | None = None
        self._iterator_start_ns: int | None = None
        self._undo: list[Any] = []

    # -- installing ------------------------------------------------------------------------

    def install(self) -> None:
        loader = self.loader
        loader_class = type(loader)
        loader.__class__ = timed_loader_class(loader_class)
        loader.__dict__["_traceml_timing"] = self

        def restore_loader() -> None:
            if type(loader) is _timed_loaders.get(loader_class):
                loader.__class__ = loader_class
            loader.__dict__.pop("_traceml_timing", None)

        self._undo.append(restore_loader)
        if self.map_path is None:
            self._swap_dataset_class(loader.dataset)
        else:
            self._start_spawned_workers_timed(loader)
        user_collate = loader.collate_fn
        timed_collate = TimedCollate(user_collate)
        loader.collate_fn = timed_collate

        def restore_collate() -> None:
            if loader.__dict__.get("collate_fn") is timed_collate:
                loader.collate_fn = user_collate

        self._undo.append(restore_collate)

    def _swap_dataset_class(self, dataset: Any) -> None:
        original_class = type(dataset)
        dataset.__class__ = timed_dataset_class(original_class)

        def restore_dataset() -> None:
            if type(dataset) is _timed_datasets.get(original_class):
                dataset.__class__ = original_class

        self._undo.append(restore_dataset)

    def _start_spawned_workers_timed(self, loader: Any) -> None:
        """Spawned workers unpickle the dataset, so its class stays the user's here (a swapped
        class could not be pickled); each worker swaps its own copy's when it starts."""
        user_init = loader.worker_init_fn
        start = SpawnedWorkerStart(user_init, self.map_path, self.main_pid)
        loader.worker_init_fn = start
        map_path = self.map_path

        def restore_init() -> None:
            if loader.__dict__.get("worker_init_fn") is start:
                loader.worker_init_fn = user_init
            with contextlib.suppress(OSError):
                os.unlink(map_path)

        self._undo.append(restore_init)

    def uninstall(self) -> None:
        """Undo every change (idempotent); the map stays readable for a last collect."""
        global _active
        self.on = False
        while self._undo:
            try:
                self._undo.pop()()
            except Exception:
                pass
        if _active is self:
            _active = None

    # -- the two doors (workers, or the main process when num_workers=0) -------------------

    def _entry_failed(self, name: str, exc: BaseException) -> None:
        self.on = False
        if os.getpid() == self.main_pid:
            self.observer._entry_failed(name, exc)
        # In a worker: that worker's timing is off; nothing may reach the user's batch, and
        # the worker must not write to the rank file (its descriptor is the parent's).

    def _here(self) -> _ProcessCounters | None:
        # A forked worker starts with no counters (_forget_parent_counters): no getpid()
        # system call per sample to find out which process this is.
        counters = self.counters
        if counters is None:
            slot = _worker_slot()
            if slot is None:
                self.on = False
                return None
            counters = self.counters = _ProcessCounters(os.getpid(), slot)
        return counters

    @entry_point("dataloader.getitem", "after the traced dataset's __getitem__ (per sample)")
    def sample_made(self, start: int, samples: int) -> None:
        end = clock_ns()
        counters = self._here()
        if counters is None:
            return
        counters.samples += samples
        counters.getitem_ns += end - start
        if counters.batch_start_ns is None:
            counters.batch_start_ns = start
            if not counters.first_start_ns:
                counters.first_start_ns = start

    @entry_point("dataloader.collate", "after the traced DataLoader's collate_fn (per batch)")
    def batch_made(self, start: int) -> None:
        end = clock_ns()
        counters = self._here()
        if counters is None:
            return
        counters.collate_ns += end - start
        batch_start = counters.batch_start_ns if counters.batch_start_ns is not None else start
        if not counters.first_start_ns:
            counters.first_start_ns = batch_start
        counters.busy_ns += end - batch_start
        counters.batch_start_ns = None
        counters.batches += 1
        counters.last_end_ns = end
        if not counters.first_end_ns:
            counters.first_end_ns = end
        self._publish(counters)

    def _publish(self, counters: _ProcessCounters) -> None:
        offset = counters.slot * _SLOT.size
        counters.seq += 1
        _SEQ.pack_into(self.shared, offset, counters.seq)  # odd: a write is in progress
        counters.seq += 1
        _SLOT.pack_into(
            self.shared,
            offset,
            counters.seq,
            counters.pid,
            counters.samples,
            counters.batches,
            counters.getitem_ns,
            counters.collate_ns,
            counters.busy_ns,
            counters.first_start_ns,
            counters.first_end_ns,
            counters.last_end_ns,
        )

    # -- the main process ------------------------------------------------------------------

    def iterator_created(self, start: int, end: int) -> None:
        """The DataLoader made an epoch iterator (forked its workers, unless persistent)."""
        self._iterator_start_ns = start
        self._iterator_ms = (self._iterator_ms or 0.0) + (end - start) / 1e6

    def read_slots(self) -> dict[int, tuple[int, ...]]:
        """slot -> the SLOT_FIELDS of the process writing it (consistent reads only)."""
        slots = {}
        for slot in range(MAX_WORKERS + 1):
            offset = slot * _SLOT.size
            for _attempt in range(100):
                values = _SLOT.unpack_from(self.shared, offset)
                if values[0] % 2 == 0 and _SEQ.unpack_from(self.shared, offset)[0] == values[0]:
                    break
            else:
                continue
            if values[0]:
                slots[slot] = values[1:]
        return slots

    def epoch_record(self, epoch: Any) -> dict[str, Any] | None:
        """What each producer made since the previous call, as an ``input`` record."""
        workers = []
        started: list[tuple[int, int]] = []  # (first start, first end) of workers new here
        for slot, values in sorted(self.read_slots().items()):
            fields = dict(zip(SLOT_FIELDS, values, strict=True))
            previous = self._seen.get(fields["pid"])
            self._seen[fields["pid"]] = values
            if previous is not None:
                before = dict(zip(SLOT_FIELDS, previous, strict=True))
                span_start = before["last_end_ns"]
            else:
                before = dict.fromkeys(SLOT_FIELDS, 0)
                span_start = fields["first_start_ns"]
                if slot:
                    started.append((fields["first_start_ns"], fields["first_end_ns"]))
            batches = fields["batches"] - before["batches"]
            if batches <= 0:
                continue
            busy = fields["busy_ns"] - before["busy_ns"]
            workers.append(
                {
                    "worker": slot - 1 if slot else None,
                    "batches": batches,
                    "samples": fields["samples"] - before["samples"],
                    "getitem_ms": (fields["getitem_ns"] - before["getitem_ns"]) / 1e6,
                    "collate_ms": (fields["collate_ns"] - before["collate_ns"]) / 1e6,
                    "busy_ms": busy / 1e6,
                    "span_ms": max(fields["last_end_ns"] - span_start, busy) / 1e6,
                }
            )
        iterator_ms, self._iterator_ms = self._iterator_ms, None
        origin, self._iterator_start_ns = self._iterator_start_ns, None
        if not workers and iterator_ms is None:
            return None
        record = input_record(self.loader, epoch, workers, iterator_ms)
        if started and origin is not None:
            # Worker start-up: the iterator forked them, until the first one began a batch
            # (imports, worker_init_fn, dataset copies); the first batch is ready after that.
            record["worker_startup_ms"] = max(0, min(s for s, _ in started) - origin) / 1e6
            record["first_batch_ms"] = max(0, min(e for _, e in started) - origin) / 1e6
        return record


def input_record(
    loader: Any, epoch: Any, workers: list[dict[str, Any]], iterator_ms: float | None
) -> dict[str, Any]:
    from traceml import schema

    context = getattr(loader, "multiprocessing_context", None)
    return {
        schema.KIND: schema.KIND_INPUT,
        schema.EPOCH: epoch,
        "num_workers": int(getattr(loader, "num_workers", 0) or 0),
        "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
        "pin_memory": bool(getattr(loader, "pin_memory", False)),
        "start_method": _start_method(context),
        "cpu_count": _cpu_count(),
        "iterator_ms": iterator_ms,
        "worker_startup_ms": None,
        "first_batch_ms": None,
        "producers": workers,
    }


def _start_method(context: Any) -> str:
    if context is None:
        import multiprocessing

        return multiprocessing.get_start_method()
    if isinstance(context, str):
        return context
    return context.get_start_method()


def _cpu_count() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def unsupported_reason(loader: Any) -> str | None:
    """Why this DataLoader's input cannot be timed, or None."""
    from torch.utils.data import IterableDataset

    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, IterableDataset):
        return "an iterable dataset (no per-sample call to time)"
    if int(getattr(loader, "num_workers", 0) or 0) > MAX_WORKERS:
        return f"more than {MAX_WORKERS} DataLoader workers"
    if int(getattr(loader, "num_workers", 0) or 0) > 0:
        method = _start_method(getattr(loader, "multiprocessing_context", None))
        if method not in ("fork", "spawn", "forkserver"):
            return f"DataLoader workers started with {method!r}"
    if not hasattr(dataset, "__dict__"):
        return f"a dataset of type {type(dataset).__name__} (its class cannot be swapped)"
    return None


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
    except TypeError as exc:  # __class__ assignment refused (layout differs)
        timing.uninstall()
        return None, f"the dataset's class cannot be swapped ({exc})"
    _active = timing
    return timing, None
