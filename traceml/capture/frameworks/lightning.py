"""The step-timing callback for ``pytorch_lightning`` (RF-DETR uses it) and ``lightning.pytorch``.

Lightning's automatic-optimization loop, per dataloader batch (``loops/training_epoch_loop.py``,
``loops/optimization/automatic.py``, ``plugins/precision/precision.py`` in Lightning 2.x):

    next(data_fetcher)                 -> Input Wait   (a door on the fetcher's class)
    strategy.batch_to_device(batch)    -> H2D          (timed by an instance-level wrapper)
    on_train_batch_start
    optimizer.step(closure):
        closure: training_step         -> Forward = the traced module's forward (an
                                          instance-level wrapper); loss and matching stay
                                          in Residual
                 zero_grad, strategy.backward (on_before_backward, loss.backward,
                                   on_after_backward)   -> Backward (an instance-level wrapper)
        on_before_optimizer_step, clipping, the update  -> Optimizer, to the return of
                                          strategy.optimizer_step (an instance-level wrapper)
    lr schedulers, every callback's on_train_batch_end  -> Residual
    (the step ends just before the LightningModule's own on_train_batch_end, which Lightning
    calls right after the callbacks': an instance-level wrapper of the module's hook, or,
    where the module cannot be wrapped, this callback's hook, the last callback)

Optimizer opens at traceml's ``on_before_optimizer_step``; with one-door timing (one process,
no CUDA events) where the stepping microbatch's backward ended (``_time_optimizer_from_backward``).

Sanity checks and validation run through other loops and are never timed: every boundary is
only honoured while a training microbatch is open.

Who does what: ``lightning_attach`` gives the first training fit of the process this callback,
which translates Lightning's hooks into boundaries of a :class:`~traceml.capture.session.Session`
(the clock, the parts, the rank file); ``lightning_instruments`` installs the doors.
Every hook and instrument callback is a guarded entry point (``traceml.capture.guard``) or
catches its own failures as one (``step_events.step_end_door``): a failure inside traceml
turns tracing off with one warning and never reaches the user.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

from traceml import schema
from traceml.capture.class_doors import door_on_class
from traceml.capture.clock import clock_ns
from traceml.capture.guard import entry_point
from traceml.capture.lifecycle import DONE, FINAL, IDLE, READY, TRACING
from traceml.capture.run_name import adopt_rank_zero_run_name  # noqa: F401  (older import path)
from traceml.capture.session import Session
from traceml.capture.session_exit import keep_stepped_step
from traceml.capture.session_parts import device_timer_for
from traceml.settings import Settings

from .lightning_facts import loop_facts, rank_info_of, unsupported_configuration
from .lightning_instruments import (
    END_DOOR,
    FETCH_DOOR,
    H2D_DOOR,
    ITERATOR_DOOR,
    STEPPED_DOOR,
    Instruments,
    event_doors,
    progress_counters,
)

# Lightning's tuner runs a fit of its own (Tuner.lr_find / scale_batch_size add one of these
# callbacks with _early_exit=True, then call trainer.fit); that fit is not the user's training.
_TUNER_CALLBACKS = frozenset({"LearningRateFinder", "BatchSizeFinder"})


def _is_tuner_fit(trainer: Any) -> bool:
    return any(
        type(callback).__name__ in _TUNER_CALLBACKS and getattr(callback, "_early_exit", False)
        for callback in getattr(trainer, "callbacks", None) or []
    )


INPUT_FIRST_LOADER = (
    "input pipeline timed for the first DataLoader only: the loop made new ones later "
    "(reload_dataloaders_every_n_epochs), whose workers and samples are not broken down"
)


class StepTiming:
    """Lightning callback body (mixed into each package's ``Callback``; phases: see above)."""

    def __init__(
        self,
        settings: Settings,
        *,
        integration: str = "lightning",
        unsupported_reason: str | None = None,
        notes: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.integration = integration
        self.unsupported_reason = unsupported_reason
        self.notes = list(notes or [])
        self._reset_runtime()

    # Only configuration travels when Lightning pickles the trainer (ddp_spawn).
    def __getstate__(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "integration": self.integration,
            "unsupported_reason": self.unsupported_reason,
            "notes": self.notes,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self.session = Session(self.settings, integration=self.integration, notes=self.notes)
        self.own_cost_ns = 0  # time inside this callback's entry points (the guard adds to it)
        self.session.cost_owners.append(self)
        self.instruments = Instruments(self)
        self._counters: tuple[Any, Any] | None = None
        self._validation_ns: int | None = None
        self._batch_ended = self.session.batch_ended  # or, with one-door timing, the replay's
        self.session.add_undo(self.instruments.remove)
        self.session.add_undo(self._per_step_hooks_off)
        self.pid = os.getpid()

    _PER_STEP_HOOKS = ("on_before_optimizer_step", "on_train_batch_end")  # None once it stops
    # Lightning dispatches every callback's hooks (a profiler context and a call, ~2 us) but
    # skips a non-callable attribute (trainer/call.py): per-batch hooks not needed are None.
    on_train_batch_start = None
    on_before_zero_grad = None
    on_before_backward = None  # backward: timed by a wrapper of the strategy's (instruments)
    on_after_backward = None
    on_validation_batch_start = None
    on_validation_batch_end = None
    on_test_batch_start = None
    on_test_batch_end = None
    on_predict_batch_start = None
    on_predict_batch_end = None

    @property
    def state_key(self) -> str:
        return "traceml.StepTiming"

    def _entry_failed(self, name: str, exc: BaseException) -> None:
        self.session._entry_failed(name, exc)

    # -- Lightning hooks -------------------------------------------------------------------

    @entry_point("lightning.setup", "Lightning's setup hook (fit)")
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.session.life.state is not IDLE:
            return
        if _is_tuner_fit(trainer):
            return  # the tuner's own fit: stay idle for the training that follows
        session = self.session
        session.device = getattr(pl_module, "device", None)
        reason = self.unsupported_reason or unsupported_configuration(trainer, pl_module)
        if session.open(rank_info_of(trainer), reason):
            self._prepare_input_timing(trainer)

    @entry_point("lightning.on_train_start", "Lightning's on_train_start hook")
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        began = clock_ns()
        if self.session.life.state is not READY:
            if self.session.life.state in FINAL:  # unsupported or disabled at setup
                self._per_step_hooks_off()
            return
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if fetcher is None:
            raise RuntimeError("the training loop has no data fetcher")
        if type(fetcher).__name__ == "_DataLoaderIterDataFetcher":
            self.session.mark_unsupported("a training_step that takes dataloader_iter")
            self._per_step_hooks_off()
            return
        for hook in self._PER_STEP_HOOKS:  # the class's again: a Tuner fit's end hid them
            self.__dict__.pop(hook, None)
        self.session.start(
            getattr(pl_module, "device", None),
            loop_facts(trainer),
            gpu=self._device_timer(pl_module),
            ddp_model=getattr(trainer.strategy, "model", None),
        )
        self.instruments.install(trainer, pl_module, fetcher)
        self._counters = progress_counters(trainer)
        if self.session.replay is not None:  # one-door timing: a frame less a step
            self._batch_ended = self.session.replay.step_ended
        self._time_optimizer_from_backward(trainer)
        self._end_steps_before_module_hook(trainer, pl_module)
        self._install_input_timing(trainer)
        if self.instruments.one_door and self.session.input_timing is not None:
            self.session.input_timing.log_events(self.session)
        # The set-up (this hook, the fit's setup) is paid once: no step's traceml_us (a
        # one-step fast_dev_run reported it as 280% of its step).
        self.session.costs_reported(self.session.cost_ns() + clock_ns() - began)

    def _time_optimizer_from_backward(self, trainer: Any) -> None:
        """With one-door timing, no ``on_before_optimizer_step`` (its dispatch was ~12% of the
        stress loop's cost): the optimizer window opens where the backward ended (holding the
        closure's return, every such hook and the clipping); the step's wrapper closes it."""
        if not self.instruments.one_door:
            return
        self.session.clock.optimizer_from_backward = True
        # An attribute that is not callable: Lightning skips the hook (trainer/call.py).
        self.on_before_optimizer_step = None

    def _end_steps_before_module_hook(self, trainer: Any, pl_module: Any) -> None:
        """The step ends just before the module's ``on_train_batch_end``, after every callback."""
        if self.session.replay is not None and self._counters is not None:  # one-door timing
            ended = self.session.replay.step_end_door(*self._counters)  # one frame, no guard
        else:  # bound before the attribute hides it; no module: its __dict__ holds the wrapper
            ended = partial(self.on_train_batch_end, trainer, None)
        if self.instruments.end_steps_before_module_hook(pl_module, ended):
            self.on_train_batch_end = None  # not callable: Lightning skips it (trainer/call.py)

    def _per_step_hooks_off(self) -> None:
        """A final state (limit, failure, end, unsupported) is for good: skip these hooks."""
        for hook in self._PER_STEP_HOOKS:
            setattr(self, hook, None)

    @entry_point("lightning.on_train_epoch_start", "Lightning's on_train_epoch_start hook")
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        # reload_dataloaders_every_n_epochs gives the loop a new fetcher: time that one.
        if self.session.life.state is TRACING:
            fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
            if fetcher is not None and fetcher is not self.instruments.fetcher:
                self.instruments.instrument_fetcher(fetcher)
            timing = self.session.input_timing
            combined = getattr(trainer.fit_loop, "_combined_loader", None)
            if timing is not None and timing.loader not in getattr(combined, "flattened", ()):
                self.session.note("info", schema.EVENT_NOTE, INPUT_FIRST_LOADER)

    # Validation inside an accumulation window (val_check_interval not a multiple of
    # accumulate_grad_batches) runs between two microbatches of one step: taken out of it.
    @entry_point("lightning.on_validation_start", "Lightning's on_validation_start hook")
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._validation_ns = clock_ns() if self.session.life.state is TRACING else None

    @entry_point("lightning.on_validation_end", "Lightning's on_validation_end hook")
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        start, self._validation_ns = self._validation_ns, None
        if start is not None and self.session.life.state is TRACING:
            self.session.settle()  # the clock current (one-door timing replays on the flusher)
            self.session.clock.paused(start, clock_ns())

    @entry_point(
        "lightning.on_before_optimizer_step", "Lightning's on_before_optimizer_step", per_step=True
    )
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.session.optimizer_started()

    @entry_point(STEPPED_DOOR, "after the strategy's optimizer step", per_step=True)
    def optimizer_stepped(self) -> None:
        self.session.optimizer_ended()

    # Just before the module's on_train_batch_end (_end_steps_before_module_hook; one-door timing
    # calls the replay's step_end_door there instead), else as a callback hook. It takes the
    # sampler's queue (telemetry.collect, once a second), whose own_cost_ns is not in traceml_us.
    @entry_point(
        END_DOOR,
        "Lightning's on_train_batch_end (just before the module's hook, or this callback's)",
        per_step=True,
    )
    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        counters = self._counters  # progress_counters: what trainer.global_step reads
        if counters is None:
            self._batch_ended(trainer.global_step, trainer.current_epoch)
        else:
            self._batch_ended(counters[0].completed, counters[1].completed)

    @entry_point("lightning.on_train_epoch_end", "Lightning's on_train_epoch_end hook")
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        step, epoch = getattr(trainer, "global_step", None), getattr(trainer, "current_epoch", None)
        self.session.epoch_ended(step, epoch)
        self.instruments.release_fetcher()

    @entry_point("lightning.on_train_end", "Lightning's on_train_end hook")
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.train_ended(getattr(trainer, "current_epoch", None))

    @entry_point("lightning.on_exception", "Lightning's on_exception hook")
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # A step whose optimizer stepped is kept (a callback's on_train_batch_end raised), where
        # Lightning counted that step (an optimizer_step override that raised after the
        # optimizer's step has not: its step would repeat the last global_step).
        step, epoch, counters = trainer.global_step, trainer.current_epoch, self._counters
        if counters is None or counters[0].ready == counters[0].completed:
            keep_stepped_step(self.session, lambda: self._batch_ended(step, epoch))
        self.session.failed(exception)

    @entry_point("lightning.teardown", "Lightning's teardown hook (fit)")
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Or any stage once training ended: a test in on_fit_end (RF-DETR's run_test=True)
        # leaves the fit torn down as stage "test" (the session stayed open: "interrupted").
        if stage == "fit" or self.session.life.state is DONE:
            self.session.close()

    # -- instrument callbacks (traceml's side of the fetch, transfer, backward, forward) --

    @entry_point(ITERATOR_DOOR, "the training DataLoader iterator being created")
    def iterator_created(self, start: int, end: int) -> None:
        self.session.iterator_created(start, end)

    @entry_point(FETCH_DOOR, "each batch fetched from the training DataLoader", per_step=True)
    def fetched(self, start: int, end: int) -> None:
        self.session.fetched(start, end)

    @entry_point("lightning.batch_to_device", "before the strategy's batch transfer", per_step=True)
    def transfer_started(self) -> int | None:
        return self.session.transfer_started()

    def needs_start_doors(self) -> bool:
        """A door before the transfer and the forward too (CUDA events, collectives)."""
        return self.session.needs_start_doors()

    @entry_point(H2D_DOOR, "after the strategy's batch transfer", per_step=True)
    def transferred(self, start: int) -> None:
        self.session.transferred(start)

    # Not per_step: the comm timer's own doors run inside these two (DDP's bucket timing).
    @entry_point("lightning.backward_started", "before the strategy's backward")
    def backward_started(self) -> None:
        self.session.backward_started()

    @entry_point("lightning.backward_ended", "after the strategy's backward")
    def backward_ended(self) -> None:
        self.session.backward_ended()

    @entry_point("lightning.forward_started", "before the traced module's forward", per_step=True)
    def forward_started(self) -> None:
        self.session.forward_started()

    @entry_point("lightning.forward_ended", "after the traced module's forward", per_step=True)
    def forward_ended(self) -> None:
        self.session.forward_ended()

    def event_doors(self) -> Any:
        """One-door timing's event log (``event_doors``)."""
        return event_doors(self.session)

    # -- set-up ----------------------------------------------------------------------------

    def _device_timer(self, pl_module: Any) -> Any:
        """CUDA events for device-side phase times, on a CUDA device (else None)."""
        return device_timer_for(getattr(pl_module, "device", None))

    def _prepare_input_timing(self, trainer: Any) -> None:
        """Lightning 2.x makes the first epoch's iterator (forks its workers) before
        ``on_train_start``: the timing goes in once the loader is final (a door on the fit
        loop's ``_load_combined_loader_states``, on its class: see ``class_doors``)."""
        fit_loop = trainer.fit_loop
        if getattr(fit_loop, "_load_combined_loader_states", None) is None:
            return  # another Lightning: installed at on_train_start (first epoch untimed)

        def make(original: Any, target: Any) -> Any:
            def load_states_then_time_input(loop: Any, *args: Any, **kwargs: Any) -> Any:
                result = original(loop, *args, **kwargs)
                if loop is target.obj:
                    self._install_input_timing(trainer)
                return result

            return load_states_then_time_input

        self.instruments.add_undo(door_on_class(fit_loop, "_load_combined_loader_states", make))

    @entry_point("dataloader.install", "the training DataLoader, before its iterator exists")
    def _install_input_timing(self, trainer: Any) -> None:
        """Time the training DataLoader's workers (traceml.capture.instruments.dataloader). Workers
        are forked when the epoch's iterator is created, after this: they inherit it."""
        from traceml.capture.instruments.dataloader import install_input_timing

        session = self.session
        if session.input_timing is not None or session.life.state not in (READY, TRACING):
            return
        combined = getattr(trainer.fit_loop, "_combined_loader", None)
        loaders = getattr(combined, "flattened", None) or [trainer.train_dataloader]
        timing, reason = install_input_timing(loaders[0] if len(loaders) == 1 else None, session)
        if timing is None:
            session.note("info", schema.EVENT_NOTE, f"input pipeline not timed: {reason}")
            return
        session.use_input_timing(timing)
