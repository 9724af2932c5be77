"""A finished step, kept as the clock's raw integers until its record is needed.

Why not the record at once: ``on_train_batch_end`` runs once per step on a cache that the step's
torch work has just evicted, so every line traceml runs there costs several times what it costs
in a loop. Building the record there (the phases' rounding, Residual, the comm fields, ~20 dict
stores) measured ~17 us per step on the stress loop. The training thread now only closes the
step (a few attribute moves); the sink's flusher calls :meth:`ClosedStep.record` with ~100
others in a row, warm. The numbers are the same: the arithmetic is the one the clock did.

A closed step must not change after the session hands it to the sink, except ``extra`` (the
session's RSS and cost fields) before it does.
"""

from __future__ import annotations

from typing import Any

from traceml import schema
from traceml.step_record import STEP_KEYS, StepRecord
from traceml.step_rows import usual_record

_StepRecord = StepRecord
# Record keys are rank schema 2.0's short ones (STEP_KEYS); phases stay long names.
_K = STEP_KEYS
_KIND, _KIND_STEP, _STEP_INDEX = schema.KIND, schema.KIND_STEP, _K[schema.STEP_INDEX]
_GLOBAL_STEP, _EPOCH, _MICROBATCHES = (
    _K[schema.GLOBAL_STEP],
    _K[schema.EPOCH],
    _K[schema.MICROBATCHES],
)
_OPTIMIZER_STEPPED, _T_START, _GAP = (
    _K[schema.OPTIMIZER_STEPPED],
    _K[schema.T_START_MS],
    _K[schema.GAP_MS],
)
_STEP, _INPUT_WAIT, _H2D = _K[schema.STEP], _K[schema.INPUT_WAIT], _K[schema.H2D]
_FORWARD, _BACKWARD, _OPTIMIZER = _K[schema.FORWARD], _K[schema.BACKWARD], _K[schema.OPTIMIZER]
_RESIDUAL = _K[schema.RESIDUAL]
_COMM, _COMM_COUNT, _COMM_BYTES = _K[schema.COMM], _K[schema.COMM_COUNT], _K[schema.COMM_BYTES]
_COMM_OF_PHASE = {phase: _K[name] for phase, name in schema.COMM_OF_PHASE.items()}
_PHASE_NS = {
    schema.INPUT_WAIT: "input_ns",
    schema.H2D: "h2d_ns",
    schema.FORWARD: "forward_ns",
    schema.BACKWARD: "backward_ns",
    schema.OPTIMIZER: "optimizer_ns",
}


