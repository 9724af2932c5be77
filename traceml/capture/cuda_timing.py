"""Device-side phase times (CUDA events) and the per-step peak-memory window.

Host clocks see when work is *launched*; on CUDA the device runs behind. Events are recorded
on the current stream at each phase boundary and read only once the step's last event has
completed (``Event.query()``), so the hot path never calls ``synchronize()``. A step's record
waits in a short queue until then; at the end of training the queue is drained (one
synchronize, outside the measured steps).

Peak memory comes from the caching allocator's counters, which it keeps on the host, read at
step end with no device sync. traceml never resets them (``reset_peak_memory_stats`` would
overwrite what the user's own code reads from ``max_memory_allocated()``): the per-step figure
is the peak so far, which only grows; a step that raised it is a step that set a new peak.

Everything that touches torch is passed in (event factory, memory functions) so the queue
logic is tested on CPU with fake events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from traceml import schema
from traceml.step_record import STEP_KEYS


class EventLike(Protocol):
    def record(self) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end_event: Any) -> float: ...


PHASE_FIELDS = {
    "h2d": schema.GPU_H2D,
    "forward": schema.GPU_FORWARD,
    "backward": schema.GPU_BACKWARD,
    "optimizer": schema.GPU_OPTIMIZER,
}
# The record's keys (rank schema 2.0's short ones).
_K = STEP_KEYS
_PHASE_KEYS = {phase: _K[name] for phase, name in PHASE_FIELDS.items()}
_GPU_STEP, _GPU_COMM = _K[schema.GPU_STEP], _K[schema.GPU_COMM]
_GPU_COMM_KEYS = {phase: _K[name] for phase, name in schema.GPU_COMM_OF_PHASE.items()}
_GPU_KEY_OF_PHASE = {phase: _K[name] for phase, name in schema.GPU_OF_PHASE.items()}


def _ms(value: float) -> float:
    """Whole microseconds, as the host times: CUDA events resolve about half a microsecond,
    and their full float spelled 17 digits per field in every line."""
    return round(value, 3)


@dataclass
class _PendingStep:
    record: dict[str, Any]
    start: EventLike
    end: EventLike
    intervals: dict[str, list[tuple[EventLike, EventLike]]]
    comm: dict[str, list[tuple[EventLike, EventLike]]] | None = None
    end_is_a_phases: bool = False  # ``end`` is also an interval's (recycled once)


@dataclass
class CudaStepTimer:
    new_event: Callable[[], EventLike]
    # How an event is recorded; None: ``event.record()`` (the current device's stream).
    record: Callable[[EventLike], None] | None = None
    reset_peak: Callable[[], None] | None = None
    peak_allocated: Callable[[], int] | None = None
    peak_reserved: Callable[[], int] | None = None
    _free: list[EventLike] = field(default_factory=list)
    _step_start: EventLike | None = None
    _open: dict[str, EventLike] = field(default_factory=dict)
    _intervals: dict[str, list[tuple[EventLike, EventLike]]] = field(default_factory=dict)
    _last_end: EventLike | None = None  # the latest phase interval's end, this step
    _pending: deque[_PendingStep] = field(default_factory=deque)
    # Distributed runs: device time of waits on other ranks, by phase (see add_comm).
    comm_enabled: bool = False
    _comm: dict[str, list[tuple[EventLike, EventLike]]] = field(default_factory=dict)
    # Steps whose events could not be read at the end (a sticky CUDA error): written with
    # their host times only.
    unreadable: int = 0
    unreadable_reason: str | None = None

    def _event(self) -> EventLike:
        event = self._free.pop() if self._free else self.new_event()
        if self.record is None:
            event.record()
        else:
            self.record(event)
        return event

    def step_started(self) -> None:
        """First microbatch of a step: start the device clock and the memory window."""
        if self._step_start is None:
            self._step_start = self._event()
            if self.reset_peak is not None:
                self.reset_peak()

    def phase_started(self, phase: str) -> None:
        if self._step_start is not None and phase not in self._open:
            self._open[phase] = self._event()

    def phase_ended(self, phase: str) -> None:
        start = self._open.pop(phase, None)
        if start is not None:
            end = self._last_end = self._event()
            self._intervals.setdefault(phase, []).append((start, end))

    def mark(self) -> EventLike:
        """An event recorded now on the current stream (a collective's start or end)."""
        return self._event()

    def release(self, event: EventLike) -> None:
        """Give back an event from :meth:`mark` that will not be used."""
        self._free.append(event)

    def add_comm(self, phase: str, start: EventLike, end: EventLike) -> None:
        """A collective's device interval: on NCCL the current stream waits for the collective
        (and so for the slowest rank) between ``start`` and ``end``."""
        if self._step_start is None:
            self._free.extend((start, end))
            return
        self._comm.setdefault(phase, []).append((start, end))

    def step_ended(self, record: dict[str, Any], at_last_phase: bool = False) -> None:
        """Queue ``record``: its GPU fields are filled once the device has caught up.
        ``at_last_phase``: the step ends where its last phase did (microbatches left without
        an optimizer step, closed after the validation that followed them), not now."""
        if self._step_start is None:
            return
        for phase in list(self._open):
            self.phase_ended(phase)
        last, self._last_end = self._last_end, None
        shared = at_last_phase and last is not None
        if self.peak_allocated is not None:
            record[_K[schema.MEM_PEAK_ALLOCATED]] = int(self.peak_allocated())
        if self.peak_reserved is not None:
            record[_K[schema.MEM_PEAK_RESERVED]] = int(self.peak_reserved())
        pending = _PendingStep(
            record,
            self._step_start,
            last if shared else self._event(),
            self._intervals,
            self._comm if self.comm_enabled else None,
            shared,
        )
        self._pending.append(pending)
        self._step_start = None
        self._intervals = {}
        self._comm = {}

    def abandon_step(self) -> None:
        self._step_start = self._last_end = None
        self._open.clear()
        self._intervals = {}
        self._comm = {}

    def ready(self) -> Iterator[dict[str, Any]]:
        """Records whose device work has finished, oldest first; never blocks."""
        while self._pending and self._pending[0].end.query():
            yield self._finish(self._pending.popleft())

    def drain(self) -> Iterator[dict[str, Any]]:
        """All queued records, waiting for the device (end of training only).

        After a device error (a device-side assert makes every CUDA call fail from then on)
        the events cannot be read: those records come out with their host times and null
        device fields, never lost."""
        while self._pending:
            pending = self._pending.popleft()
            if self.unreadable_reason is None:
                try:
                    pending.end.synchronize()
                    yield self._finish(pending)
                    continue
                except Exception as exc:
                    self.unreadable_reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            self.unreadable += 1
            yield pending.record

    @property
    def queued(self) -> int:
        return len(self._pending)

    def _finish(self, pending: _PendingStep) -> dict[str, Any]:
        record = pending.record
        record[_GPU_STEP] = _ms(pending.start.elapsed_time(pending.end))
        for phase, key in _PHASE_KEYS.items():
            pairs = pending.intervals.get(phase)
            if pairs:
                record[key] = _ms(sum(start.elapsed_time(end) for start, end in pairs))
        events = [pending.start] if pending.end_is_a_phases else [pending.start, pending.end]
        for pairs in pending.intervals.values():
            for start, end in pairs:
                events.extend((start, end))
        if pending.comm is not None:
            events.extend(_comm_fields(record, pending))
        self._free.extend(events)
        return record


def _comm_fields(record: dict[str, Any], pending: _PendingStep) -> list[EventLike]:
    """The device's waits on other ranks, per phase and in all: each the length of the union
    of its intervals (two async collectives waited on together overlap; summing them would
    count the same wait twice), at most the phase's own device time (a phase's own time never
    comes out negative) and the step's. Returns the events used, to be recycled."""
    origin = pending.start
    events: list[EventLike] = []
    everything: list[tuple[float, float]] = []
    for phase, pairs in (pending.comm or {}).items():
        spans = [(origin.elapsed_time(start), origin.elapsed_time(end)) for start, end in pairs]
        for start, end in pairs:
            events.extend((start, end))
        everything.extend(spans)
        key = _GPU_COMM_KEYS.get(phase)
        if key is None:
            continue
        waited = union_length(spans)
        phase_key = _GPU_KEY_OF_PHASE.get(phase)
        if phase_key is not None and record.get(phase_key) is not None:
            waited = min(waited, record[phase_key])
        # A phase that did not wait is left out: absent means 0 when the total is there
        # (schema.ZERO_WHEN_MEASURED).
        waited = _ms(waited)
        if waited:
            record[key] = waited
    record[_GPU_COMM] = _ms(min(union_length(everything), record[_GPU_STEP]))
    return events


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by the (start, end) intervals, overlaps counted once."""
    total = 0.0
    reach = None
    for start, end in sorted(spans):
        if end <= start:
            continue
        if reach is None or start >= reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def cuda_step_timer(device: Any, cuda: Any = None) -> CudaStepTimer:
    """A timer bound to a real CUDA device (``cuda``: ``torch.cuda``, or a test's stand-in).
    Its events go on ``device``'s current stream, not the current device's: a model on
    ``cuda:1`` in a process that never called ``torch.cuda.set_device`` is timed on its own
    GPU, and traceml makes no CUDA context on GPU 0."""
    if cuda is None:
        import torch

        cuda = torch.cuda

    def new_event() -> EventLike:
        return cuda.Event(enable_timing=True)

    def record(event: Any) -> None:
        event.record(cuda.current_stream(device))

    return CudaStepTimer(
        new_event=new_event,
        record=record,
        reset_peak=None,  # never reset the user's counters (see the module docstring)
        peak_allocated=lambda: cuda.max_memory_allocated(device),
        peak_reserved=lambda: cuda.max_memory_reserved(device),
    )
