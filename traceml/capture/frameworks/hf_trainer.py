"""Hugging Face ``Trainer``: the any-loop capture, with the Trainer's own step events.

The Trainer trains through torch calls the any-loop capture already times (``torch_loop``):
its DataLoader fetches (Accelerate's prepared loader, which also moves the batch to the
device), the model's forward, ``accelerator.backward`` (ending in ``torch.autograd.backward``)
and ``optimizer.step()``. What this adapter adds (``Trainer._inner_training_loop``,
transformers 5.x; see docs/any_pytorch.md):

* the step ends at ``on_step_end`` (after clipping, the step, the scheduler and
  ``zero_grad``), with the Trainer's ``global_step``; logging, evaluation and checkpoints after
  it are the gap between steps, and ``Trainer.evaluate`` / ``predict`` never make a step;
* Optimizer is ``optimizer.step()`` itself, from ``on_pre_optimizer_step`` to
  ``on_optimizer_step`` (Accelerate's scaler step and its skip included). The Trainer clips
  the gradients before ``on_pre_optimizer_step`` and steps the scheduler and ``zero_grad``
  after ``on_optimizer_step``: those are Residual (with Lightning, clipping is in Optimizer);
* ``on_train_begin`` abandons an open step: ``auto_find_batch_size`` retries the whole inner
  loop with a smaller batch after an out-of-memory error;
* the end of ``Trainer.train`` (or its exception) closes the rank file.
"""

from __future__ import annotations

import functools
from typing import Any

from traceml import schema
from traceml.capture import claim
from traceml.capture.guard import entry_point
from traceml.capture.lifecycle import FINAL
from traceml.capture.session_exit import keep_stepped_step

_callback_class: type | None = None


def on_import(module: Any) -> None:
    """Post-import hook for ``transformers.trainer``: wrap ``Trainer.train`` (a plain function,
    so that ``trainer.train`` stays a bound method that pickles by name, as untraced)."""
    trainer_class = getattr(module, "Trainer", None)
    original = None if trainer_class is None else trainer_class.__dict__.get("train")
    if original is None or original in _OURS:
        return

    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        callback = before_train(self)
        try:
            return original(self, *args, **kwargs)  # the user's errors reach the user unchanged
        except BaseException as exc:
            if callback is not None:
                callback.train_failed(exc, self)
            raise
        finally:
            if callback is not None:
                callback.train_done(self)

    trainer_class.train = train
    _OURS.add(train)


_OURS: set[Any] = set()  # the wrapper set on transformers' Trainer


@entry_point("hf_trainer.train", "Trainer.train, before the Trainer's own code", owner_arg=-1)
def before_train(trainer: Any) -> Any | None:
    from .torch_loop import active_capture

    capture = active_capture()
    if capture is None or capture.stood_down:
        return None
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, StepEvents):
            return callback
    session = capture.session
    looped = capture.steps and capture.integration != "hf_trainer"  # a loop's steps before
    if session is not None and (session.life.state in FINAL or looped):
        # The traced training is over (a second train(), of this trainer or another; a
        # hand-written loop's, which claim ends): a second training, refused with the one
        # warning, as any other (claim).
        claim.claim(trainer)
        return None
    if capture.session is None:
        capture.integration = "hf_trainer"
    elif capture.steps == 0 and capture.integration != "hf_trainer":
        # A forward before train() (a sanity check) opened the run as a hand-written loop's.
        capture.integration = capture.session.integration = "hf_trainer"
        if capture.session.recorder is not None:
            capture.session.recorder.integration("hf_trainer")
    capture.step_ends_at_optimizer = False
    capture.facts = _facts(trainer.args)
    callback = callback_class()(capture)
    trainer.add_callback(callback)
    return callback


