"""RF-DETR: trace ``model.train()`` with no code change.

``RFDETR.train()`` and ``RFDETR.evaluate()`` both do ``from rfdetr.training import
build_trainer`` inside the method (rfdetr/detr.py, 1.10.x), so replacing the package attribute
once ``rfdetr.training`` has been imported takes effect for every later call. The wrapper calls
RF-DETR first (its errors reach the user unchanged), then gives the trainer the step callback
unless it is an evaluation-only trainer (``include_training_callbacks=False``).
"""

from __future__ import annotations

import sys
from typing import Any

from traceml import console, schema
from traceml.capture import bootstrap
from traceml.capture.guard import entry_point
from traceml.capture.manual import TraceMLConfigError, init  # noqa: F401  (older import path)

TESTED_VERSIONS = ("1.10.1", "1.11.2")  # both run by tests/integration/test_rfdetr.py


def on_import(module: Any) -> None:
    """Post-import hook for ``rfdetr.training``: wrap ``build_trainer`` where RF-DETR finds it."""
    import wrapt

    original = getattr(module, "build_trainer", None)
    # Ours already? Read off the wrapper (wrapt keeps it as _self_wrapper): an attribute set
    # on the wrapper would land on RF-DETR's own function.
    if original is None or getattr(original, "_self_wrapper", None) is _build_trainer_wrapper:
        return
    wrapped = wrapt.FunctionWrapper(original, _build_trainer_wrapper)
    module.build_trainer = wrapped
    trainer_module = sys.modules.get("rfdetr.training.trainer")
    if trainer_module is not None and trainer_module.__dict__.get("build_trainer") is original:
        trainer_module.build_trainer = wrapped


def _build_trainer_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    trainer = wrapped(*args, **kwargs)  # RF-DETR's own errors reach the user unchanged
    instrument(trainer, args, kwargs)
    return trainer


@entry_point(
    "rfdetr.build_trainer", "RF-DETR's build_trainer, after it built the trainer", owner_arg=-1
)
def instrument(trainer: Any, args: tuple, kwargs: dict) -> None:
    if not kwargs.get("include_training_callbacks", True):
        # RFDETR.evaluate(): no steps to time, and no Trainer.fit hook may pick it up later.
        trainer._traceml_skip = True
        return
    settings = bootstrap.active_settings()
    if settings is None:
        return
    model_config = args[1] if len(args) > 1 else kwargs.get("model_config")
    train_config = args[0] if args else kwargs.get("train_config")
    from traceml.capture.frameworks import lightning_attach

    lightning_attach.attach(
        trainer,
        settings,
        integration="rfdetr",
        unsupported_reason=unsupported_model(model_config, train_config),
        notes=version_notes(),
    )


def unsupported_model(model_config: Any, train_config: Any = None) -> str | None:
    """RF-DETR configurations whose step these hooks would mis-measure."""
    if model_config is None:
        return None
    if getattr(model_config, "segmentation_head", False):
        return "RF-DETR segmentation models (segmentation_head=True)"
    if getattr(model_config, "use_grouppose_keypoints", False):
        return "RF-DETR keypoint models (they train with manual optimization)"
    if getattr(model_config, "compile", False) and rfdetr_compiles(train_config):
        return "torch.compile (model_config.compile=True; and the CUDA graphs it may capture)"
    return None


def rfdetr_compiles(train_config: Any) -> bool:
    """Whether RF-DETR acts on ``compile=True``: its own condition (rfdetr/training/
    module_model.py, 1.10-1.11), a CUDA device and a CUDA-family accelerator. Elsewhere it
    trains eagerly and logs that it does, and the run is measured as any other."""
    try:
        from rfdetr.config import DEVICE as device  # RF-DETR's fork-safe device probe
    except Exception:
        try:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        except Exception:
            device = "cpu"
    accelerator = str(getattr(train_config, "accelerator", "auto")).lower()
    return device == "cuda" and accelerator in {"auto", "gpu", "cuda"}


def version_notes() -> list[dict[str, Any]]:
    from importlib import metadata

    try:
        installed = metadata.version("rfdetr")
    except metadata.PackageNotFoundError:
        return []
    if installed in TESTED_VERSIONS:
        return []
    message = (
        f"rfdetr {installed} is installed; traceml is tested with "
        f"{', '.join(TESTED_VERSIONS)}: figures may be off if RF-DETR changed its training loop"
    )
    console.warn(message, key="rfdetr-version")
    return [{"level": "warning", "code": schema.EVENT_VERSION, "message": message}]
