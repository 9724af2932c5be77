"""One traced training on one rank, framework-free: what every adapter drives. An adapter
(the Lightning callback, the generic torch-loop capture, the Hugging Face Trainer callback)
knows *when* a phase begins and ends; the session knows what to do about it: the step clock
(``step_clock``), the device timer (``cuda_timing``), the comm timer
(``instruments.distributed``), telemetry, worker-side input timing, and the rank file
(``recorder``). Its parts are typed in ``session_parts``.

Lifecycle (``lifecycle``): :meth:`open` (READY), :meth:`start` (TRACING), the boundaries
(plain, cheap methods), then :meth:`train_ended`, :meth:`failed` or :meth:`finish_at_exit`.
The adapter's hooks are the guarded entry points (``guard``); their failures reach
:meth:`disable` through the adapter.
"""

from __future__ import annotations

import os
import time
from contextlib import suppress
from operator import attrgetter
from typing import Any

from traceml import console, schema
from traceml.capture.clock import clock_ns
from traceml.capture.lifecycle import DISABLED, DONE, IDLE, TRACING, UNSUPPORTED, Lifecycle
from traceml.capture.recorder import RankRecorder
from traceml.capture.rss import RSS_EVERY_NS
from traceml.capture.session_exit import drain_device, finish_at_exit, finish_file
from traceml.capture.session_parts import (
    CommTiming,
    CostOwner,
    DeviceTimer,
    InputTimingSource,
    PhaseClock,
    TelemetrySource,
    Undo,
)
from traceml.capture.undo import undo_all
from traceml.settings import Settings
from traceml.step_record import STEP_KEYS

# A step record's own keys (rank schema 2.0).
_RSS_KEY = STEP_KEYS[schema.RSS]
_COST_KEY = STEP_KEYS[schema.TRACEML_COST_US]
_OWN_COST = attrgetter("own_cost_ns")