def _facts(args: Any) -> dict[str, Any]:
    """The header's batch size (per device) and microbatches per step, from the arguments
    (unknown, null, where they are not whole numbers)."""
    facts = {}
    for field, name in (
        (schema.ACCUMULATE_GRAD_BATCHES, "gradient_accumulation_steps"),
        (schema.BATCH_SIZE, "per_device_train_batch_size"),
    ):
        value = getattr(args, name, None)
        facts[field] = value if type(value) is int and value > 0 else None
    return facts


def callback_class() -> type:
    """``StepEvents`` as a ``transformers.TrainerCallback`` (made once, when first needed)."""
    global _callback_class
    if _callback_class is None:
        from transformers import TrainerCallback

        _callback_class = type("TraceMLTrainerCallback", (StepEvents, TrainerCallback), {})
    return _callback_class


class StepEvents:
    """The Trainer callback's body; each event is a guarded entry point."""

    def __init__(self, capture: Any) -> None:
        self.capture = capture
        self.began = False  # the Trainer's loop began once: a second begin is a retry
        self.last_step: Any = None  # the global step at the last step's end (or the begin)
        self.returns = 0  # the capture's optimizer_returns at the last on_pre_optimizer_step

    # The guard adds each event's time to its owner's: the capture's, which the session counts
    # (a count of the callback's own would never reach ``traceml_us``).
    @property
    def own_cost_ns(self) -> int:
        return self.capture.own_cost_ns

    @own_cost_ns.setter
    def own_cost_ns(self, value: int) -> None:
        self.capture.own_cost_ns = value

    def _entry_failed(self, name: str, exc: BaseException) -> None:
        self.capture._entry_failed(name, exc)

    @entry_point("hf_trainer.on_train_begin", "the Trainer's on_train_begin event")
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        capture = self.capture
        # auto_find_batch_size: the loop starts over. (A session open before the first begin
        # came from a forward before train(), a sanity check: dropped, with no note.)
        if self.began and capture.session is not None:
            capture.note_once(
                "hf-retry",
                "the Trainer started its training loop again (auto_find_batch_size, after an "
                "out-of-memory error): the open step was dropped; global_step starts over",
            )
        self.began = True
        self.last_step = state.global_step
        capture.abandon_step()

    @entry_point("hf_trainer.on_pre_optimizer_step", "the Trainer's on_pre_optimizer_step")
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.returns = self.capture.optimizer_returns
        if self.capture.tracing:
            self.capture.session.optimizer_started()

    @entry_point("hf_trainer.on_optimizer_step", "the Trainer's on_optimizer_step")
    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Optimizer ended where optimizer.step() returned (torch's post-hook), before the
        # user's on_optimizer_step callbacks (an EMA update: Residual), which run before this
        # one; here only where no step returned (AMP's GradScaler skipped it).
        if self.capture.tracing and self.capture.optimizer_returns == self.returns:
            self.capture.session.optimizer_ended()

    @entry_point("hf_trainer.on_step_end", "the Trainer's on_step_end event")
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.last_step = state.global_step
        if self.capture.tracing:
            self.capture.step_ended(state.global_step)

    @entry_point("hf_trainer.on_train_end", "the Trainer's on_train_end event")
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        session = self.capture.session
        if session is not None:
            session.epoch_ended(state.global_step, self.capture.epoch)
            session.train_ended(self.capture.epoch)
            session.close()

    @entry_point("hf_trainer.train_done", "Trainer.train returned or raised")
    def train_done(self, trainer: Any) -> None:
        """The callback out of the trainer's list, which is then as untraced (pickling the
        trainer or its callbacks, a later train() of the same trainer adds it again)."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)

    @entry_point("hf_trainer.train_failed", "Trainer.train raised (the user's exception)")
    def train_failed(self, exception: BaseException, trainer: Any = None) -> None:
        session = self.capture.session
        if session is None:
            return
        # A step whose optimizer stepped and which the Trainer counted (a callback's on_step_end
        # raised before traceml's) is a step: its update is done.
        step = getattr(getattr(trainer, "state", None), "global_step", None)
        if step is not None and step != self.last_step:
            keep_stepped_step(session, lambda: self.capture.step_ended(step))
        session.failed(exception)
