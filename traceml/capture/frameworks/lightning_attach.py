"""Attaching the step callback to a Lightning training (plain Lightning and RF-DETR).

The post-import hook wraps ``Trainer.fit`` of ``pytorch_lightning`` / ``lightning.pytorch``;
RF-DETR attaches earlier, from its ``build_trainer``. Only the first training trainer of a
process is traced (``traceml.capture.claim``). The callback class comes from the trainer's own
Lightning package (``callback_lightning`` / ``callback_pytorch_lightning``), imported here so
that the callback body (``lightning``) never imports them back.
"""

from __future__ import annotations

import functools
from typing import Any

from traceml.capture import claim
from traceml.capture.guard import entry_point
from traceml.capture.lifecycle import FINAL
from traceml.settings import Settings

from .lightning import StepTiming


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
    """Give ``trainer`` the step callback, unless it has one or another training was traced."""
    existing = find_traceml_callback(trainer)
    if existing is not None:
        return existing
    if not claim.claim(trainer):
        return None
    callback = callback_class_for(trainer)(
        settings,
        integration=integration,
        unsupported_reason=unsupported_reason,
        notes=notes,
    )
    trainer.callbacks.append(callback)
    return callback


def reset_claim_for_tests() -> None:
    claim.reset_for_tests()


def on_import(module: Any) -> None:
    """Post-import hook for ``pytorch_lightning`` and ``lightning.pytorch``: trace the first
    ``Trainer.fit`` of the process (plain Lightning scripts; RF-DETR attaches earlier)."""
    trainer_class = module.Trainer
    original = trainer_class.__dict__.get("fit")
    if original is None or original in _OURS:
        return
    _OURS.add(plain_wrapper(trainer_class, "fit", original, attach_before_fit, fit_done))


# The wrappers set on Trainer classes (one per Lightning package).
_OURS: set[Any] = set()


def plain_wrapper(owner: type, name: str, original: Any, before: Any, after: Any) -> Any:
    """``owner.<name>`` replaced by a plain function that calls ``before(self)``, the original
    exactly once and ``after(self)`` however it ended (``before`` and ``after``: guarded entry
    points); returns it. A plain function, not a wrapt proxy: ``trainer.fit`` stays a bound
    method, and it and ``Trainer.fit`` pickle by name as untraced (a spawned process's
    ``target=trainer.fit``, ``copy.deepcopy``)."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        before(self)
        try:
            return original(self, *args, **kwargs)  # the user's errors reach the user unchanged
        finally:
            after(self)

    setattr(owner, name, wrapper)
    return wrapper


@entry_point(
    "lightning.Trainer.fit", "the Trainer.fit wrapper, before the user's fit", owner_arg=-1
)
def attach_before_fit(trainer: Any) -> None:
    from traceml.capture import bootstrap

    settings = bootstrap.active_settings()
    if settings is None or getattr(trainer, "_traceml_skip", False):
        return
    attach(trainer, settings)


@entry_point(
    "lightning.Trainer.fit_done", "the Trainer.fit wrapper, after the user's fit", owner_arg=-1
)
def fit_done(trainer: Any) -> None:
    """traceml's callback out of ``trainer.callbacks`` once the fit is over and its session
    finished, so that the trainer is as untraced after it: its callbacks' types,
    pickling the trainer. Not from the callback's own teardown: Lightning is iterating over the
    list then. A later fit of this trainer is a second training (``claim.finished``)."""
    callbacks = getattr(trainer, "callbacks", None)
    if not isinstance(callbacks, list):
        return
    # Only once its session is over: a tuner's fit (lr_find, scale_batch_size) leaves it
    # waiting, idle, for the training's fit that follows on the same trainer.
    ours = [c for c in callbacks if isinstance(c, StepTiming) and c.session.life.state in FINAL]
    if ours:
        claim.finished(trainer)
        for callback in ours:
            callbacks.remove(callback)


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
