"""The live view's knobs: defaults, the launcher's and watch's environment variables, and the
error for a bad value. Read in the reading process (launcher or watch), never in a rank."""

from __future__ import annotations

import os
from collections.abc import Mapping

from traceml.errors import UsageError

DEFAULT_WINDOW = 100  # steps per rank the provisional verdict looks at
DEFAULT_INTERVAL_S = 30.0  # plain-line period when the output is not a terminal
# Least training time before the first provisional verdict (besides warm-up + min_steps steps
# on every rank). Issue 25: 60 s hid the verdict on every run under a minute; 10 s keeps the
# first seconds (start-up, first batches) from deciding alone, and the line says "provisional".
DEFAULT_COLLECT_S = 10.0
REDRAW_S = 1.0  # a terminal panel changes at most this often
ENV_INTERVAL = "TRACEML_LIVE_INTERVAL_S"
ENV_COLLECT = "TRACEML_LIVE_COLLECT_S"


class LiveError(UsageError):
    """A problem with what the user asked of the live view; one line, exit code 2 (cli.main)."""


def interval_from_env(environ: Mapping[str, str] | None = None) -> float | None:
    """``TRACEML_LIVE_INTERVAL_S`` as seconds, or None when unset; LiveError when unusable."""
    return _seconds_from_env(ENV_INTERVAL, environ, minimum_exclusive=0.0)


def collect_from_env(environ: Mapping[str, str] | None = None) -> float | None:
    """``TRACEML_LIVE_COLLECT_S``: least training time before the first provisional verdict."""
    return _seconds_from_env(ENV_COLLECT, environ, minimum_exclusive=None)


def _seconds_from_env(
    name: str, environ: Mapping[str, str] | None, minimum_exclusive: float | None
) -> float | None:
    # The launcher's and watch's own knobs: read here, in the reading process, because no
    # training process ever needs them (settings.py holds what the ranks read).
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise LiveError(f"{name}={raw!r} is not a number of seconds") from None
    if value != value or value < 0 or (minimum_exclusive is not None and value <= 0):
        raise LiveError(f"{name}={raw!r} must be a positive number of seconds")
    return value