class Session:
    def __init__(
        self,
        settings: Settings,
        *,
        integration: str,
        notes: list[dict[str, Any]] | None = None,
    ) -> None:
        self.settings = settings
        self.integration = integration
        self.notes = list(notes or [])
        self.life = Lifecycle()
        self.recorder: RankRecorder | None = None
        self.clock: PhaseClock | None = None
        self.gpu: DeviceTimer | None = None
        self.comm: CommTiming | None = None
        self.telemetry: TelemetrySource | None = None
        self.input_timing: InputTimingSource | None = None
        self.rank_info: dict[str, Any] = {}
        self.pid = os.getpid()
        self.device: Any = None
        self.header_extra: dict[str, Any] = {}
        self.own_cost_ns = 0
        # Every part whose entry points cost this process time: the adapters, the comm and
        # input timing once attached (summed by cost_ns).
        self.cost_owners: list[CostOwner] = [self]
        self._cost_reported_ns = 0
        self._clock_origin_unix = time.time()
        self._rss: Any = None
        self.rss_next_ns = 0  # when RSS is next read (rss_due)
        self._disabled_warned = False
        self._undo: list[Undo] = []
        # A loop with no end event (any-loop capture): the process's exit ends the training,
        # 'completed' unless an exception ended the script.
        self.ends_at_exit = False
        self.before_finish: list[Undo] = []  # adapters' last notes, before the footer
        # One-door timing's event log (step_events): the doors' deque.append, its replay.
        self.event_log = self.replay = None

    # -- set-up ----------------------------------------------------------------------------

    def open(self, rank_info: dict[str, Any], unsupported_reason: str | None = None) -> bool:
        """Create the rank file (READY), or name the unsupported setup; True when READY."""
        from traceml.capture.session_start import open_session

        return open_session(self, rank_info, unsupported_reason)

    def mark_unsupported(self, reason: str) -> None:
        from traceml.capture.session_start import mark_unsupported

        mark_unsupported(self, reason)

    def start(
        self,
        device: Any,
        loop_facts: dict[str, Any],
        *,
        gpu: DeviceTimer | None = None,
        ddp_model: Any = None,
        origin_ns: int | None = None,
    ) -> None:
        """READY -> TRACING: the clock starts (at ``origin_ns``, a boundary already seen, or
        now), the parts are installed, the header is written."""
        from traceml.capture.session_start import start_session

        start_session(self, device, loop_facts, gpu, ddp_model, origin_ns)

    def use_input_timing(self, timing: InputTimingSource) -> None:
        self.input_timing = timing
        self.cost_owners.append(timing)  # num_workers=0: its doors run in this process
        self.add_undo(timing.uninstall)

    def add_undo(self, undo: Undo) -> None:
        self._undo.append(undo)

    def log_events(self, doors: dict[str, Any], end_door: str, usual: Any = None) -> Any:
        """One-door timing's event log, ``list.append`` of ``(name, *fields)`` (step_events)."""
        from traceml.capture.step_events import EventReplay

        self.replay = EventReplay(self, doors, end_door, self.recorder.sink, usual)
        self.event_log = self.replay.log
        return self.event_log

    def settle(self) -> None:
        """Replay every door event logged so far (the clock current). Never on the flusher."""
        if self.replay is not None and self.recorder is not None:
            self.replay.settle()

    def note(self, level: str, code: str, message: str) -> None:
        if self.recorder is not None:
            self.settle()
            self.recorder.event(level, code, message)

    # -- boundaries (the adapter checked nothing; each method checks the state) -------------

    def iterator_created(self, start: int, end: int) -> None:
        if self.life.state is TRACING:
            self.clock.iterator_created(start, end)

    def fetched(self, start: int | None, end: int) -> None:
        if self.life.state is not TRACING:
            return
        starts_step = self.gpu is not None and not self.clock.in_step  # no call without a device
        self.clock.fetched(start, end)
        if starts_step:
            self.gpu.step_started()

    def transfer_started(self) -> int | None:
        if self.life.state is not TRACING or not self.clock.in_microbatch:
            return None
        self.clock.transfer_started()
        if self.gpu is not None:
            self.gpu.phase_started("h2d")
        return clock_ns()

    def transferred(self, start: int) -> None:
        end = clock_ns()
        if self.life.state is not TRACING:
            return
        if self.gpu is not None:
            self.gpu.phase_ended("h2d")
        self.clock.transferred(start, end)

    def forward_started(self) -> None:
        # The device's Forward only where the host's opens (not nested, not in backward).
        if self.life.state is not TRACING or not self.clock.in_microbatch:
            return
        if self.clock.forward_started(clock_ns()) and self.gpu is not None:
            self.gpu.phase_started("forward")

    def forward_ended(self) -> None:
        if self.life.state is not TRACING or not self.clock.in_microbatch:
            return
        if self.clock.forward_ended(clock_ns()) and self.gpu is not None:
            self.gpu.phase_ended("forward")

    def needs_start_doors(self) -> bool:
        """A door at a phase's start too (a CUDA event to record, collectives to place in it);
        else an adapter may time a wrapped call by one door after it, straight into the clock
        (the Lightning callback's ``direct_doors``)."""
        return self.gpu is not None or self.comm is not None

    def backward_started(self) -> None:
        if self.life.state is TRACING and self.clock.in_microbatch:
            if self.comm is not None:
                self.comm.backward_started()
            self.clock.backward_started(clock_ns())
            if self.gpu is not None:
                self.gpu.phase_started("backward")

    def backward_ended(self) -> None:
        if self.life.state is TRACING and self.clock.in_microbatch:
            if self.comm is not None:
                self.comm.backward_finished()
            if self.gpu is not None:
                self.gpu.phase_ended("backward")
            self.clock.backward_ended(clock_ns())

    def optimizer_ended(self) -> None:
        """The optimizer step returned: Optimizer ends here, not at the batch's end."""
        if self.life.state is TRACING:
            self.clock.optimizer_ended(clock_ns())
            if self.gpu is not None:
                self.gpu.phase_ended("optimizer")

    def optimizer_started(self) -> None:
        if self.life.state is TRACING and self.clock.in_microbatch:
            self.clock.optimizer_started(clock_ns())
            if self.gpu is not None:
                self.gpu.phase_started("optimizer")

    def batch_ended(self, global_step: Any = None, epoch: Any = None) -> None:
        """A microbatch ended; it writes the step when it stepped the optimizer."""
        if self.event_log is not None:  # the flusher closes the step (step_events)
            self.replay.step_ended(global_step, epoch)
        elif self.life.state is TRACING:  # no microbatch open: the clock returns None
            now = clock_ns()
            closed = self.clock.batch_closed(now, global_step, epoch)
            if closed is not None:
                self._emit(closed, now)

    def epoch_ended(self, global_step: Any = None, epoch: Any = None) -> None:
        """Flush microbatches that never reached an optimizer step; the epoch's input record."""
        if self.life.state is TRACING:
            self.settle()  # which may find a failure or the step limit: tracing stopped
        if self.life.state is TRACING:
            now = clock_ns()
            had, closed = self.clock.in_step, self.clock.epoch_closed(now, global_step, epoch)
            if closed is not None:
                self._emit(closed, now)
            elif had:  # a fetch-only window, no step: its device step goes too (cuda_timing)
                self.abandon_step()
            self.write_input_record(epoch)

    def abandon_step(self) -> None:
        """The open step is not a step (an exception the training recovered from)."""
        self.settle()
        if self.clock is not None:
            self.clock.abandon()
        if self.gpu is not None:
            self.gpu.abandon_step()

    def write_input_record(self, epoch: Any) -> None:
        """Once per epoch: what the workers made since the last record (low rate)."""
        if self.input_timing is None or self.recorder is None or not self.recorder.is_open:
            return
        record = self.input_timing.epoch_record(epoch)
        if record is not None:
            self.recorder.sink.write(record)

    # -- records ---------------------------------------------------------------------------

    def _emit(self, closed: Any, now: int) -> None:
        # ``closed``: a ClosedStep, its record built by the flusher (on the CUDA path, here).
        if self.telemetry is not None and self.telemetry.pending:  # about once a second
            self.recorder.samples(self.telemetry.collect())
        extra = closed.extra
        rss = self.rss_due(now)
        if rss is not None:
            extra[_RSS_KEY] = rss
        extra[_COST_KEY] = self.cost_field(self.cost_ns())
        if self.gpu is not None:
            record = closed.record()
            self.gpu.step_ended(record, not closed.optimizer_stepped)
            for finished in self.gpu.ready():
                self._write_step(finished)
        else:  # _write_step, inlined: the callers checked the state (TRACING) just now
            recorder = self.recorder
            written = recorder.step(closed)
            if not written or recorder.limit_reached:
                self._after_write(recorder, written)

    def rss_due(self, now: int) -> int | None:
        """RSS (a procfs read, ~7 us) at most every RSS_EVERY_NS on short steps (None between;
        ``now < rss_next_ns`` says so without the call)."""
        if self._rss is not None and now >= self.rss_next_ns:
            self.rss_next_ns = now + RSS_EVERY_NS
            return self._rss()
        return None

    def cost_ns(self) -> int:
        """traceml's own time so far, every cost owner's entry points together."""
        return sum(map(_OWN_COST, self.cost_owners))  # no loop of bytecodes: once a step

    def cost_field(self, cost: int) -> float:
        """A step's ``traceml_us``: the cost since the previous step's, in tenths of a us
        (integer arithmetic: round() runs dtoa, evicted from the caches by every step)."""
        field = ((cost - self._cost_reported_ns + 50) // 100) / 10
        self._cost_reported_ns = cost
        return field

    def costs_reported(self, cost: int) -> int:
        """The cost reported so far, now ``cost`` (a rows line's steps report theirs)."""
        before, self._cost_reported_ns = self._cost_reported_ns, cost
        return before

    def _write_step(self, record: Any) -> None:
        recorder = self.recorder
        if recorder is not None and self.life.state in (TRACING, DONE):
            written = recorder.step(record)
            if not written or recorder.limit_reached:
                self._after_write(recorder, written)

    def _after_write(self, recorder: Any, written: bool) -> None:
        """The rank file refused a step, or the step limit was reached."""
        if not written:
            if recorder.bad_record is not None:  # the flusher could not make one: file open
                self.disable(f"a step record could not be made ({recorder.bad_record})")
                return
            self.life.move(DISABLED)  # the sink warned once (full disk, deleted directory...)
            recorder.status = schema.STATUS_DISABLED
            self.remove_instruments()
            return
        if recorder.limit_reached and self.life.state is TRACING:
            self.life.move(DONE)
            self.remove_instruments()
            self._drain()
            note = f"recorded the first {self.settings.trace_max_steps} steps "
            note += "(--trace-max-steps / TRACEML_TRACE_MAX_STEPS); later steps ran untraced"
            recorder.event("info", schema.EVENT_MAX_STEPS, note)

    def _drain(self) -> None:
        """Write the steps still waiting for their CUDA events (end of training only)."""
        drain_device(self)

    def write_header(self, timing: str) -> None:
        from traceml.capture.session_start import write_header

        write_header(self, timing)

    # -- the end ---------------------------------------------------------------------------

    def train_ended(self, epoch: Any = None) -> None:
        """Training finished normally: write what is pending; instruments off."""
        self.settle()
        if self.life.state in (TRACING, DONE):
            self._drain()
            self.write_input_record(epoch)
        self.remove_instruments()
        if self.life.state is TRACING:
            self.life.move(DONE)

    def failed(self, exception: BaseException) -> None:
        """The user's training raised: the open step is dropped, the file says why."""
        self.remove_instruments()
        if self.recorder is None or self.life.state is IDLE:
            return
        self.abandon_step()
        self._drain()
        self.recorder.ended_by(exception)
        self.finish()

    def close(self) -> None:
        """Instruments off, pending steps written, footer (the framework's teardown)."""
        self.remove_instruments()
        if self.recorder is not None and not self.recorder.footer_written:
            self._drain()
            self.finish()

    def finish(self) -> None:
        """Write the footer and close the rank file (once)."""
        finish_file(self)

    def finish_at_exit(self) -> None:
        """Interpreter exit with the file still open: the run ended without its teardown."""
        finish_at_exit(self)

    # -- failure ---------------------------------------------------------------------------

    def _entry_failed(self, name: str, exc: BaseException) -> None:
        self.disable(f"{name} failed ({type(exc).__name__}: {exc})")

    def disable(self, reason: str) -> None:
        """Tracing off for this process: one warning, instruments removed, a note in the file."""
        with suppress(Exception):
            self.settle()  # the steps finished before the failure are written
        self.remove_instruments()
        if self.life.state in (DISABLED, UNSUPPORTED) or self._disabled_warned:
            return
        self._disabled_warned = True
        self.life.move(DISABLED)  # allowed from every state but the final ones
        if self.recorder is not None:
            self.recorder.status = schema.STATUS_DISABLED
        console.warn(f"tracing disabled: {reason}; training continues untraced", all_ranks=True)
        with suppress(Exception):
            if self.recorder is not None and not self.recorder.header_written:
                self.write_header(timing="host")
            if self.recorder is not None:
                self.recorder.event("warning", schema.EVENT_DISABLED, reason)

    def remove_instruments(self) -> None:
        """Take everything installed away (idempotent; each undo runs even if one fails)."""
        undo_all(self._undo)
