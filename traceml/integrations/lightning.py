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

There is no callback hook around the fetch, hence the fetcher swap; the swap is per instance
(``__class__`` of the one training fetcher), so validation fetchers and other trainers are
untouched. Sanity checks and validation run through other loops and are never timed: every
boundary is only honoured while a training microbatch is open.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
import weakref
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from traceml import capture, console, schema
from traceml.settings import Settings
from traceml.sink import RankSink, SinkError
from traceml.versions import package_versions

clock_ns = time.perf_counter_ns
RSS_EVERY_NS = 10_000_000

_claim_lock = threading.Lock()
_claimed_trainer: weakref.ref | None = None
_warned_second_training = False


# ----------------------------------------------------------------------------------------------
# Attaching


def find_traceml_callback(trainer: Any) -> Any | None:
    for callback in getattr(trainer, "callbacks", None) or []:
        if isinstance(callback, StepTimingMixin):
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
        callback_class = callback_class_for(trainer)
        callback = callback_class(
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
    try:
        _attach_before_fit(instance)
    except Exception as exc:
        console.warn(f"could not attach to Trainer.fit ({type(exc).__name__}: {exc}); untraced")
    return wrapped(*args, **kwargs)


def _attach_before_fit(trainer: Any) -> None:
    from traceml import bootstrap

    settings = bootstrap.active_settings()
    if settings is None or getattr(trainer, "_traceml_skip", False):
        return
    attach(trainer, settings)


# ----------------------------------------------------------------------------------------------
# The callback class, built on demand for whichever Lightning package the trainer comes from

_CLASS_NAMES = {
    "pytorch_lightning": "PytorchLightningStepCallback",
    "lightning.pytorch": "LightningStepCallback",
}
_classes: dict[str, type] = {}


def _lightning_package(trainer: Any) -> str:
    module = type(trainer).__module__
    if module.startswith("lightning.pytorch") or module.startswith("lightning."):
        return "lightning.pytorch"
    return "pytorch_lightning"


def _build_class(package: str) -> type:
    if package not in _classes:
        import importlib

        base = importlib.import_module(package).Callback
        name = _CLASS_NAMES[package]
        _classes[package] = type(name, (StepTimingMixin, base), {"__module__": __name__})
    return _classes[package]


def callback_class_for(trainer: Any) -> type:
    return _build_class(_lightning_package(trainer))


def __getattr__(name: str) -> type:
    # Lets pickle find the generated classes (ddp_spawn ships the trainer to its children).
    for package, class_name in _CLASS_NAMES.items():
        if name == class_name:
            return _build_class(package)
    raise AttributeError(name)


# ----------------------------------------------------------------------------------------------
# Instruments: the three places Lightning offers no hook


_timed_fetchers: dict[type, type] = {}


def _timed_fetcher_class(base: type) -> type:
    if base not in _timed_fetchers:

        def __iter__(self):
            observer = self.__dict__.get("_traceml_observer")
            start = clock_ns()
            result = super(timed, self).__iter__()
            if observer is not None:
                observer._iterator_created(start, clock_ns())
            return result

        def __next__(self):
            observer = self.__dict__.get("_traceml_observer")
            start = clock_ns()
            batch = super(timed, self).__next__()  # user errors and StopIteration pass through
            if observer is not None:
                observer._fetched(start, clock_ns())
            return batch

        timed = type(
            f"TraceMLTimed{base.__name__}",
            (base,),
            {"__iter__": __iter__, "__next__": __next__, "__module__": __name__},
        )
        _timed_fetchers[base] = timed
    return _timed_fetchers[base]


# ----------------------------------------------------------------------------------------------
# The callback


class StepTimingMixin:
    """Lightning callback body; see the module docstring for what each phase covers."""

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
        self.state = "idle"  # idle -> ready -> tracing -> done; or disabled / unsupported
        self.sink: RankSink | None = None
        self.clock: capture.StepClock | None = None
        self.gpu: Any = None
        self.rank_info: dict[str, Any] = {}
        self.header_written = False
        self.footer_written = False
        self.steps_written = 0
        self.status: str | None = None
        self.error: str | None = None
        self.pid = os.getpid()
        self._uninstall: list[Any] = []
        self._trainer_ref: weakref.ref | None = None
        self._header_extra: dict[str, Any] = {}
        self._rss = None
        self._rss_at = 0
        self._fetcher: Any = None
        self._restore_fetcher: Any = None
        self.comm: Any = None  # distributed.CommTimer in a multi-rank run

    @property
    def state_key(self) -> str:
        return "traceml.StepTiming"

    # -- guarded execution ---------------------------------------------------------------------

    def _guard(self, action: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            self._disable(f"{action} failed ({type(exc).__name__}: {exc})")

    def _disable(self, reason: str) -> None:
        if self.state in ("disabled", "unsupported"):
            return
        self.state = "disabled"
        self.status = schema.STATUS_DISABLED
        self._remove_instruments()
        console.warn(f"tracing disabled: {reason}; training continues untraced", all_ranks=True)
        try:
            self._write_event("warning", schema.EVENT_DISABLED, reason)
        except Exception:
            pass

    # -- Lightning hooks -------------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.state != "idle":
            return
        self._guard("setup", self._setup, trainer, pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.state == "ready":
            self._guard("on_train_start", self._start, trainer, pl_module)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        # reload_dataloaders_every_n_epochs gives the loop a new fetcher: time that one.
        if self.state == "tracing":
            fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
            if fetcher is not None and fetcher is not self._fetcher:
                self._guard("on_train_epoch_start", self._instrument_fetcher, fetcher)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.state == "tracing" and self.clock.in_microbatch:
            if self.comm is not None:
                self._guard("on_before_backward", self.comm.backward_started)
            now = clock_ns()
            self.clock.backward_started(now)
            if self.gpu is not None:
                self._guard("on_before_backward", self.gpu.phase_started, "backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if self.state == "tracing" and self.clock.in_microbatch:
            if self.comm is not None:
                self._guard("on_after_backward", self.comm.backward_finished)
            if self.gpu is not None:
                self._guard("on_after_backward", self.gpu.phase_ended, "backward")
            self.clock.backward_ended(clock_ns())

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.state == "tracing" and self.clock.in_microbatch:
            self.clock.optimizer_started(clock_ns())
            if self.gpu is not None:
                self._guard("on_before_optimizer_step", self.gpu.phase_started, "optimizer")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        # The hottest hook (it writes the record): kept flat on purpose.
        if self.state == "tracing" and self.clock.in_microbatch:
            now = clock_ns()
            try:
                record = self.clock.batch_ended(now, **_step_context(trainer))
                if record is not None:
                    self._emit(record, now)
            except Exception as exc:
                self._disable(f"on_train_batch_end failed ({type(exc).__name__}: {exc})")

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.state == "tracing":
            self._guard("on_train_epoch_end", self._epoch_end, trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.state in ("tracing", "done"):
            self._guard("on_train_end", self._drain)
        self._remove_instruments()
        if self.state == "tracing":
            self.state = "done"

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        try:
            self._remove_instruments()
            if self.state == "idle" or self.sink is None:
                return
            if self.clock is not None:
                self.clock.abandon()
            if self.gpu is not None:
                self.gpu.abandon_step()
                self._drain()
            interrupted = isinstance(exception, KeyboardInterrupt) or (
                type(exception).__name__ == "SIGTERMException"
            )
            self.status = schema.STATUS_INTERRUPTED if interrupted else schema.STATUS_EXCEPTION
            message = str(exception).strip().splitlines()
            self.error = type(exception).__name__ + (f": {message[0]}" if message else "")
            self._finish()
        except Exception:
            pass  # the user's exception is what matters here

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        try:
            self._remove_instruments()
            if self.sink is not None and not self.footer_written:
                self._drain()
                self._finish()
        except Exception:
            pass

    # -- implementation ------------------------------------------------------------------------

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
        run_dir = self.settings.run_dir
        self.sink = RankSink(run_dir / schema.RANKS_DIR / schema.rank_file_name(rank))
        try:
            self.sink.open()
        except SinkError as exc:
            self.sink = None
            self.state = "disabled"
            console.warn(f"{exc}; tracing disabled, training continues", all_ranks=True)
            return
        _register_exit(self)
        if reason:
            self._mark_unsupported(trainer, pl_module, reason)
            return
        if self.rank_info[schema.WORLD_SIZE] > 1:
            self._prepare_comm_timing()
        self.state = "ready"

    def _prepare_comm_timing(self) -> None:
        """Multi-rank run: get ready to time waits on other ranks. The DDP hook registration
        is wrapped now, before the strategy wraps the model (and registers any hook of the
        user's); everything else is installed when tracing starts."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        from torch.nn.parallel import DistributedDataParallel

        from traceml.integrations.distributed import CommTimer

        self.comm = CommTimer(on_failure=self._disable)
        self.comm.wrap_hook_registration(DistributedDataParallel)
        self._uninstall.append(self.comm.uninstall)

    def _mark_unsupported(self, trainer: Any, pl_module: Any, reason: str) -> None:
        self.state = "unsupported"
        self.status = schema.STATUS_UNSUPPORTED
        console.warn(f"not tracing: {reason} is not supported; training runs natively")
        self._write_header(trainer, pl_module)
        self._write_event("warning", schema.EVENT_UNSUPPORTED, f"{reason} is not supported")

    def _start(self, trainer: Any, pl_module: Any) -> None:
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if fetcher is None:
            raise RuntimeError("the training loop has no data fetcher")
        if type(fetcher).__name__ == "_DataLoaderIterDataFetcher":
            self._mark_unsupported(trainer, pl_module, "a training_step that takes dataloader_iter")
            return
        origin = clock_ns()
        self.clock = capture.StepClock(origin_ns=origin)
        self._clock_origin_unix = time.time()
        device = getattr(pl_module, "device", None)
        if getattr(device, "type", None) == "cuda":
            from traceml.cuda_timing import cuda_step_timer

            self.gpu = cuda_step_timer(device)
        self._rss = capture.rss_reader()
        self._header_extra = _loop_facts(trainer)
        if self.comm is not None:
            self._start_comm_timing(trainer)
        self._write_header(trainer, pl_module)
        for note in self.notes:
            self._write_event(note.get("level", "info"), note["code"], note["message"])
        if self.rank_info[schema.RANK] == 0 and not self.settings.launcher_managed:
            from traceml.live import announce_direct_launch

            announce_direct_launch(self.settings.run_dir)  # the launcher prints its own
        self.state = "tracing"
        self._install_instruments(trainer, pl_module, fetcher)

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
        self._header_extra[schema.COMM_TIMING] = (
            "host+cuda_events" if self.gpu is not None else "host"
        )
        self._header_extra[schema.BUCKET_TIMING] = comm.bucket_timing
        if comm.bucket_note:
            self.notes.append(
                {
                    "level": "warning",
                    "code": schema.EVENT_BUCKET_TIMING_OFF,
                    "message": f"DDP gradient-bucket timing is off: {comm.bucket_note}",
                }
            )

    def _instrument_fetcher(self, fetcher: Any) -> None:
        """Input Wait: the one training fetcher gets a timing subclass of its own class."""
        if self._restore_fetcher is not None:
            self._restore_fetcher()
        original_class = type(fetcher)
        fetcher._traceml_observer = self
        fetcher.__class__ = _timed_fetcher_class(original_class)

        def restore_fetcher() -> None:
            if type(fetcher) is _timed_fetchers.get(original_class):
                fetcher.__class__ = original_class
            fetcher.__dict__.pop("_traceml_observer", None)

        self._fetcher = fetcher
        self._restore_fetcher = restore_fetcher

    def _install_instruments(self, trainer: Any, pl_module: Any, fetcher: Any) -> None:
        # 1. Input Wait.
        self._instrument_fetcher(fetcher)

        # 2. H2D: the strategy's batch transfer, wrapped on this strategy instance only.
        strategy = trainer.strategy
        original_transfer = strategy.batch_to_device

        def timed_batch_to_device(*args: Any, **kwargs: Any) -> Any:
            if self.state != "tracing" or not self.clock.in_microbatch:
                return original_transfer(*args, **kwargs)
            self.clock.transfer_started()
            start = clock_ns()
            if self.gpu is not None:
                self._guard("H2D", self.gpu.phase_started, "h2d")
            result = original_transfer(*args, **kwargs)
            if self.gpu is not None:
                self._guard("H2D", self.gpu.phase_ended, "h2d")
            self.clock.transferred(start, clock_ns())
            return result

        strategy.batch_to_device = timed_batch_to_device

        def restore_transfer() -> None:
            if strategy.__dict__.get("batch_to_device") is timed_batch_to_device:
                del strategy.batch_to_device

        self._uninstall.append(restore_transfer)

        # 3. Forward: hooks on the model's inner network, counted only inside a training step.
        module = forward_module(pl_module)
        if module is not None:

            def pre_hook(_module: Any, _inputs: Any) -> None:
                if self.state == "tracing" and self.clock.in_microbatch:
                    self.clock.forward_started(clock_ns())
                    if self.gpu is not None:
                        self._guard("forward", self.gpu.phase_started, "forward")

            def post_hook(_module: Any, _inputs: Any, _output: Any) -> None:
                if self.state == "tracing" and self.clock.in_microbatch:
                    if self.gpu is not None:
                        self._guard("forward", self.gpu.phase_ended, "forward")
                    self.clock.forward_ended(clock_ns())

            handles = [
                module.register_forward_pre_hook(pre_hook),
                module.register_forward_hook(post_hook),
            ]
            self._uninstall.append(lambda: [handle.remove() for handle in handles])

    def _remove_instruments(self) -> None:
        if self._restore_fetcher is not None:
            restore, self._restore_fetcher = self._restore_fetcher, None
            try:
                restore()
            except Exception:
                pass
        while self._uninstall:
            undo = self._uninstall.pop()
            try:
                undo()
            except Exception:
                pass

    # Called by the timed fetcher.
    def _iterator_created(self, start: int, end: int) -> None:
        if self.state == "tracing":
            self._guard("DataLoader iterator timing", self.clock.iterator_created, start, end)

    def _fetched(self, start: int, end: int) -> None:
        if self.state != "tracing":
            return
        try:
            starts_step = self.clock._group is None
            self.clock.fetched(start, end)
            if self.gpu is not None and starts_step:
                self.gpu.step_started()
        except Exception as exc:
            self._disable(f"DataLoader timing failed ({type(exc).__name__}: {exc})")

    def _epoch_end(self, trainer: Any) -> None:
        now = clock_ns()
        record = self.clock.epoch_ended(now, **_step_context(trainer))
        if record is not None:
            self._emit(record, now)

    def _emit(self, record: dict[str, Any], now: int) -> None:
        # Reading RSS costs ~7 us in a busy loop (a procfs read): every step of a normal
        # training, but at most every RSS_EVERY_NS on millisecond-scale steps (null between).
        if self._rss is not None and now - self._rss_at >= RSS_EVERY_NS:
            self._rss_at = now
            record[schema.RSS] = self._rss()
        if self.gpu is not None:
            self.gpu.step_ended(record)
            ready = list(self.gpu.ready())
        else:
            ready = [record]
        for finished in ready:
            self._write_step(finished)

    def _write_step(self, record: dict[str, Any]) -> None:
        if self.state not in ("tracing", "done") or self.sink is None:
            return
        limit = self.settings.trace_max_steps
        if limit is not None and self.steps_written >= limit:
            return  # steps still queued for their CUDA events when the limit was reached
        if not self.sink.write(record):
            self.state = "disabled"
            self.status = schema.STATUS_DISABLED
            self._remove_instruments()
            return
        self.steps_written += 1
        if limit is not None and self.steps_written >= limit and self.state == "tracing":
            self.state = "done"
            self._remove_instruments()
            self._drain()
            self._write_event(
                "info",
                schema.EVENT_MAX_STEPS,
                f"recorded the first {limit} steps (TRACEML_TRACE_MAX_STEPS); "
                "later steps ran untraced",
            )

    def _drain(self) -> None:
        if self.gpu is None:
            return
        gpu, self.gpu = self.gpu, None
        if self.comm is not None:
            self.comm.gpu = None
        for record in gpu.drain():
            self._write_step(record)

    def _write_header(self, trainer: Any, pl_module: Any) -> None:
        if self.header_written or self.sink is None:
            return
        self.header_written = True
        header = build_header(
            self.settings,
            self.rank_info,
            integration=self.integration,
            pl_module=pl_module,
            clock_origin_unix=getattr(self, "_clock_origin_unix", time.time()),
            timing="host+cuda_events" if self.gpu is not None else "host",
            extra=self._header_extra,
        )
        self.sink.write(header)

    def _write_event(self, level: str, code: str, message: str) -> None:
        if self.sink is None or not self.sink.is_open:
            return
        if not self.header_written:
            trainer = self._trainer_ref() if self._trainer_ref else None
            self._write_header(trainer, getattr(trainer, "lightning_module", None))
        self.sink.write(
            {
                schema.KIND: schema.KIND_EVENT,
                schema.LEVEL: level,
                schema.CODE: code,
                schema.MESSAGE: message,
                "at_step": self.steps_written,
            }
        )

    def _finish(self) -> None:
        """Write the footer and close the rank file (once)."""
        if self.footer_written or self.sink is None:
            return
        if not self.header_written:
            trainer = self._trainer_ref() if self._trainer_ref else None
            self._write_header(trainer, getattr(trainer, "lightning_module", None))
        self.footer_written = True
        if self.clock is not None and self.clock.overlaps:
            self._write_event(
                "warning",
                schema.EVENT_NOTE,
                f"{self.clock.overlaps} steps had overlapping phase hooks; residual set to 0",
            )
        footer = {
            schema.KIND: schema.KIND_FOOTER,
            schema.STATUS: self.status or schema.STATUS_COMPLETED,
            schema.STEPS: self.steps_written,
            schema.ENDED_AT: _utc_now(),
        }
        if self.error:
            footer[schema.ERROR] = self.error
        self.sink.write(footer)
        self.sink.close()
        if self.state == "tracing":
            self.state = "done"

    # Called at interpreter exit (atexit) for runs that ended without teardown.
    def _finish_at_exit(self) -> None:
        if self.sink is None or self.footer_written or os.getpid() != self.pid:
            return
        self._remove_instruments()
        if self.clock is not None:
            self.clock.abandon()
        try:
            self._drain()
        except Exception:
            pass
        if self.status is None:
            self.status = schema.STATUS_INTERRUPTED
            self.error = self.error or "the process exited before training finished"
        self._finish()


# ----------------------------------------------------------------------------------------------
# Facts and checks


def forward_module(pl_module: Any) -> Any | None:
    """The network whose forward is "Forward": RF-DETR's (and many modules') ``self.model``,
    else the LightningModule itself (its forward runs when ``training_step`` calls ``self(x)``)."""
    try:
        import torch

        inner = getattr(pl_module, "model", None)
        if isinstance(inner, torch.nn.Module):
            return inner
        return pl_module if isinstance(pl_module, torch.nn.Module) else None
    except Exception:
        return None


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


def _step_context(trainer: Any) -> dict[str, Any]:
    return {
        "global_step": getattr(trainer, "global_step", None),
        "epoch": getattr(trainer, "current_epoch", None),
    }


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


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


def build_header(
    settings: Settings,
    rank_info: dict[str, Any],
    *,
    integration: str,
    pl_module: Any,
    clock_origin_unix: float,
    timing: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    script = sys.argv[0] if sys.argv and sys.argv[0] else None
    header: dict[str, Any] = {
        schema.KIND: schema.KIND_HEADER,
        schema.SCHEMA: schema.RANK_SCHEMA,
        schema.RUN: settings.run_name,
        **rank_info,
        schema.HOST: socket.gethostname(),
        schema.PID: os.getpid(),
        schema.STARTED_AT: _utc_now(),
        schema.CLOCK_ORIGIN_UNIX: clock_origin_unix,
        schema.VERSIONS: package_versions(),
        schema.DEVICE: describe_device(pl_module),
        schema.TIMING: timing,
        schema.SCRIPT: Path(script).name if script else None,
        schema.INTEGRATION: integration,
        schema.SETTINGS: {"trace_max_steps": settings.trace_max_steps},
    }
    header.update(extra or {})
    return header


# ----------------------------------------------------------------------------------------------
# End of process: footers for runs that never reached teardown; the direct-launch report

_exit_callbacks: list[StepTimingMixin] = []
_exit_registered = False


def _register_exit(callback: StepTimingMixin) -> None:
    global _exit_registered
    _exit_callbacks.append(callback)
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_at_exit)


def _at_exit() -> None:
    for callback in list(_exit_callbacks):
        try:
            callback._finish_at_exit()
        except Exception:
            pass
    for callback in list(_exit_callbacks):
        if callback.pid != os.getpid():
            continue
        settings = callback.settings
        is_rank_zero = callback.rank_info.get(schema.RANK, 0) == 0
        if is_rank_zero and settings.report and not settings.launcher_managed:
            try:
                from traceml.finalize import report_after_direct_launch

                report_after_direct_launch(settings)
            except Exception as exc:
                console.warn(f"could not write the final report ({type(exc).__name__}: {exc})")
        break
