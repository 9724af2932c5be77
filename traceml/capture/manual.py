"""``traceml.init()``: turn tracing on from inside a script started without ``TRACEML=1``.

Same effect as the automatic activation (``bootstrap``): the integrations' post-import hooks
are registered and the next training of the process is traced (Lightning, RF-DETR, Hugging Face
Trainer, or any PyTorch loop). Like an OpenTelemetry instrumentor it is idempotent: a repeated
compatible call does nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from traceml import console
from traceml.capture import bootstrap
from traceml.capture.guard import entry_point
from traceml.settings import is_valid_run_name, load_settings


class TraceMLConfigError(RuntimeError):
    """``init()`` was asked for settings that contradict the ones already in force."""


def init(
    *,
    logs_dir: str | Path | None = None,
    run_name: str | None = None,
    trace_max_steps: int | None = None,
    report: bool | None = None,
) -> None:
    """Trace the next training in a script started without ``TRACEML=1``.

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
            raise ValueError(
                f"run_name={run_name!r} is not a safe run name "
                "([A-Za-z0-9._-], starting with a letter or digit)"
            )
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


@entry_point("init", "traceml.init(), once its arguments are checked", owner_arg=-1)
def _activate(requested: dict[str, Any]) -> None:
    """Turn tracing on with ``requested`` (a TRACEML_* value traceml cannot use turns it off
    with one warning, like any failure inside traceml)."""
    settings = load_settings()
    if "run_name" in requested:
        requested["run_name_explicit"] = True
    bootstrap.activate_manually(settings.replace(**requested))
