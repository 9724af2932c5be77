"""The phase clock: boundary timestamps in, one step record per optimizer update out.

Pure Python over integers from ``time.perf_counter_ns`` (the caller passes them in, so tests
are exact). The Lightning callback tells the clock where each phase begins and ends; the clock
groups the microbatches of one gradient-accumulation window into one step and computes
Residual as the part of the step no phase explains, so the phases and Residual always add up
to the step time.

A step spans from the training DataLoader fetch of its first microbatch (or, at an epoch's
start, from the creation of the DataLoader iterator) to ``on_train_batch_end`` of its last
microbatch. Time between steps (validation, checkpointing, epoch ends) is reported as the next
step's ``gap_ms``, never inside a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from traceml import schema
from traceml.step_record import STEP_KEYS, StepRecord

NS_PER_MS = 1_000_000
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


def ns_to_ms(value: int | None) -> float | None:
    return None if value is None else value / NS_PER_MS


# slots: made and read on every step (no per-instance __dict__ to allocate).
@dataclass(slots=True)
class _Group:
    """Microbatches that feed one optimizer update."""

    start_ns: int
    microbatches: int = 0
    input_ns: int = 0
    h2d_ns: int | None = None
    forward_ns: int | None = None
    backward_ns: int | None = None
    optimizer_ns: int | None = None
    # Waits on other ranks, by the phase they fell in (see StepClock.collective).
    comm_ns: dict[str, int] | None = None
    comm_count: int = 0
    comm_bytes: int = 0


@dataclass(slots=True)
class _Microbatch:
    forward_depth: int = 0
    forward_start_ns: int = 0
    backward_start_ns: int | None = None
    backward_open: bool = False
    in_h2d: bool = False
    optimizer_start_ns: int | None = None
    # Forward/backward time inside the optimizer window: an optimizer whose step runs the
    # closure again (LBFGS) re-evaluates the model there; that is Forward/Backward, not
    # Optimizer, and is taken out of the optimizer window.
    nested_ns: int = 0


@dataclass
class StepClock:
    origin_ns: int
    _group: _Group | None = None
    _micro: _Microbatch | None = None
    _pending_iter: tuple[int, int] | None = None
    _last_end_ns: int | None = None
    steps_emitted: int = 0
    overlaps: int = 0
    # True in a distributed run whose collectives are timed: comm fields are then numbers
    # (0 when a step had no collective), otherwise null (unmeasured).
    comm_enabled: bool = False

    # -- boundaries, in the order Lightning reaches them ---------------------------------

    @property
    def in_microbatch(self) -> bool:
        return self._micro is not None

    @property
    def in_step(self) -> bool:
        """A step (accumulation window) is open: its first microbatch has been fetched."""
        return self._group is not None

    def iterator_created(self, start_ns: int, end_ns: int) -> None:
        """An epoch's DataLoader iterator was created (workers start, maybe a first fetch).

        That wait belongs to the next step's Input Wait, and the step starts with it.
        """
        self._pending_iter = (start_ns, end_ns)

    def fetched(self, start_ns: int, end_ns: int) -> None:
        """The training loop got a batch from its DataLoader: a microbatch begins."""
        input_ns = end_ns - start_ns
        window_start = start_ns
        if self._pending_iter is not None:
            iter_start, iter_end = self._pending_iter
            self._pending_iter = None
            input_ns += iter_end - iter_start
            window_start = iter_start
        if self._group is None:
            self._group = _Group(start_ns=window_start)
        self._group.input_ns += input_ns
        self._micro = _Microbatch()

    def transfer_started(self) -> None:
        if self._micro is not None:
            self._micro.in_h2d = True

    def transferred(self, start_ns: int, end_ns: int) -> None:
        """The strategy moved the batch to the device (H2D)."""
        if self._group is None or self._micro is None:
            return
        self._micro.in_h2d = False
        self._group.h2d_ns = (self._group.h2d_ns or 0) + (end_ns - start_ns)

    def forward_started(self, now_ns: int) -> None:
        micro = self._micro
        # A forward run by autograd during backward (activation checkpointing recomputes
        # segments) belongs to Backward.
        if micro is None or micro.backward_open:
            return
        if micro.forward_depth == 0:
            micro.forward_start_ns = now_ns
        micro.forward_depth += 1

    def forward_ended(self, now_ns: int) -> None:
        micro, group = self._micro, self._group
        if micro is None or group is None or micro.forward_depth == 0:
            return
        micro.forward_depth -= 1
        if micro.forward_depth == 0:
            elapsed = now_ns - micro.forward_start_ns
            group.forward_ns = (group.forward_ns or 0) + elapsed
            if micro.optimizer_start_ns is not None:
                micro.nested_ns += elapsed

    def backward_started(self, now_ns: int) -> None:
        if self._micro is not None:
            self._micro.backward_start_ns = now_ns
            self._micro.backward_open = True

    def backward_ended(self, now_ns: int) -> None:
        micro, group = self._micro, self._group
        if micro is None or group is None or micro.backward_start_ns is None:
            return
        if not micro.backward_open:
            return
        micro.backward_open = False
        elapsed = now_ns - micro.backward_start_ns
        group.backward_ns = (group.backward_ns or 0) + elapsed
        if micro.optimizer_start_ns is not None:
            micro.nested_ns += elapsed

    def optimizer_started(self, now_ns: int) -> None:
        # Once per microbatch: a closure re-run inside the step (LBFGS) calls the hook again.
        if self._micro is not None and self._micro.optimizer_start_ns is None:
            self._micro.optimizer_start_ns = now_ns

    def current_phase(self) -> str | None:
        """The phase a collective called now falls in; None outside a training step."""
        micro = self._micro
        if micro is None:
            # Between the microbatches of one accumulation window: loop bookkeeping, Residual.
            return schema.RESIDUAL if self._group is not None else None
        if micro.backward_open:
            return schema.BACKWARD
        if micro.forward_depth:
            return schema.FORWARD
        if micro.in_h2d:
            return schema.H2D
        if micro.optimizer_start_ns is not None:
            return schema.OPTIMIZER
        return schema.RESIDUAL

    def collective(self, phase: str, wait_ns: int, nbytes: int = 0, count: int = 1) -> None:
        """Time spent blocked waiting on other ranks inside ``phase`` of the open step."""
        group = self._group
        if group is None:
            return
        comm = group.comm_ns
        if comm is None:
            comm = group.comm_ns = {}
        comm[phase] = comm.get(phase, 0) + max(0, wait_ns)
        group.comm_count += count
        group.comm_bytes += nbytes

    def batch_ended(
        self, now_ns: int, global_step: int | None = None, epoch: int | None = None
    ) -> dict[str, Any] | None:
        """``on_train_batch_end``: returns the step record when this microbatch stepped the
        optimizer (the end of an accumulation window), else None."""
        micro, group = self._micro, self._group
        self._micro = None
        if micro is None or group is None:
            return None
        group.microbatches += 1
        if micro.optimizer_start_ns is None:
            return None
        window = now_ns - micro.optimizer_start_ns - micro.nested_ns
        group.optimizer_ns = (group.optimizer_ns or 0) + max(0, window)
        return self._close(now_ns, True, global_step, epoch)

    def epoch_ended(
        self, now_ns: int, global_step: int | None = None, epoch: int | None = None
    ) -> dict[str, Any] | None:
        """Flush microbatches that never reached an optimizer step (nothing is dropped)."""
        self._micro = None
        self._pending_iter = None
        group = self._group
        if group is None or group.microbatches == 0:
            self._group = None
            return None
        return self._close(now_ns, False, global_step, epoch)

    def abandon(self) -> None:
        """Training stopped mid-step (exception, interrupt): the open step is not a step."""
        self._group = None
        self._micro = None
        self._pending_iter = None

    # -- record ----------------------------------------------------------------------------

    def _close(
        self, end_ns: int, optimizer_stepped: bool, global_step: int | None, epoch: int | None
    ) -> dict[str, Any]:
        # Runs once per optimizer step on the training thread: a copy of a prepared record and
        # plain assignments (no helper calls), to keep traceml's per-step cost low.
        group = self._group
        assert group is not None
        self._group = None
        step_ns = end_ns - group.start_ns
        h2d, forward, backward, optimizer = (
            group.h2d_ns,
            group.forward_ns,
            group.backward_ns,
            group.optimizer_ns,
        )
        named_total = group.input_ns
        for value in (h2d, forward, backward, optimizer):
            if value is not None:
                named_total += value
        residual_ns = step_ns - named_total
        if residual_ns < 0:
            # Phases are disjoint by construction; a negative residual means two hooks
            # overlapped (e.g. a re-entrant forward). Count it instead of hiding it.
            self.overlaps += 1
            residual_ns = 0
            step_ns = named_total
        last_end = self._last_end_ns
        self._last_end_ns = end_ns
        record = self._record(group, step_ns, last_end, optimizer_stepped, global_step, epoch)
        if self.comm_enabled:
            self._comm_fields(record, group, residual_ns)
        self.steps_emitted += 1
        return record

    def _record(
        self,
        group: _Group,
        step_ns: int,
        last_end: int | None,
        optimizer_stepped: bool,
        global_step: int | None,
        epoch: int | None,
    ) -> dict[str, Any]:
        """The step's record (its comm fields excepted)."""
        h2d, forward, backward, optimizer = (
            group.h2d_ns,
            group.forward_ns,
            group.backward_ns,
            group.optimizer_ns,
        )
        # Only what was measured, in whole microseconds; MICROBATCHES and OPTIMIZER_STEPPED
        # only when they differ from schema.STEP_DEFAULTS (about a third of the bytes of a
        # record that spelled every field). Hot path: names bound at import, rounding inline.
        input_us = (group.input_ns + 500) // 1000
        h2d_us = None if h2d is None else (h2d + 500) // 1000
        forward_us = None if forward is None else (forward + 500) // 1000
        backward_us = None if backward is None else (backward + 500) // 1000
        optimizer_us = None if optimizer is None else (optimizer + 500) // 1000
        named_us = (
            input_us + (h2d_us or 0) + (forward_us or 0) + (backward_us or 0) + (optimizer_us or 0)
        )
        step_us = (step_ns + 500) // 1000
        residual_us = step_us - named_us
        if residual_us < 0:  # rounding only: the overlap case was handled in ns above
            step_us, residual_us = named_us, 0
        record = _StepRecord()
        record[_KIND] = _KIND_STEP
        record[_STEP_INDEX] = self.steps_emitted
        if global_step is not None:
            record[_GLOBAL_STEP] = global_step
        if epoch is not None:
            record[_EPOCH] = epoch
        if group.microbatches != 1:
            record[_MICROBATCHES] = group.microbatches
        if not optimizer_stepped:
            record[_OPTIMIZER_STEPPED] = False
        record[_T_START] = ((group.start_ns - self.origin_ns + 500) // 1000) / 1000.0
        if last_end is not None:
            record[_GAP] = ((group.start_ns - last_end + 500) // 1000) / 1000.0
        record[_STEP] = step_us / 1000.0
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

    @staticmethod
    def _comm_fields(record: dict[str, Any], group: _Group, residual_ns: int) -> None:
        total = 0
        # Only the phases that waited (usually Backward): absent means 0 when COMM is present
        # (schema.ZERO_WHEN_MEASURED).
        for phase, ns in (group.comm_ns or {}).items():
            fieldname = _COMM_OF_PHASE.get(phase)
            if fieldname is None or ns <= 0:
                continue
            # A wait is inside its phase: never more than the phase itself (clock edges).
            limit = (
                residual_ns if phase == schema.RESIDUAL else getattr(group, _PHASE_NS[phase]) or 0
            )
            us = (min(ns, limit) + 500) // 1000
            if us:
                total += us
                record[fieldname] = us / 1000.0
        record[_COMM] = total / 1000.0
        if group.comm_count:
            record[_COMM_COUNT] = group.comm_count
        if group.comm_bytes:
            record[_COMM_BYTES] = group.comm_bytes


def rss_reader():
    """A callable returning this process's resident set size in bytes, cheaply.

    Once per step matters: psutil's memory_info() opens and parses /proc/self/status (about
    40 us); one pread of /proc/self/statm on a descriptor kept open costs a few. Falls back to
    psutil where /proc does not exist, and to None when neither works.
    """
    import os

    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        page = os.sysconf("SC_PAGE_SIZE")
        pid = os.getpid()

        def read_statm() -> int | None:
            if os.getpid() != pid:  # a forked child must not read its parent's descriptor
                return None
            return int(os.pread(fd, 128, 0).split()[1]) * page

        read_statm()
        return read_statm
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        memory_info = psutil.Process().memory_info
        return lambda: memory_info().rss
    except Exception:
        return lambda: None
