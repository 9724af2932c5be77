"""What the any-loop capture says about a loop it cannot trace, or traces with limits: once,
on stderr for a loop left untraced, in the rank file for a traced one."""

from __future__ import annotations

from typing import Any

from traceml.capture.lifecycle import DISABLED, TRACING, UNSUPPORTED

from .torch_loop_facts import rfdetr_loaded

NOTE_H2D = (
    "any-loop capture: the batch's copy to the device is not timed apart (H2D is null); it is "
    "in Residual, or between steps where the loader moves the batch after fetching it "
    "(Accelerate's prepared loaders, the HF Trainer's)"
)
NOTE_FETCH_THREAD = (
    "the training DataLoader is read in another thread (a background prefetcher): Input Wait "
    "is not measured (null), the loop's wait for a batch is in the gap between steps, and "
    "epochs are not counted"
)
NOTE_FETCH_STOPPED = (
    "some steps' batches did not come from a torch DataLoader (a generator after the first "
    "epoch, itertools.cycle replaying saved batches): their Input Wait is not measured (null)"
)
UNFED = (
    "{count} optimizer steps after the first traced one were fed by no forward traceml times "
    "(a side optimization after training, such as a temperature fitted on saved logits; a "
    "new model trained after the first one, whose forwards traceml does not find after the "
    "first step; or the model compiled with torch.compile after the first step, whose "
    "compiled forward traceml does not time): they are not traced"
)
NOTE_EVAL_FORWARD = (
    "optimizer steps came after a backward with no training forward seen (the model left in "
    "eval() mode after an evaluation?): those steps are not counted"
)


def eval_mode_step(capture: Any) -> None:
    """A step optimizer's step with no microbatch open. Named once two steps in a row came
    after a backward fed only by forwards in eval() mode with gradients on (the model left in
    eval() after an evaluation): one such step is a side optimization after training (a
    temperature fitted on logits collected in eval mode), not a loop."""
    if capture.session is None:
        return
    if not (capture._backward_done and capture._eval_grad):
        capture.eval_steps = 0
        capture.unfed_steps += 1  # fed by no forward traceml times: named at the end
        return
    capture._backward_done = capture._eval_grad = False
    capture.eval_steps += 1
    if capture.eval_steps >= 2:
        capture.note_once("eval-forward", NOTE_EVAL_FORWARD)


def stepped_before_any_forward(capture: Any) -> None:
    """No training forward opened the session, and an optimizer steps: nothing will (a
    module compiled in place runs its hooks inside the compiled graph, where the compiler
    leaves them out). Named once, and the hooks go: no cost for a loop not traced."""
    if rfdetr_loaded():
        return  # RF-DETR trains through Lightning, which claims the process its own way
    capture.hooks.maybe_compiled_in_place = True
    refuse(
        capture,
        "an optimizer stepped before any training forward was seen (a module call in train "
        "mode with gradients on); a model compiled in place (model.compile()) or trained in "
        "eval mode is not traced",
    )


def refuse(capture: Any, why: str) -> None:
    """A loop that no session traces and traceml cannot trace: said once, its hooks gone.
    Silently where tracing was turned off meanwhile (a door of Lightning's that failed said
    so already; the fit it left untraced steps through a closure)."""
    from traceml import console
    from traceml.capture import bootstrap

    if bootstrap.active_settings() is not None:
        console.warn(f"not tracing: {why}; training runs natively")
    capture.stand_down()


def finish_notes(capture: Any) -> None:
    """Honest limits of a traced loop, in its rank file before the footer."""
    if capture.steps and not capture.fetches.train_iterators:
        # Said at the end: a first step whose fetch went to an evaluation (a validation run
        # before the first training forward) is no proof that there is no loader.
        capture.note_once(
            "no-loader",
            "training batches do not come from a torch DataLoader in this process (made by "
            "hand, or sent from another rank, as Accelerate's DataLoaderDispatcher does for an "
            "IterableDataset): Input Wait is not measured (null), the wait for a batch is "
            "between steps, and epochs are not counted",
            level="info",
        )
    if capture.steps and not capture.backward_seen:
        capture.note_once(
            "no-backward",
            "no loss.backward() was seen (gradients from torch.autograd.grad, or a backward "
            "inside a torch.compile'd function?): Backward is not measured (null), its time "
            "is in Residual",
        )
    if capture.steps and capture.unfed_steps:
        capture.note_once("unfed", UNFED.format(count=capture.unfed_steps), level="info")
    if capture.steps == 0 and capture.session.life.state not in (DISABLED, UNSUPPORTED):
        # (not where tracing was turned off: its warning said why, an L-BFGS closure step)
        capture.note_once(
            "no-step",
            "training forwards ran but no torch.optim optimizer step was seen (no optimizer, "
            "an optimizer outside torch.optim, or a step compiled into one graph): steps "
            "could not be delimited, so none are reported",
        )


def ended_by_another(capture: Any) -> None:
    """``LoopCapture.another_training``: a framework's training began after this loop's (a
    Lightning fit, an HF Trainer; ``claim`` refused it with the second-training warning). The
    loop's training is over: its hooks come off, or they would read the other's steps as the
    loop's (Lightning's ``optimizer.step(closure)`` as L-BFGS, its optimizer as a second one),
    and what it recorded is written as a finished training's."""
    session = capture.session
    if session is not None and session.life.state is TRACING:
        capture.abandon_step()  # (a forward after the last step: the other training's)
        session.train_ended(capture.epoch)
    capture.stand_down()
