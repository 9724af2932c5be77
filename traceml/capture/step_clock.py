"""The phase clock: boundary timestamps in, one step record per optimizer update out.

Pure Python over ``time.perf_counter_ns`` integers the caller passes in (tests are exact). The
callback says where each phase begins and ends; the clock groups one accumulation window's
microbatches into one step, whose Residual is what no phase explains: they add up.

A step spans from the training DataLoader fetch of its first microbatch (or, at an epoch's
start, from the creation of the DataLoader iterator) to ``on_train_batch_end`` of its last
microbatch. Time between steps (validation, checkpointing, epoch ends) is reported as the next
step's ``gap_ms``, never inside a step.

A step ends as a :class:`~traceml.capture.closed_step.ClosedStep` (``batch_closed``): raw
integers, whose record the flusher builds off the training thread (``batch_ended``: at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from traceml import schema
from traceml.capture.closed_step import ClosedStep, Group
from traceml.step_record import StepRecord
from traceml.step_rows import usual_record

NS_PER_MS = 1_000_000


def ns_to_ms(value: int | None) -> float | None:
    return None if value is None else value / NS_PER_MS


class _Microbatch:
    """One microbatch's open phases. Defaults are class attributes, no ``__init__``: one is
    made at every fetch (see ``Group``)."""

    forward_depth: int = 0
    forward_start_ns: int = 0
    backward_start_ns: int | None = None
    backward_open: bool = False
    in_h2d: bool = False
    # The optimizer window: from the optimizer hook (or, with the clock's
    # optimizer_from_backward, the end of the microbatch's first backward) to the optimizer
    # step's return where an adapter reports it (``optimizer_ended``), else the batch's end.
    optimizer_start_ns: int | None = None
    optimizer_end_ns: int | None = None
    # Forward/backward time inside the optimizer window: an optimizer whose step runs the
    # closure again (LBFGS) re-evaluates the model there; that is Forward/Backward, not
    # Optimizer, and is taken out of the optimizer window.
    nested_ns: int = 0


@dataclass
class StepClock:
    origin_ns: int
    _group: Group | None = None
    _micro: _Microbatch | None = None
    _pending_iter: tuple[int, int] | None = None
    _last_end_ns: int | None = None
    steps_emitted: int = 0
    overlaps: int = 0
    # True in a distributed run whose collectives are timed: comm fields are then numbers
    # (0 when a step had no collective), otherwise null (unmeasured).
    comm_enabled: bool = False
    # No optimizer hook (one-door timing): a microbatch's optimizer window opens at the end of
    # its first backward, and only ``optimizer_ended`` says that the microbatch stepped.
    optimizer_from_backward: bool = False

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

    def fetched(self, start_ns: int | None, end_ns: int) -> None:
        """The training loop got a batch from its DataLoader: a microbatch begins. ``start_ns``
        None: from no timed loader (:meth:`fetch_unmeasured`)."""
        if start_ns is None:
            self.fetch_unmeasured(end_ns)
            return
        input_ns = end_ns - start_ns
        window_start = start_ns
        if self._pending_iter is not None:
            iter_start, iter_end = self._pending_iter
            self._pending_iter = None
            input_ns += iter_end - iter_start
            window_start = iter_start
        group = self._group
        if group is None:
            group = self._group = Group(window_start)
        group.input_ns = (group.input_ns or 0) + input_ns
        group.phase_end_ns = end_ns
        self._micro = _Microbatch()

    def fetch_unmeasured(self, now_ns: int) -> None:
        """A microbatch begins whose batch came from no timed DataLoader: its step's Input
        Wait is unmeasured (null), unless another of its microbatches measured one."""
        group = self._group
        if group is None:
            group = self._group = Group(now_ns)
            group.input_ns = None
        group.phase_end_ns = now_ns
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

    def forward_started(self, now_ns: int) -> bool:
        """True when this opened Forward (not nested, not inside backward)."""
        micro = self._micro
        # A forward run by autograd during backward (activation checkpointing recomputes
        # segments) belongs to Backward.
        if micro is None or micro.backward_open:
            return False
        micro.forward_depth += 1
        if micro.forward_depth == 1:
            micro.forward_start_ns = now_ns
            return True
        return False

    def forward_ended(self, now_ns: int) -> bool:
        """True when this closed Forward (the outermost call returned)."""
        micro, group = self._micro, self._group
        if micro is None or group is None or micro.forward_depth == 0:
            return False
        micro.forward_depth -= 1
        if micro.forward_depth == 0:
            elapsed = now_ns - micro.forward_start_ns
            group.forward_ns = (group.forward_ns or 0) + elapsed
            group.phase_end_ns = now_ns
            if micro.optimizer_start_ns is not None and micro.optimizer_end_ns is None:
                micro.nested_ns += elapsed
            return True
        return False

    def forward_timed(self, start_ns: int, end_ns: int) -> None:
        """One forward, timed by one door after it (``forward_started`` and ``forward_ended``
        in one; the caller counts nested calls itself)."""
        micro, group = self._micro, self._group
        # (The one-door wrappers keep recomputations inside backward and nested calls away;
        # the checks matter only if both timings were ever mixed.)
        if micro is None or group is None or micro.backward_open or micro.forward_depth:
            return
        elapsed = end_ns - start_ns
        group.forward_ns = (group.forward_ns or 0) + elapsed
        group.phase_end_ns = end_ns
        if micro.optimizer_start_ns is not None and micro.optimizer_end_ns is None:
            micro.nested_ns += elapsed

    def backward_timed(self, start_ns: int, end_ns: int) -> None:
        """One backward, timed by one door after it (the caller counts nested calls and keeps
        the forwards it runs out of Forward itself)."""
        micro, group = self._micro, self._group
        if micro is None or group is None or micro.backward_open:
            return
        elapsed = end_ns - start_ns
        group.backward_ns = (group.backward_ns or 0) + elapsed
        group.phase_end_ns = end_ns
        if micro.optimizer_start_ns is not None:
            if micro.optimizer_end_ns is None:
                micro.nested_ns += elapsed
        elif self.optimizer_from_backward:
            micro.optimizer_start_ns = end_ns  # the window, if this microbatch steps

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
        group.phase_end_ns = now_ns
        if micro.optimizer_start_ns is not None and micro.optimizer_end_ns is None:
            micro.nested_ns += elapsed

    def optimizer_started(self, now_ns: int) -> None:
        # Once per microbatch: a closure re-run inside the step (LBFGS) calls the hook again.
        if self._micro is not None and self._micro.optimizer_start_ns is None:
            self._micro.optimizer_start_ns = now_ns

    def optimizer_ended(self, now_ns: int) -> None:
        """The optimizer step returned (the update is done): the window closes here, and what
        follows until the batch's end (lr schedulers, batch-end callbacks) is Residual."""
        if self._micro is not None:
            self._micro.optimizer_end_ns = now_ns

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
        if micro.optimizer_start_ns is not None and micro.optimizer_end_ns is None:
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
        """``on_train_batch_end``: the step record when this microbatch stepped the optimizer
        (the end of an accumulation window), else None."""
        closed = self.batch_closed(now_ns, global_step, epoch)
        return None if closed is None else closed.record()

    def epoch_ended(
        self, now_ns: int, global_step: int | None = None, epoch: int | None = None
    ) -> dict[str, Any] | None:
        """Flush microbatches that never reached an optimizer step (nothing is dropped)."""
        closed = self.epoch_closed(now_ns, global_step, epoch)
        return None if closed is None else closed.record()

    def batch_closed(
        self, now_ns: int, global_step: int | None = None, epoch: int | None = None
    ) -> ClosedStep | None:
        """:meth:`batch_ended` without building the record (the session's hot path: the
        sink's flusher builds it, ``closed_step``). With ``optimizer_from_backward`` only
        :meth:`optimizer_ended` says the microbatch stepped; a step with no timed backward
        then has Optimizer null (unmeasured), its time in Residual."""
        micro, group = self._micro, self._group
        self._micro = None
        if micro is None or group is None:
            return None
        group.microbatches += 1
        group.phase_end_ns = now_ns  # where a group left without a step ends (epoch_closed)
        start, end = micro.optimizer_start_ns, micro.optimizer_end_ns
        if self.optimizer_from_backward:
            if end is None:
                return None  # the backward's end opened no window: no optimizer step
            if start is None:
                return self._close(now_ns, True, global_step, epoch)
        elif start is None:
            return None
        window = (now_ns if end is None else end) - start - micro.nested_ns
        if window < 0:
            window = 0
        group.optimizer_ns = (group.optimizer_ns or 0) + window
        return self._close(now_ns, True, global_step, epoch)

    def usual_record(
        self,
        fetch: tuple[Any, int, int],
        h2d: tuple[Any, int, int],
        forward: tuple[Any, int, int],
        backward: tuple[Any, int, int],
        stepped: tuple[Any, int],
        now_ns: int,
        global_step: int | None,
        epoch: int | None,
    ) -> StepRecord | None:
        """The usual one-door microbatch in one call, its record at once: ``fetched``,
        ``transferred``, ``forward_timed``, ``backward_timed``, ``optimizer_ended``,
        :meth:`batch_closed` and the closed step's record (``step_rows.usual_record``), each
        phase an event ``(name, start, end)`` (the optimizer's ``(name, end)``), the same
        arithmetic on the same integers (a unit test holds the two paths equal), without a
        closed step in between. None where not :meth:`usual_ready` or the record is not the
        usual one (the first step, comm fields): the caller makes the calls one by one."""
        last_end = self._last_end_ns
        if global_step is None or epoch is None or not self.usual_ready():
            return None
        index = self.steps_emitted
        self.steps_emitted = index + 1
        self._last_end_ns = now_ns
        start = fetch[1]
        backward_end = backward[2]
        optimizer = stepped[1] - backward_end  # the window opened at the backward's end
        return usual_record(
            self,
            index,
            global_step,
            epoch,
            start,
            now_ns,
            last_end,
            fetch[2] - start,
            h2d[2] - h2d[1],
            forward[2] - forward[1],
            backward_end - backward[1],
            optimizer if optimizer > 0 else 0,
        )

    def usual_ready(self) -> bool:
        """Whether the usual step's record may be made from its events alone (a state that
        the usual step leaves as it found it)."""
        return (
            self._last_end_ns is not None
            and self._group is None
            and self._micro is None
            and self._pending_iter is None
            and not self.comm_enabled
            and self.optimizer_from_backward
        )

    def rows_closed(self, count: int, last_end_ns: int) -> tuple[int, int]:
        """``count`` usual steps closed at once (written as a rows line, ``step_rows``), the
        last ending at ``last_end_ns``: the first one's index, the end of the step before."""
        index, before = self.steps_emitted, self._last_end_ns
        self.steps_emitted = index + count
        self._last_end_ns = last_end_ns
        return index, before  # type: ignore[return-value]

    def paused(self, start_ns: int, end_ns: int) -> None:
        """Not the step's work between two of its microbatches (validation inside an accumulation
        window): the step starts that much later, the time is its gap; so do its phases end
        where they ended before it (where a window closed unstepped ends: epoch_closed)."""
        group, pause = self._group, end_ns - start_ns
        if group is not None and self._micro is None and pause > 0:
            group.start_ns += pause
            if group.phase_end_ns is not None and group.phase_end_ns <= start_ns:
                group.phase_end_ns += pause

    def epoch_closed(
        self, now_ns: int, global_step: int | None = None, epoch: int | None = None
    ) -> ClosedStep | None:
        """:meth:`epoch_ended` without building the record. The open microbatch counts (an
        adapter with no batch-end event learns of the epoch's end before closing it); the
        group ends where its last timed phase did, if one was, so that what came after it
        (validation) is the next step's gap, not this group's Residual."""
        micro, self._micro = self._micro, None
        self._pending_iter = None
        group = self._group
        if group is not None and micro is not None:
            group.microbatches += 1
        if group is None or group.microbatches == 0 or group.untrained:
            self._group = None  # (a fetch only: a loop that broke out of its epoch after it)
            return None
        end = group.phase_end_ns
        return self._close(now_ns if end is None else end, False, global_step, epoch)

    def abandon(self) -> None:
        """Training stopped mid-step (exception, interrupt): the open step is not a step."""
        self._group = None
        self._micro = None
        self._pending_iter = None

    def _close(
        self, end_ns: int, optimizer_stepped: bool, global_step: int | None, epoch: int | None
    ) -> ClosedStep:
        group = self._group
        assert group is not None
        self._group = None
        last_end, self._last_end_ns = self._last_end_ns, end_ns
        index = self.steps_emitted
        self.steps_emitted = index + 1
        # The group becomes the closed step (closed_step.Group): no object of its own.
        group.clock = self
        group.end_ns = end_ns
        group.last_end_ns = last_end
        group.optimizer_stepped = optimizer_stepped
        group.global_step = global_step
        group.epoch = epoch
        group.index = index
        group.extra = {}
        return group