class Group:
    """The microbatches that feed one optimizer update: open while the clock adds to it, then
    closed (``StepClock._close`` sets the fields below the line) and handed to the sink as the
    step whose record the flusher builds.

    One object per step, not two: the closed step was an instance of its own (a class call and
    an ``__init__`` frame per step, on the training thread). Defaults are class attributes and
    ``__init__`` sets only the start, for the same reason."""

    microbatches: int = 0
    input_ns: int | None = 0  # None: unmeasured (StepClock.fetch_unmeasured)
    h2d_ns: int | None = None
    forward_ns: int | None = None
    backward_ns: int | None = None
    optimizer_ns: int | None = None
    # Waits on other ranks, by the phase they fell in (see StepClock.collective).
    comm_ns: dict[str, int] | None = None
    comm_count: int = 0
    comm_bytes: int = 0
    # Where its last timed phase ended: a group closed without an optimizer step (the
    # microbatches left at an epoch's end) ends there, not when the adapter learns the epoch
    # is over (after validation, at the next epoch's first forward).
    phase_end_ns: int | None = None
    # -- set when closed --
    clock: Any = None  # the StepClock: origin, comm_enabled, and its overlaps counter
    end_ns: int = 0
    last_end_ns: int | None = None
    optimizer_stepped: bool = True
    global_step: int | None = None
    epoch: int | None = None
    index: int = 0
    # Fields the session adds (RSS, traceml's own cost), by short key: a dict of the step's
    # own, made when it closes.
    extra: dict[str, Any]

    def __init__(self, start_ns: int) -> None:
        self.start_ns = start_ns

    def __repr__(self) -> str:
        return f"Group({vars(self)})"

    @property
    def untrained(self) -> bool:
        """No forward, backward or optimizer timed: its batch was fetched and never trained
        on (Lightning's on_train_batch_start returned -1), not a step."""
        return self.forward_ns is None and self.backward_ns is None and self.optimizer_ns is None

    def record(self) -> dict[str, Any]:
        """The step's record (rank schema 2.0 keys). Counts an overlap on the clock the first
        time, so call it once (the sink does)."""
        group = self
        h2d, forward, backward, optimizer = (
            group.h2d_ns,
            group.forward_ns,
            group.backward_ns,
            group.optimizer_ns,
        )
        # The usual step (every phase measured, one microbatch, no comm fields): one dict
        # display. The flusher builds ~1,000 of these a second on a fast loop, holding the GIL
        # that the training thread wants.
        if (
            None not in (group.input_ns, h2d, forward, backward, optimizer, self.last_end_ns)
            and self.global_step is not None
            and self.epoch is not None
            and self.optimizer_stepped
            and group.microbatches == 1
            and not self.clock.comm_enabled
        ):
            return self._usual(h2d, forward, backward, optimizer)  # type: ignore[arg-type]
        step_ns = self.end_ns - group.start_ns
        residual_ns = step_ns
        for value in (group.input_ns, h2d, forward, backward, optimizer):
            if value is not None:
                residual_ns -= value
        if residual_ns < 0:
            self._overlapped()
            step_ns -= residual_ns
            residual_ns = 0
        record = self._phases(step_ns)
        if self.clock.comm_enabled:
            _comm_fields(record, group, residual_ns)
        if self.extra:
            record.update(self.extra)
        return record

    def _overlapped(self) -> None:
        # Phases are disjoint by construction; a negative residual means two hooks overlapped
        # (e.g. a re-entrant forward). Count it instead of hiding it.
        self.clock.overlaps += 1

    def _usual(self, h2d: int, forward: int, backward: int, optimizer: int) -> Any:
        """:meth:`record` of the usual step (:func:`usual_record`, then ``extra``)."""
        record = usual_record(
            self.clock,
            self.index,
            self.global_step,
            self.epoch,
            self.start_ns,
            self.end_ns,
            self.last_end_ns,  # type: ignore[arg-type]
            self.input_ns,
            h2d,
            forward,
            backward,
            optimizer,
        )
        record.update(self.extra)
        return record

    def _phases(self, step_ns: int) -> dict[str, Any]:
        """The record without its comm fields: only what was measured, in whole microseconds;
        MICROBATCHES and OPTIMIZER_STEPPED only when they differ from schema.STEP_DEFAULTS."""
        group = self
        h2d, forward, backward, optimizer = (
            group.h2d_ns,
            group.forward_ns,
            group.backward_ns,
            group.optimizer_ns,
        )
        input_ns = group.input_ns
        input_us = None if input_ns is None else (input_ns + 500) // 1000
        h2d_us = None if h2d is None else (h2d + 500) // 1000
        forward_us = None if forward is None else (forward + 500) // 1000
        backward_us = None if backward is None else (backward + 500) // 1000
        optimizer_us = None if optimizer is None else (optimizer + 500) // 1000
        named_us = (
            (input_us or 0)
            + (h2d_us or 0)
            + (forward_us or 0)
            + (backward_us or 0)
            + (optimizer_us or 0)
        )
        step_us = (step_ns + 500) // 1000
        residual_us = step_us - named_us
        if residual_us < 0:  # rounding only: the overlap case was handled in ns
            step_us, residual_us = named_us, 0
        origin = self.clock.origin_ns
        record = _StepRecord()
        record[_KIND] = _KIND_STEP
        record[_STEP_INDEX] = self.index
        if self.global_step is not None:
            record[_GLOBAL_STEP] = self.global_step
        if self.epoch is not None:
            record[_EPOCH] = self.epoch
        if group.microbatches != 1:
            record[_MICROBATCHES] = group.microbatches
        if not self.optimizer_stepped:
            record[_OPTIMIZER_STEPPED] = False
        record[_T_START] = ((group.start_ns - origin + 500) // 1000) / 1000.0
        if self.last_end_ns is not None:
            record[_GAP] = ((group.start_ns - self.last_end_ns + 500) // 1000) / 1000.0
        record[_STEP] = step_us / 1000.0
        if input_us is not None:  # null: batches from no timed loader (any-loop capture)
            record[_INPUT_WAIT] = input_us / 1000.0
        if h2d_us is not None:
            record[_H2D] = h2d_us / 1000.0
        if forward_us is not None:
            record[_FORWARD] = forward_us / 1000.0
        if backward_us is not None:
            record[_BACKWARD] = backward_us / 1000.0
        if optimizer_us is not None:
            record[_OPTIMIZER] = optimizer_us / 1000.0
        record[_RESIDUAL] = residual_us / 1000.0
        return record


def _comm_fields(record: dict[str, Any], group: Group, residual_ns: int) -> None:
    total = 0
    # Only the phases that waited (usually Backward): absent means 0 when COMM is present
    # (schema.ZERO_WHEN_MEASURED).
    for phase, ns in (group.comm_ns or {}).items():
        fieldname = _COMM_OF_PHASE.get(phase)
        if fieldname is None or ns <= 0:
            continue
        # A wait is inside its phase: never more than the phase itself (clock edges).
        limit = residual_ns if phase == schema.RESIDUAL else getattr(group, _PHASE_NS[phase]) or 0
        us = (min(ns, limit) + 500) // 1000
        if us:
            total += us
            record[fieldname] = us / 1000.0
    record[_COMM] = total / 1000.0
    if group.comm_count:
        record[_COMM_COUNT] = group.comm_count
    if group.comm_bytes:
        record[_COMM_BYTES] = group.comm_bytes


# A Group once closed (``StepClock.batch_closed``): the name says which side of the close.
ClosedStep = Group
