"""RF-DETR: trace ``model.train()`` with no code change.

``RFDETR.train()`` and ``RFDETR.evaluate()`` both do ``from rfdetr.training import
build_trainer`` inside the method (rfdetr/detr.py, 1.10.x), so replacing the package attribute
once ``rfdetr.training`` has been imported takes effect for every later call. The wrapper calls
RF-DETR first (its errors reach the user unchanged), then gives the trainer the step callback
unless it is an evaluation-only trainer (``include_training_callbacks=False``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from traceml import console, schema
from traceml.capture import bootstrap
from traceml.capture.guard import entry_point
from traceml.settings import is_valid_run_name, load_settings

TESTED_VERSIONS = ("1.10.1", "1.11.2")  # both run by tests/integration/test_rfdetr.py
_WRAPPED_MARK = "_traceml_build_trainer"


class TraceMLConfigError(RuntimeError):
    """``init()`` was asked for settings that contradict the ones already in force."""


def on_import(module: Any) -> None:
    """Post-import hook for ``rfdetr.training``: wrap ``build_trainer`` where RF-DETR finds it."""
    import wrapt

    original = getattr(module, "build_trainer", None)
    if original is None or getattr(original, _WRAPPED_MARK, False):
        return
    wrapped = wrapt.FunctionWrapper(original, _build_trainer_wrapper)
    setattr(wrapped, _WRAPPED_MARK, True)
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
    from traceml.capture.frameworks import lightning

    lightning.attach(
        trainer,
        settings,
        integration="rfdetr",
        unsupported_reason=unsupported_model(model_config),
        notes=version_notes(),
    )


def unsupported_model(model_config: Any) -> str | None:
    """RF-DETR configurations whose step these hooks would mis-measure."""
    if model_config is None:
        return None
    if getattr(model_config, "segmentation_head", False):
        return "RF-DETR segmentation models (segmentation_head=True)"
    if getattr(model_config, "use_grouppose_keypoints", False):
        return "RF-DETR keypoint models (they train with manual optimization)"
    if getattr(model_config, "compile", False):
        try:
            import torch

            on_cuda = torch.cuda.is_available()
        except Exception:
            on_cuda = False
        if on_cuda:
            return "torch.compile (model_config.compile=True; and the CUDA graphs it may capture)"
    return None


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


def init(
    *,
    logs_dir: str | Path | None = None,
    run_name: str | None = None,
    trace_max_steps: int | None = None,
    report: bool | None = None,
) -> None:
    """Trace RF-DETR training in a script started without ``TRACEML=1``.

    Same effect as the automatic hook. Calling it again with compatible settings does nothing;
    contradicting an earlier ``init()`` raises :class:`TraceMLConfigError`; contradicting the
    ``TRACEML_*`` configuration the process was launched with keeps that configuration and
    warns (the launcher and the other ranks rely on it).
    """
    requested: dict[str, Any] = {}
    if logs_dir is not None:
        requested["logs_dir"] = Path(logs_dir).expanduser().resolve()
    if run_name is not None:
        if not is_valid_run_name(run_name):
            raise ValueError(f"run_name={run_name!r} is not a safe run name ([A-Za-z0-9._-])")
        requested["run_name"] = run_name
    if trace_max_steps is not None:
        if int(trace_max_steps) < 1:
            raise ValueError("trace_max_steps must be at least 1")
        requested["trace_max_steps"] = int(trace_max_steps)
    if report is not None:
        requested["report"] = bool(report)

    current = bootstrap.active_settings()
    if current is not None:
        conflicts = [
            f"{key}={getattr(current, key)!r} (asked {value!r})"
            for key, value in requested.items()
            if getattr(current, key) != value
        ]
        if not conflicts:
            return
        if bootstrap.activation_source() == "env":
            console.warn(
                "traceml.init() ignored: the launch already configured "
                + ", ".join(conflicts)
                + "; keeping the launch configuration"
            )
            return
        raise TraceMLConfigError(
            "traceml is already initialised with " + ", ".join(conflicts) + "; call init() once"
        )
    _activate(requested)


@entry_point(
    "init", "traceml.capture.frameworks.rfdetr.init(), once its arguments are checked", owner_arg=-1
)
def _activate(requested: dict[str, Any]) -> None:
    """Turn tracing on with ``requested`` (a TRACEML_* value traceml cannot use turns it off
    with one warning, like any failure inside traceml)."""
    settings = load_settings()
    if "run_name" in requested:
        requested["run_name_explicit"] = True
    bootstrap.activate_manually(settings.replace(**requested))
