"""The step-timing callback for ``pytorch_lightning`` (RF-DETR uses it) and ``lightning.pytorch``.

Lightning's automatic-optimization loop, per dataloader batch (``loops/training_epoch_loop.py``,
``loops/optimization/automatic.py``, ``plugins/precision/precision.py`` in Lightning 2.x):

    next(data_fetcher)                 -> Input Wait   (timed by swapping the fetcher's class)
    strategy.batch_to_device(batch)    -> H2D          (timed by an instance-level wrapper)
    on_train_batch_start
    optimizer.step(closure):
        closure: training_step         -> Forward = the traced module's forward hooks;
                                          loss and matching stay in Residual
                 zero_grad, on_before_backward -> backward -> on_after_backward   -> Backward
        on_before_optimizer_step, clipping, the update                          -> Optimizer
    lr schedulers, on_train_batch_end  (callbacks before this one are in Optimizer)

Sanity checks and validation run through other loops and are never timed: every boundary is
only honoured while a training microbatch is open.

Who does what: this module attaches the callback to the first training fit of the process
(:func:`attach`) and dispatches Lightning's hooks; ``lightning_instruments`` installs the
fetcher / transfer / forward instruments; ``step_clock.StepClock`` turns boundaries into step
records; ``recorder.RankRecorder`` writes them; ``lifecycle`` says which
state the training is in. Every hook and instrument callback is a guarded entry point
(``traceml.capture.guard``): a failure inside traceml turns tracing off with one warning and never
reaches the user.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from typing import Any

from traceml import console, schema
from traceml.capture import step_clock
from traceml.capture.guard import entry_point
from traceml.capture.lifecycle import Lifecycle, State
from traceml.capture.recorder import RankRecorder, build_header
from traceml.settings import Settings

from .lightning_instruments import Instruments, forward_module

clock_ns = time.perf_counter_ns
RSS_EVERY_NS = 10_000_000

_claim_lock = threading.Lock()
_claimed_trainer: weakref.ref | None = None
_warned_second_training = False

# Lightning's tuner runs a fit of its own (Tuner.lr_find / scale_batch_size add one of these
# callbacks with _early_exit=True, then call trainer.fit); that fit is not the user's training.
_TUNER_CALLBACKS = frozenset({"LearningRateFinder", "BatchSizeFinder"})


# ----------------------------------------------------------------------------------------------
# Attaching


def find_traceml_callback(trainer: Any) -> Any | None:
    for callback in getattr(trainer, "callbacks", None) or []:
        if isinstance(callback, StepTiming):
            return callback
    return None


def attach(
    trainer: Any,
    settings: Settings,
    *,
    integration: str = "lightning",
    unsupported_reason: str | None = None,
    notes: list[dict[str, Any]] | None = None,
) -> Any | None:
    """Give ``trainer`` the step callback, unless it has one or another trainer was traced.

    Only the first training trainer of a process is traced: a second ``fit`` in the same
    process (a new experiment) would mix two runs into one rank file.
    """
    global _claimed_trainer, _warned_second_training
    existing = find_traceml_callback(trainer)
    if existing is not None:
        return existing
    with _claim_lock:
        claimed = _claimed_trainer() if _claimed_trainer is not None else None
        if claimed is not None and claimed is not trainer:
            if not _warned_second_training:
                _warned_second_training = True
                console.warn(
                    "a second training in this process is not traced (one run per process)"
                )
            return None
        callback = callback_class_for(trainer)(
            settings,
            integration=integration,
            unsupported_reason=unsupported_reason,
            notes=notes,
        )
        trainer.callbacks.append(callback)
        _claimed_trainer = weakref.ref(trainer)
    return callback


def reset_claim_for_tests() -> None:
    global _claimed_trainer, _warned_second_training
    with _claim_lock:
        _claimed_trainer = None
        _warned_second_training = False


def on_import(module: Any) -> None:
    """Post-import hook for ``pytorch_lightning`` and ``lightning.pytorch``: trace the first
    ``Trainer.fit`` of the process (plain Lightning scripts; RF-DETR attaches earlier)."""
    import wrapt

    trainer_class = module.Trainer
    if getattr(trainer_class.fit, "_traceml_wrapped", False):
        return
    wrapt.wrap_function_wrapper(trainer_class, "fit", _fit_wrapper)
    trainer_class.fit._traceml_wrapped = True


def _fit_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    attach_before_fit(instance)
    return wrapped(*args, **kwargs)


@entry_point(
    "lightning.Trainer.fit", "the Trainer.fit wrapper, before the user's fit", owner_arg=-1
)
def attach_before_fit(trainer: Any) -> None:
    from traceml.capture import bootstrap

    settings = bootstrap.active_settings()
    if settings is None or getattr(trainer, "_traceml_skip", False):
        return
    attach(trainer, settings)


def lightning_package(trainer: Any) -> str:
    """Which Lightning the trainer is from, by the first Lightning class in its MRO (a Trainer
    subclass defined in the user's script has the script's module name)."""
    for klass in type(trainer).__mro__:
        module = klass.__module__ or ""
        if module == "lightning" or module.startswith("lightning."):
            return "lightning.pytorch"
        if module.startswith("pytorch_lightning"):
            return "pytorch_lightning"
    return "pytorch_lightning"


def callback_class_for(trainer: Any) -> type:
    if lightning_package(trainer) == "lightning.pytorch":
        from .callback_lightning import LightningStepCallback

        return LightningStepCallback
    from .callback_pytorch_lightning import PytorchLightningStepCallback

    return PytorchLightningStepCallback


def _is_tuner_fit(trainer: Any) -> bool:
    return any(
        type(callback).__name__ in _TUNER_CALLBACKS and getattr(callback, "_early_exit", False)
        for callback in getattr(trainer, "callbacks", None) or []
    )


# ----------------------------------------------------------------------------------------------
# The callback


class StepTiming:
    """Lightning callback body (mixed into each package's ``Callback``; see the module
    docstring for what each phase covers)."""

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
        self.life = Lifecycle()
        self.recorder: RankRecorder | None = None
        self.clock: step_clock.StepClock | None = None
        self.gpu: Any = None
        self.comm: Any = None  # distributed.CommTimer in a multi-rank run
        self.instruments = Instruments(self)
        self.rank_info: dict[str, Any] = {}
        self.pid = os.getpid()
        self.own_cost_ns = 0  # time inside traceml's entry points (the guard adds to it)
        self._cost_reported_ns = 0
        self._trainer_ref: weakref.ref | None = None
        self._header_extra: dict[str, Any] = {}
        self._clock_origin_unix = time.time()
        self._rss = None
        self._rss_at = 0
        self._disabled_warned = False
        self.telemetry: Any = None  # traceml.capture.telemetry.TelemetrySampler while tracing
        self.input_timing: Any = None  # dataloader.InputTiming: worker-side input timing

    # Lightning dispatches every hook of every callback (a profiler context and a call each,
    # ~2 us) and skips an attribute that is not callable (trainer/call.py). The per-batch hooks
    # this callback has no use for are None, so they cost the training loop nothing.
    on_train_batch_start = None
    on_before_zero_grad = None
    on_validation_batch_start = None
    on_validation_batch_end = None
    on_test_batch_start = None
    on_test_batch_end = None
    on_predict_batch_start = None
    on_predict_batch_end = None

    @property
    def state_key(self) -> str:
        return "traceml.StepTiming"

    @property
    def tracing(self) -> bool:
        return self.life.state is State.TRACING

    # -- failure ---------------------------------------------------------------------------

    def _entry_failed(self, name: str, exc: BaseException) -> None:
        self._disable(f"{name} failed ({type(exc).__name__}: {exc})")

    def _disable(self, reason: str) -> None:
        """Tracing off for this process: one warning, instruments removed, a note in the file."""
        self._remove_instruments()
        if self.life.state in (State.DISABLED, State.UNSUPPORTED) or self._disabled_warned:
            return
        self._disabled_warned = True
        self.life.move(State.DISABLED)  # allowed from every state but the final ones
        if self.recorder is not None:
            self.recorder.status = schema.STATUS_DISABLED
        console.warn(f"tracing disabled: {reason}; training continues untraced", all_ranks=True)
        try:
            self._ensure_header()
            if self.recorder is not None:
                self.recorder.event("warning", schema.EVENT_DISABLED, reason)
        except Exception:
            pass

    # -- Lightning hooks -------------------------------------------------------------------

    @entry_point("lightning.setup", "Lightning's setup hook (fit)")
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.life.state is not State.IDLE:
            return
        if _is_tuner_fit(trainer):
            return  # the tuner's own fit: stay idle for the training that follows
        self._setup(trainer, pl_module)
        if self.life.state is State.READY:
            self._prepare_input_timing(trainer)

    @entry_point("lightning.on_train_start", "Lightning's on_train_start hook")
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.life.state is State.READY:
            self._start(trainer, pl_module)

    @entry_point("lightning.on_train_epoch_start", "Lightning's on_train_epoch_start hook")
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        # reload_dataloaders_every_n_epochs gives the loop a new fetcher: time that one.
        if self.life.state is State.TRACING:
            fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
            if fetcher is not None and fetcher is not self.instruments.fetcher:
                self.instruments.instrument_fetcher(fetcher)

    @entry_point("lightning.on_before_backward", "Lightning's on_before_backward hook")
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.life.state is State.TRACING and self.clock.in_microbatch:
            if self.comm is not None:
                self.comm.backward_started()
            self.clock.backward_started(clock_ns())
            if self.gpu is not None:
                self.gpu.phase_started("backward")

    @entry_point("lightning.on_after_backward", "Lightning's on_after_backward hook")
    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if self.life.state is State.TRACING and self.clock.in_microbatch:
            if self.comm is not None:
                self.comm.backward_finished()
            if self.gpu is not None:
                self.gpu.phase_ended("backward")
            self.clock.backward_ended(clock_ns())

    @entry_point("lightning.on_before_optimizer_step", "Lightning's on_before_optimizer_step")
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.life.state is State.TRACING and self.clock.in_microbatch:
            self.clock.optimizer_started(clock_ns())
            if self.gpu is not None:
                self.gpu.phase_started("optimizer")

    @entry_point("lightning.on_train_batch_end", "Lightning's on_train_batch_end hook")
    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        # The hottest hook (it writes the record): kept flat on purpose.
        if self.life.state is State.TRACING and self.clock.in_microbatch:
            now = clock_ns()
            record = self.clock.batch_ended(
                now, getattr(trainer, "global_step", None), getattr(trainer, "current_epoch", None)
            )
            if record is not None:
                self._emit(record, now)

    @entry_point("lightning.on_train_epoch_end", "Lightning's on_train_epoch_end hook")
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.life.state is State.TRACING:
            now = clock_ns()
            record = self.clock.epoch_ended(
                now, getattr(trainer, "global_step", None), getattr(trainer, "current_epoch", None)
            )
            if record is not None:
                self._emit(record, now)
            self._write_input_record(getattr(trainer, "current_epoch", None))

    @entry_point("lightning.on_train_end", "Lightning's on_train_end hook")
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.life.state in (State.TRACING, State.DONE):
            self._drain()
            self._write_input_record(getattr(trainer, "current_epoch", None))
        self._remove_instruments()
        if self.life.state is State.TRACING:
            self.life.move(State.DONE)

    @entry_point("lightning.on_exception", "Lightning's on_exception hook")
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._remove_instruments()
        if self.recorder is None or self.life.state is State.IDLE:
            return
        if self.clock is not None:
            self.clock.abandon()
        if self.gpu is not None:
            self.gpu.abandon_step()
        self._drain()
        self.recorder.ended_by(exception)
        self._finish()

    @entry_point("lightning.teardown", "Lightning's teardown hook (fit)")
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self._remove_instruments()
        if self.recorder is not None and not self.recorder.footer_written:
            self._drain()
            self._finish()

    # -- instrument callbacks (traceml's side of the fetch, transfer and forward wrappers) --

    @entry_point("lightning.fetcher_iter", "the training DataLoader iterator being created")
    def iterator_created(self, start: int, end: int) -> None:
        if self.life.state is State.TRACING:
            self.clock.iterator_created(start, end)

    @entry_point("lightning.fetcher_next", "each batch fetched from the training DataLoader")
    def fetched(self, start: int, end: int) -> None:
        if self.life.state is not State.TRACING:
            return
        starts_step = not self.clock.in_step
        self.clock.fetched(start, end)
        if self.gpu is not None and starts_step:
            self.gpu.step_started()

    @entry_point("lightning.batch_to_device", "before the strategy's batch transfer")
    def transfer_started(self) -> int | None:
        if self.life.state is not State.TRACING or not self.clock.in_microbatch:
            return None
        self.clock.transfer_started()
        if self.gpu is not None:
            self.gpu.phase_started("h2d")
        return clock_ns()

    @entry_point("lightning.batch_transferred", "after the strategy's batch transfer")
    def transferred(self, start: int) -> None:
        end = clock_ns()
        if self.life.state is not State.TRACING:
            return
        if self.gpu is not None:
            self.gpu.phase_ended("h2d")
        self.clock.transferred(start, end)

    @entry_point("lightning.forward_pre_hook", "the traced module's forward pre-hook")
    def forward_pre_hook(self, _module: Any, _inputs: Any) -> None:
        if self.life.state is State.TRACING and self.clock.in_microbatch:
            self.clock.forward_started(clock_ns())
            if self.gpu is not None:
                self.gpu.phase_started("forward")

    @entry_point("lightning.forward_hook", "the traced module's forward hook")
    def forward_post_hook(self, _module: Any, _inputs: Any, _output: Any) -> None:
        if self.life.state is State.TRACING and self.clock.in_microbatch:
            if self.gpu is not None:
                self.gpu.phase_ended("forward")
            self.clock.forward_ended(clock_ns())

    # -- set-up ----------------------------------------------------------------------------

    def _setup(self, trainer: Any, pl_module: Any) -> None:
        self.pid = os.getpid()
        self._trainer_ref = weakref.ref(trainer)
        rank = int(getattr(trainer, "global_rank", 0) or 0)
        self.rank_info = {
            schema.RANK: rank,
            schema.LOCAL_RANK: int(getattr(trainer, "local_rank", 0) or 0),
            schema.WORLD_SIZE: int(getattr(trainer, "world_size", 1) or 1),
            schema.NODE_RANK: int(getattr(trainer, "node_rank", 0) or 0),
            schema.LOCAL_WORLD_SIZE: int(getattr(trainer, "num_devices", 1) or 1),
        }
        console.set_rank(rank)
        if not self.settings.run_name_explicit and self.rank_info[schema.WORLD_SIZE] > 1:
            self.settings = adopt_rank_zero_run_name(self.settings, rank)
        reason = self.unsupported_reason or unsupported_configuration(trainer, pl_module)
        recorder = RankRecorder(self.settings, self.rank_info)
        problem = recorder.open()
        if problem is not None:
            self.life.move(State.DISABLED)
            console.warn(f"{problem}; tracing disabled, training continues", all_ranks=True)
            return
        self.recorder = recorder
        _register_exit(self)
        if reason:
            self._mark_unsupported(trainer, pl_module, reason)
            return
        if self.rank_info[schema.WORLD_SIZE] > 1:
            self._prepare_comm_timing()
        self.life.move(State.READY)

    def _prepare_comm_timing(self) -> None:
        """Multi-rank run: get ready to time waits on other ranks. The DDP hook registration
        is wrapped now, before the strategy wraps the model (and registers any hook of the
        user's); everything else is installed when tracing starts."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        from torch.nn.parallel import DistributedDataParallel

        from traceml.capture.instruments.distributed import CommTimer

        self.comm = CommTimer(on_failure=self._disable)
        self.comm.wrap_hook_registration(DistributedDataParallel)
        self.instruments.add_undo(self.comm.uninstall)

    def _mark_unsupported(self, trainer: Any, pl_module: Any, reason: str) -> None:
        self.life.move(State.UNSUPPORTED)
        self.recorder.status = schema.STATUS_UNSUPPORTED
        console.warn(f"not tracing: {reason} is not supported; training runs natively")
        self._write_header(pl_module, timing="host")
        self.recorder.event("warning", schema.EVENT_UNSUPPORTED, f"{reason} is not supported")

    def _start(self, trainer: Any, pl_module: Any) -> None:
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if fetcher is None:
            raise RuntimeError("the training loop has no data fetcher")
        if type(fetcher).__name__ == "_DataLoaderIterDataFetcher":
            self._mark_unsupported(trainer, pl_module, "a training_step that takes dataloader_iter")
            return
        self.clock = step_clock.StepClock(origin_ns=clock_ns())
        self._clock_origin_unix = time.time()
        self.gpu = self._device_timer(pl_module)
        self._rss = step_clock.rss_reader()
        self._start_telemetry(pl_module)
        self._header_extra = _loop_facts(trainer)
        if self.comm is not None:
            self._start_comm_timing(trainer)
        self._write_header(pl_module, timing="host+cuda_events" if self.gpu else "host")
        for note in self.notes:
            self.recorder.event(note.get("level", "info"), note["code"], note["message"])
        if self.rank_info[schema.RANK] == 0 and not self.settings.launcher_managed:
            from traceml.capture.run_end import announce_direct_launch

            announce_direct_launch(self.settings.run_dir)  # the launcher prints its own
        self.life.move(State.TRACING)
        self.instruments.install(trainer, pl_module, fetcher)
        self._install_input_timing(trainer)

    def _prepare_input_timing(self, trainer: Any) -> None:
        """Lightning 2.x creates the first epoch's DataLoader iterator (and forks its workers)
        in ``FitLoop.setup_data``, before ``on_train_start``: the worker timing is installed
        from inside it, right after the loader is final (``_load_combined_loader_states``,
        the last call before ``iter``; wrapped on this fit loop instance only)."""
        fit_loop = trainer.fit_loop
        original = getattr(fit_loop, "_load_combined_loader_states", None)
        if original is None:
            return  # another Lightning: installed at on_train_start (first epoch untimed)

        def load_states_then_time_input() -> None:
            original()
            self._install_input_timing(trainer)

        fit_loop._load_combined_loader_states = load_states_then_time_input

        def restore() -> None:
            if fit_loop.__dict__.get("_load_combined_loader_states") is load_states_then_time_input:
                del fit_loop._load_combined_loader_states

        self.instruments.add_undo(restore)

    @entry_point("dataloader.install", "the training DataLoader, before its iterator exists")
    def _install_input_timing(self, trainer: Any) -> None:
        """Time the training DataLoader's workers (traceml.capture.instruments.dataloader). Workers
        are forked when the epoch's iterator is created, after this: they inherit it."""
        from traceml.capture.instruments.dataloader import install_input_timing

        if self.input_timing is not None or self.life.state not in (State.READY, State.TRACING):
            return
        combined = getattr(trainer.fit_loop, "_combined_loader", None)
        loaders = getattr(combined, "flattened", None) or [trainer.train_dataloader]
        timing, reason = install_input_timing(loaders[0] if len(loaders) == 1 else None, self)
        if timing is None:
            self.recorder.event("info", schema.EVENT_NOTE, f"input pipeline not timed: {reason}")
            return
        self.input_timing = timing
        self.instruments.add_undo(timing.uninstall)

    def _write_input_record(self, epoch: Any) -> None:
        """Once per epoch: what the workers made since the last record (low rate)."""
        if self.input_timing is None or self.recorder is None or not self.recorder.is_open:
            return
        record = self.input_timing.epoch_record(epoch)
        if record is not None:
            self.recorder.sink.write(record)

    def _start_telemetry(self, pl_module: Any) -> None:
        """Host CPU/memory and allocator samples about once a second (traceml.capture.telemetry):
        its own thread, its own guarded calls; a failure there stops telemetry only."""
        from traceml.capture.telemetry import sampler_for

        sampler = sampler_for(getattr(pl_module, "device", None), self.clock.origin_ns)
        if sampler is not None:
            sampler.start()
            self.telemetry = sampler

    def _stop_telemetry(self) -> None:
        sampler, self.telemetry = self.telemetry, None
        if sampler is not None:
            self.recorder.samples(list(sampler.stop()))

    def _device_timer(self, pl_module: Any) -> Any:
        """CUDA events for device-side phase times, on a CUDA device (else None)."""
        device = getattr(pl_module, "device", None)
        if getattr(device, "type", None) != "cuda":
            return None
        from traceml.capture.cuda_timing import cuda_step_timer

        return cuda_step_timer(device)

    def _start_comm_timing(self, trainer: Any) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        comm = self.comm
        comm.clock = self.clock
        comm.gpu = self.gpu
        self.clock.comm_enabled = True
        if self.gpu is not None:
            self.gpu.comm_enabled = True
        model = getattr(trainer.strategy, "model", None)
        if isinstance(model, DistributedDataParallel):
            comm.attach_buckets(model)
        comm.install_collectives(dist)
        comm.active = True
        self._header_extra[schema.COMM_TIMING] = "host+cuda_events" if self.gpu else "host"
        self._header_extra[schema.BUCKET_TIMING] = comm.bucket_timing
        if comm.bucket_note:
            self.notes.append(
                {
                    "level": "warning",
                    "code": schema.EVENT_BUCKET_TIMING_OFF,
                    "message": f"DDP gradient-bucket timing is off: {comm.bucket_note}",
                }
            )

    # -- records ---------------------------------------------------------------------------

    def _emit(self, record: dict[str, Any], now: int) -> None:
        # About once a second the sampler has something queued; an attribute test otherwise.
        if self.telemetry is not None and self.telemetry.pending:
            self.recorder.samples(self.telemetry.collect())
        # Reading RSS costs ~7 us in a busy loop (a procfs read): every step of a normal
        # training, but at most every RSS_EVERY_NS on millisecond-scale steps (null between).
        if self._rss is not None and now - self._rss_at >= RSS_EVERY_NS:
            self._rss_at = now
            record[schema.RSS] = self._rss()
        cost = self.own_cost_ns + (self.comm.own_cost_ns if self.comm is not None else 0)
        if self.input_timing is not None:  # num_workers=0: its doors run in this process
            cost += self.input_timing.own_cost_ns
        record[schema.TRACEML_COST_US] = (cost - self._cost_reported_ns) / 1000.0
        self._cost_reported_ns = cost
        if self.gpu is not None:
            self.gpu.step_ended(record)
            for finished in self.gpu.ready():
                self._write_step(finished)
        else:
            self._write_step(record)

    def _write_step(self, record: dict[str, Any]) -> None:
        recorder = self.recorder
        if recorder is None or self.life.state not in (State.TRACING, State.DONE):
            return
        if not recorder.step(record):
            # The sink warned once already (full disk, deleted directory...).
            self.life.move(State.DISABLED)
            recorder.status = schema.STATUS_DISABLED
            self._remove_instruments()
            return
        if recorder.limit_reached and self.life.state is State.TRACING:
            self.life.move(State.DONE)
            self._remove_instruments()
            self._drain()
            recorder.event(
                "info",
                schema.EVENT_MAX_STEPS,
                f"recorded the first {self.settings.trace_max_steps} steps "
                "(TRACEML_TRACE_MAX_STEPS); later steps ran untraced",
            )

    def _drain(self) -> None:
        """Write the steps still waiting for their CUDA events (end of training only). After a
        sticky CUDA error the events cannot be read: those steps keep their host times."""
        if self.gpu is None:
            return
        gpu, self.gpu = self.gpu, None
        if self.comm is not None:
            self.comm.gpu = None
        for record in gpu.drain():
            self._write_step(record)
        if gpu.unreadable and self.recorder is not None:
            self.recorder.event(
                "warning",
                schema.EVENT_NOTE,
                f"the device could not report its timings for the last {gpu.unreadable} steps "
                f"({gpu.unreadable_reason}); their host times are kept",
            )

    def _write_header(self, pl_module: Any, timing: str) -> None:
        if self.recorder is None:
            return
        self.recorder.write_header(
            build_header(
                self.settings,
                self.rank_info,
                integration=self.integration,
                device=describe_device(pl_module),
                clock_origin_unix=self._clock_origin_unix,
                timing=timing,
                extra=self._header_extra,
            )
        )

    def _ensure_header(self) -> None:
        if self.recorder is not None and not self.recorder.header_written:
            trainer = self._trainer_ref() if self._trainer_ref else None
            self._write_header(getattr(trainer, "lightning_module", None), timing="host")

    def _finish(self) -> None:
        """Write the footer and close the rank file (once)."""
        if self.recorder is None or self.recorder.footer_written:
            return
        self._ensure_header()
        if self.clock is not None and self.clock.overlaps:
            self.recorder.event(
                "warning",
                schema.EVENT_NOTE,
                f"{self.clock.overlaps} steps had overlapping phase hooks; residual set to 0",
            )
        self._stop_telemetry()
        self.recorder.finish()
        if self.life.state is State.TRACING:
            self.life.move(State.DONE)

    def _remove_instruments(self) -> None:
        self.instruments.remove()

    # Called at interpreter exit (atexit) for runs that ended without teardown.
    def finish_at_exit(self) -> None:
        if self.recorder is None or self.recorder.footer_written or os.getpid() != self.pid:
            return
        self._remove_instruments()
        if self.clock is not None:
            self.clock.abandon()
        try:
            self._drain()
        except Exception:
            pass
        if self.recorder.status is None:
            self.recorder.status = schema.STATUS_INTERRUPTED
            self.recorder.error = (
                self.recorder.error or "the process exited before training finished"
            )
        self._finish()


# ----------------------------------------------------------------------------------------------
# Facts and checks


def unsupported_configuration(trainer: Any, pl_module: Any) -> str | None:
    """Name the setup that these hooks would mis-measure, or None when it is supported."""
    if pl_module is not None and not getattr(pl_module, "automatic_optimization", True):
        return "manual optimization (automatic_optimization=False)"
    strategy_name = type(getattr(trainer, "strategy", None)).__name__.lower()
    for token, label in (
        ("fsdp", "FSDP"),
        ("deepspeed", "DeepSpeed"),
        ("modelparallel", "ModelParallelStrategy (FSDP2/tensor parallel)"),
        ("xla", "TPU/XLA"),
    ):
        if token in strategy_name:
            return label
    accelerator_name = type(getattr(trainer, "accelerator", None)).__name__.lower()
    if "xla" in accelerator_name or "tpu" in accelerator_name:
        return "TPU/XLA"
    if "mps" in accelerator_name:
        return "Apple MPS"
    module = forward_module(pl_module)
    if module is not None and type(module).__name__ == "OptimizedModule":
        return "torch.compile (and the CUDA graphs it may capture)"
    return None


RUN_NAME_KEY = "traceml/run_name"
RUN_NAME_WAIT_S = 60.0


def adopt_rank_zero_run_name(settings: Settings, rank: int) -> Settings:
    """Ranks that derived their run name (no TRACEML_RUN_NAME chosen) take global rank 0's,
    so one job always writes one run directory even when the ranks started seconds apart.

    Through the process group's key-value store, not a collective: rank 0 never waits, and a
    rank whose rank 0 is not traced (different environments on different nodes) waits at most
    RUN_NAME_WAIT_S once and keeps its own name, instead of hanging the job.
    """
    try:
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if not (dist.is_available() and dist.is_initialized()):
            return settings
        store = distributed_c10d._get_default_store()
        if rank == 0:
            store.set(RUN_NAME_KEY, settings.run_name)
            return settings
        store.wait([RUN_NAME_KEY], timedelta(seconds=RUN_NAME_WAIT_S))
        name = store.get(RUN_NAME_KEY).decode()
        from traceml.settings import is_valid_run_name

        # Any process that reaches the store can write this key: a name that is not safe
        # ('..', a path) must not choose where this rank writes. Keep our own (warned below).
        if not is_valid_run_name(name):
            raise ValueError(f"rank 0's run name {name[:40]!r} is not a safe run name")
        if name != settings.run_name:
            return settings.replace(run_name=name)
    except Exception as exc:
        console.warn(
            f"could not agree on a run name with rank 0 ({type(exc).__name__}); "
            f"this rank writes to {settings.run_name}",
            all_ranks=True,
        )
    return settings


def _loop_facts(trainer: Any) -> dict[str, Any]:
    facts: dict[str, Any] = {
        schema.ACCUMULATE_GRAD_BATCHES: getattr(trainer, "accumulate_grad_batches", None),
        schema.BATCH_SIZE: None,
    }
    try:
        loader = trainer.train_dataloader
        loaders = loader if isinstance(loader, (list, tuple)) else [loader]
        sizes = [getattr(item, "batch_size", None) for item in loaders]
        if len(sizes) == 1 and isinstance(sizes[0], int):
            facts[schema.BATCH_SIZE] = sizes[0]
        workers = [getattr(item, "num_workers", None) for item in loaders]
        if len(workers) == 1 and isinstance(workers[0], int):
            facts["num_workers"] = workers[0]
    except Exception:
        pass
    return facts


def describe_device(pl_module: Any) -> dict[str, Any]:
    device = getattr(pl_module, "device", None)
    info: dict[str, Any] = {
        schema.DEVICE_TYPE: getattr(device, "type", None) or "cpu",
        schema.DEVICE_NAME: None,
        schema.DEVICE_TOTAL_MEMORY: None,
    }
    if info[schema.DEVICE_TYPE] == "cuda":
        try:
            import torch

            props = torch.cuda.get_device_properties(device)
            info[schema.DEVICE_NAME] = props.name
            info[schema.DEVICE_TOTAL_MEMORY] = int(props.total_memory)
        except Exception:
            pass
    else:
        info[schema.DEVICE_NAME] = "cpu"
    return info


# ----------------------------------------------------------------------------------------------
# End of process: footers for runs that never reached teardown; the direct-launch report

_exit_callbacks: list[StepTiming] = []
_exit_registered = False


def _register_exit(callback: StepTiming) -> None:
    global _exit_registered
    _exit_callbacks.append(callback)
    if not _exit_registered:
        _exit_registered = True
        atexit.register(at_exit)


@entry_point("exit handler", "interpreter exit: footers and the direct-launch report", owner_arg=-1)
def at_exit() -> None:
    for callback in list(_exit_callbacks):
        try:
            callback.finish_at_exit()
        except Exception:
            pass
    for callback in list(_exit_callbacks):
        if callback.pid != os.getpid():
            continue
        settings = callback.settings
        is_rank_zero = callback.rank_info.get(schema.RANK, 0) == 0
        if is_rank_zero and settings.report and not settings.launcher_managed:
            try:
                from traceml.capture.run_end import report_in_child

                report_in_child(settings)
            except Exception as exc:
                console.warn(f"could not write the final report ({type(exc).__name__}: {exc})")
        break
