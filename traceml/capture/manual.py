"""``traceml.init()``: turn tracing on from inside a script started without ``TRACEML=1``.

Same effect as the automatic activation (``bootstrap``): the integrations' post-import hooks
are registered and the next training of the process is traced (Lightning, RF-DETR, Hugging Face
Trainer, or any PyTorch loop). Like an OpenTelemetry instrumentor it is idempotent: a repeated
compatible call does nothing.
"""

from __future__ import annotations

import operator
import os
from pathlib import Path
from typing import Any

from traceml import console
from traceml.capture import bootstrap
from traceml.capture.guard import entry_point
from traceml.settings import (
    ENV_ENABLE,
    ENV_LOGS_DIR,
    ENV_REPORT,
    ENV_RUN_NAME,
    ENV_RUN_NAME_DERIVED,
    ENV_TRACE_MAX_STEPS,
    is_valid_run_name,
    load_settings,
)
from traceml_bootstrap import tracing_requested

_ENV_OF = {
    "logs_dir": ENV_LOGS_DIR,
    "run_name": ENV_RUN_NAME,
    "trace_max_steps": ENV_TRACE_MAX_STEPS,
    "report": ENV_REPORT,
}


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
    requested = _checked(logs_dir, run_name, trace_max_steps, report)
    if os.environ.get(ENV_ENABLE, "").strip() and not tracing_requested():
        return  # TRACEML=0 (or off, false, no): off, also for a script that calls init()
    if bootstrap.activation_source() in (bootstrap.ENV_FAILED, bootstrap.TURNED_OFF):
        return  # a start that failed, or tracing turned off after a failure: warned once
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
                "traceml.init() ignored: the launch (TRACEML=1 and its TRACEML_* variables, "
                "or names derived from them) already set "
                + ", ".join(conflicts)
                + "; keeping the launch configuration"
            )
            return
        raise TraceMLConfigError(
            "traceml is already initialised with " + ", ".join(conflicts) + "; call init() once"
        )
    _activate(requested)


def _checked(logs_dir: Any, run_name: Any, trace_max_steps: Any, report: Any) -> dict[str, Any]:
    """init()'s arguments as settings; a bad one is a ValueError (a programming error)."""
    requested: dict[str, Any] = {}
    if logs_dir is not None:
        if not str(logs_dir).strip():
            raise ValueError("logs_dir needs a directory (the default is ./logs)")
        requested["logs_dir"] = Path(logs_dir).expanduser().resolve()
    if run_name is not None:
        if not isinstance(run_name, str) or not is_valid_run_name(run_name):
            raise ValueError(
                f"run_name={run_name!r} is not a safe run name "
                "([A-Za-z0-9._-], starting with a letter or digit)"
            )
        requested["run_name"] = run_name
    if trace_max_steps is not None:
        try:  # (2.7 was cut to 2; a numpy integer is an integer)
            steps = None if isinstance(trace_max_steps, bool) else operator.index(trace_max_steps)
        except TypeError:
            steps = None
        if steps is None or steps < 1:
            raise ValueError(f"trace_max_steps={trace_max_steps!r}: a whole number, at least 1")
        requested["trace_max_steps"] = steps
    if report is not None:
        requested["report"] = bool(report)
    return requested


@entry_point("init", "traceml.init(), once its arguments are checked", owner_arg=-1)
def _activate(requested: dict[str, Any]) -> None:
    """Turn tracing on with ``requested`` (a TRACEML_* value traceml cannot use turns it off
    with one warning, like any failure inside traceml)."""
    # An argument given in code beats the variable of the same setting (a bad value there
    # included: the script said what it wants).
    replaced = {_ENV_OF[key] for key in requested}
    if "run_name" in requested:
        replaced.add(ENV_RUN_NAME_DERIVED)
    settings = load_settings({k: v for k, v in os.environ.items() if k not in replaced})
    if "run_name" in requested:
        requested["run_name_explicit"] = True
    bootstrap.activate_manually(settings.replace(**requested))
