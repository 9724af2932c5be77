"""Any PyTorch training loop, with no code change: steps from torch-level boundaries.

A hand-written loop (``for x, y in loader: opt.zero_grad(); loss = f(model(x), y);
loss.backward(); opt.step()``), an Accelerate loop and the Hugging Face Trainer all end in the
same torch calls; this adapter drives a :class:`~traceml.capture.session.Session` from them:

    DataLoader iterator ``__next__``  -> Input Wait (only the fetches that feed a training
                                         forward, of every loader zipped; a validation
                                         loader's fetches are dropped)
    outermost call of a module with parameters, grad enabled, in train mode -> Forward
                                         (a loss module outside the model is Residual)
    ``torch.autograd.backward`` (``Tensor.backward`` ends there) -> Backward
    optimizer step (torch.optim's global step pre/post hooks)    -> Optimizer, and the end of
                                                                    the step

A step runs from the first fetch of its first microbatch to the end of its optimizer step;
several forward/backward passes before one optimizer step are microbatches of one step
(gradient accumulation). Evaluation (no grad, inference mode or eval mode) is not a forward:
it lies between steps, in the next step's gap. The batch's copy to the device (H2D) is not
timed apart: it is in Residual, or between steps after an Accelerate loader's fetch (a note).

The root modules are found cheaply: a global forward pre/post hook (every module call) only
until the first optimizer step, then hooks on the roots alone (``torch_loop_hooks``). The
session opens at the first training forward; not where RF-DETR is loaded (it trains through
Lightning). Where Lightning is, a training forward may be a probe before a fit, whose claim
makes this capture stand down: the session opens at the first training forward after an
optimizer step no fit claimed (a loop that only imports Lightning), its first step unrecorded.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from traceml import schema
from traceml.capture import claim
from traceml.capture.guard import entry_point
from traceml.capture.lifecycle import TRACING
from traceml.capture.session import Session
from traceml.capture.session_parts import device_timer_for
from traceml.capture.untraced_children import name_forked_training
from traceml.settings import Settings

from .torch_loop_facts import (
    lightning_loaded,
    loop_facts,
    module_device,
    rank_info,
    rfdetr_loaded,
    scripted,
    sharded,
    with_loader,
)
from .torch_loop_fetches import Fetches
from .torch_loop_hooks import LoopHooks
from .torch_loop_input import microbatch_fed
from .torch_loop_notes import (
    NOTE_H2D,
    ended_by_another,
    eval_mode_step,
    finish_notes,
    refuse,
    stepped_before_any_forward,
)
from .torch_loop_optimizers import NOTES, OTHER, STEP, StepOptimizer


class LoopCapture:
    """The adapter for one process (see the module docstring)."""

    def __init__(self, settings: Settings, *, integration: str = "torch") -> None:
        self.settings = settings
        self.integration = integration
        self.session: Session | None = None
        self.hooks = LoopHooks(self)
        self.own_cost_ns = 0  # time inside this capture's entry points (the guard adds to it)
        self.thread: int | None = None  # the training thread, set by the first training forward
        self.step_optimizer = StepOptimizer()  # whose step ends a step
        self.steps = 0
        self.epoch = 0
        self.fetches = Fetches()  # fetches not yet known to feed a training forward
        self._fetch_thread: int | None = None  # the last fetch's (not the loop's: a prefetcher)
        self._backward_done = self.backward_seen = False
        self._eval_grad, self.eval_steps = False, 0  # forwards in eval(), grads on: see notes
        self.unfed_steps = 0  # step optimizer's steps with no microbatch (see notes)
        self.window_fed = False  # the open step's first microbatch took a DataLoader fetch
        self._unfed = False  # the open microbatch began with no fetch, after a step had ended
        self._in_step = False  # inside the step optimizer's step (its pre-hook, not yet post)
        self._deferred = self._proven = False  # Lightning loaded: a loop, once it stepped
        self._backward_depth = 0
        self._forward_depth = 0
        self._noted: set[str] = set()
        self.step_ends_at_optimizer = True  # the HF adapter ends steps at on_step_end instead
        self.facts = loop_facts()  # the header's; the HF adapter knows its batch, accumulation
        self.optimizer_returns = 0  # (the HF adapter: its on_optimizer_step comes later)
        self.stood_down = False

    # -- installing ------------------------------------------------------------------------

    def install(self) -> None:
        self.hooks.install()
        claim.register_stand_by(self.stand_down)
        # A forked child (a DataLoader worker) never traces (the rank file is the parent's).
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self.stood_down = True
        self.session = None
        self.hooks.remove()
        name_forked_training()

    another_training = ended_by_another  # (claim: a framework's training began after this)

    def stand_down(self) -> None:
        """Another adapter traces this process (Lightning): take every hook away."""
        self.stood_down = True
        self.hooks.remove()
        claim.unregister_stand_by(self.stand_down)

    def _entry_failed(self, name: str, exc: BaseException) -> None:
        if self.session is not None:
            self.session._entry_failed(name, exc)
        else:
            from traceml.capture.guard import failed

            self.hooks.remove()
            failed(None, name, exc)

    @property
    def tracing(self) -> bool:
        return self.session is not None and self.session.life.state is TRACING

    # -- the session -----------------------------------------------------------------------

    def _begin(self, module: Any) -> bool:
        """The first training forward: claim the process and start the session."""
        from traceml.capture import bootstrap

        if bootstrap.active_settings() is None:  # tracing was turned off meanwhile
            self.stand_down()
            return False
        if scripted(module):
            # TorchScript runs the model's modules inside its own interpreter: no module hook
            # or door of traceml's reaches them, and torch refuses hooks on the root.
            refuse(self, "the model is a TorchScript module (torch.jit.script / torch.jit.load)")
            return False
        if sharded(module):
            refuse(self, "the model is sharded with FSDP, whose collectives traceml does not time")
            return False
        if rfdetr_loaded():
            self.stand_down()  # RF-DETR trains through Lightning, which claims the process
            return False
        if lightning_loaded() and not self._proven:
            self._deferred = True  # a probe before a fit, or a loop: its optimizer step says
            return False
        if not claim.claim(self):
            self.stand_down()
            return False
        self.thread = threading.get_ident()
        session = Session(self.settings, integration=self.integration)
        session.cost_owners.append(self)
        session.add_undo(self.hooks.remove)
        session.ends_at_exit = True
        session.before_finish.append(self.finish_notes)
        self.session = session
        device = module_device(module)
        session.device = device
        if not session.open(rank_info()):
            self.hooks.remove()
            return False
        held = self.fetches.for_training()
        origin = held[1] if held is not None else None
        facts = with_loader(self.facts, self.fetches.iterator_of(held))
        gpu = device_timer_for(device)
        session.start(device, facts, gpu=gpu, ddp_model=module, origin_ns=origin)
        session.note("info", schema.EVENT_NOTE, NOTE_H2D)
        return True

    def note_once(self, key: str, message: str, level: str = "warning") -> None:
        if key in self._noted or self.session is None:
            return
        self._noted.add(key)
        self.session.note(level, schema.EVENT_NOTE, message)

    # -- boundaries (called by the hooks in torch_loop_hooks) --------------------------------

    @entry_point("torch_loop.fetch", "after a DataLoader iterator's __next__ returned a batch")
    def fetched(self, iterator: Any, start: int, end: int) -> None:
        here = threading.get_ident()
        elsewhere = self.thread is not None and here != self.thread
        if not elsewhere or self.fetches.feeds_training(iterator):  # not a monitor's loader
            self._fetch_thread = here
        if elsewhere:
            return
        self.fetches.fetched(iterator, start, end)

    @entry_point("torch_loop.epoch_end", "a DataLoader iterator ran out (StopIteration)")
    def iterator_exhausted(self, iterator: Any, start: int = 0, end: int = 0) -> None:
        # The epoch ends at the next training forward fed by a fetch made after this: a
        # prefetching loader (Accelerate's) sees StopIteration one batch before the loop does.
        if self.tracing and threading.get_ident() == self.thread:
            self.fetches.exhausted(iterator, start, end)

    @entry_point("torch_loop.forward_pre_hook", "before the outermost module call")
    def forward_started(self, module: Any) -> bool:
        """Returns whether this call is timed as Forward (the post hook ends it)."""
        import torch

        if not (module.training and torch.is_grad_enabled()) or torch.is_inference_mode_enabled():
            if self._forward_depth == 0 and self.thread in (None, threading.get_ident()):
                self.fetches.evaluated()  # not Input Wait, unless a training forward follows
            self._eval_grad = torch.is_grad_enabled() and not module.training
            return False
        if self.session is None:
            if self.stood_down or not self._begin(module):
                return False
        elif threading.get_ident() != self.thread:
            return False
        session = self.session
        if session.life.state is not TRACING:
            return False
        if self._forward_depth == 0 and not self._backward_depth:
            self._microbatch_boundary(session)
        self._forward_depth += 1
        session.forward_started()
        return True

    def _microbatch_boundary(self, session: Session) -> None:
        """A forward after a new fetch, or after a backward, starts a microbatch."""
        clock = session.clock
        fetches = self.fetches
        pending = fetches.for_training()
        if clock.in_microbatch and pending is None and not self._backward_done:
            return  # a second forward of the same microbatch (two models, a loss module)
        if fetches.epoch_turned(pending):
            # The microbatches left without a step: closed where their last phase ended.
            session.epoch_ended(self.steps, self.epoch)
            self.epoch += 1
        self._unfed = pending is None and not clock.in_microbatch and self.steps > 0
        if clock.in_microbatch and self.steps == 0 and not self._backward_done:
            session.abandon_step()  # forwards before the loop (a dry run, a sanity check)
        elif clock.in_microbatch:
            session.batch_ended(self.steps, self.epoch)  # no optimizer step: accumulation
        fetches.take(pending)
        microbatch_fed(self, session, pending)
        self._backward_done = False

    @entry_point("torch_loop.forward_hook", "after the outermost module call")
    def forward_ended(self) -> None:
        self._forward_depth -= 1
        if self.session is not None:
            self.session.forward_ended()

    @entry_point("torch_loop.backward", "before torch.autograd.backward")
    def backward_started(self) -> bool:
        if not self.tracing or threading.get_ident() != self.thread:
            return False
        self._backward_depth += 1
        if self._backward_depth == 1:
            self.session.backward_started()
        return True

    @entry_point("torch_loop.backward_done", "after torch.autograd.backward")
    def backward_ended(self) -> None:
        self._backward_depth -= 1
        if self._backward_depth == 0:
            self._backward_done = self.backward_seen = True
            self.session.backward_ended()

    def backward_raised(self) -> None:
        self._backward_depth = max(0, self._backward_depth - 1)

    @entry_point("torch_loop.optimizer_pre_hook", "torch.optim's global step pre-hook")
    def optimizer_started(self, optimizer: Any) -> None:
        if self.session is None:
            if self._deferred:  # no fit claimed the process: a hand-written loop
                self._proven = True
            else:
                stepped_before_any_forward(self)
            return
        if not self._is_step_optimizer(optimizer):
            return
        self._in_step = True
        self.session.optimizer_started()

    @entry_point("torch_loop.closure_step", "torch.optim's step pre-hook, given a closure")
    def closure_step(self, optimizer: Any) -> None:
        """``optimizer.step(closure)`` (L-BFGS) runs forwards and backwards inside the step:
        its phases cannot be told apart, so the loop is named and left untraced. A side
        optimizer's, once steps end at another's (a calibration after training), is another
        optimizer's step (review)."""
        if self.steps and not self.step_optimizer.is_current(optimizer):
            self.note_once(OTHER, NOTES[OTHER], level="info")
            return
        reason = "optimizer.step(closure) runs forward and backward inside the step (L-BFGS)"
        if self.session is not None:
            self.session.disable(reason)
            self.stand_down()
        else:
            refuse(self, reason)

    @entry_point("torch_loop.optimizer_hook", "torch.optim's global step post-hook")
    def optimizer_ended(self, optimizer: Any) -> None:
        if not self._is_step_optimizer(optimizer, finished=True):
            if self._unfed and not self._in_step and self.tracing:
                # Only another optimizer's work since the step ended (a GAN's generator, on
                # the same batch): in the gap, not the next step's first microbatch. (Not an
                # optimizer that the step optimizer's step calls: Lookahead, ZeRO's.)
                self._unfed = False
                self.session.abandon_step()
            return
        self._in_step = False
        if self.steps == 0:
            self.hooks.roots_found()  # no more global forward hooks
        if self.step_ends_at_optimizer:
            self.step_ended()
        else:  # the HF Trainer: Optimizer ends here, before the callbacks' on_optimizer_step
            self.optimizer_returns += 1
            self.session.optimizer_ended()

    @entry_point("torch_loop.scaler_skipped", "after GradScaler.step skipped optimizer.step")
    def scaler_skipped(self, optimizer: Any) -> None:
        if not self.step_ends_at_optimizer or not self._is_step_optimizer(optimizer, True):
            return
        self.note_once(
            "scaler",
            "AMP's GradScaler skipped optimizer steps (inf/NaN gradients): each still counts as "
            "a step, with a near-zero Optimizer",
            level="info",
        )
        self.session.optimizer_started()
        self.step_ended()

    def step_ended(self, global_step: Any = None) -> None:
        session = self.session
        if session is None or not session.clock.in_microbatch:
            return eval_mode_step(self)
        if self.steps == 0:
            # (also where AMP's GradScaler skipped the first optimizer.step(): no post-hook)
            self.hooks.roots_found()
        self.steps += 1
        self._backward_done = self.window_fed = False
        session.batch_ended(self.steps if global_step is None else global_step, self.epoch)

    def _is_step_optimizer(self, optimizer: Any, finished: bool = False) -> bool:
        if not self.tracing:
            return False
        if threading.get_ident() != self.thread:
            self.note_once(
                "thread",
                "an optimizer was stepped from another thread than the training loop: those "
                "steps are not delimited (not counted)",
            )
            return False
        if self._in_step and not self.step_optimizer.is_current(optimizer):
            return False  # called by the step optimizer's step (ZeRO's, Lookahead's): in it
        verdict = self.step_optimizer.judge(optimizer, finished, fed=not self._unfed)
        if verdict != STEP:
            self.note_once(verdict, NOTES[verdict], level="info")
        return verdict != OTHER

    def abandon_step(self) -> None:
        """The open step is not a step (the framework starts its loop over)."""
        self.fetches.drop()
        self._backward_done = self.window_fed = False
        self._backward_depth = self._forward_depth = 0
        if self.session is not None:
            self.session.abandon_step()

    # -- the end ---------------------------------------------------------------------------

    def finish_notes(self) -> None:
        """Honest limits, said once in the rank file before its footer."""
        if self.session is not None:
            finish_notes(self)


_capture: LoopCapture | None = None


@entry_point("torch_loop.install", "the post-import hook on torch", owner_arg=-1)
def on_import(module: Any) -> None:
    """Post-import hook for ``torch``: install the any-loop capture once per process."""
    global _capture
    from traceml.capture import bootstrap

    settings = bootstrap.active_settings()
    if settings is None or _capture is not None:
        return
    _capture = LoopCapture(settings)
    _capture.install()
    from .torch_spawn import name_spawned_ranks

    name_spawned_ranks()


def active_capture() -> LoopCapture | None:
    return _capture
