"""Interpreter-start entry point for Python 3.15+ (PEP 829 ``traceml_bootstrap.start``).

Older interpreters run the one guarded line of ``traceml_bootstrap.pth`` instead; a
matching ``.start`` file makes 3.15+ skip that line and call :func:`start`. Both do the
same thing: nothing at all unless ``TRACEML`` asks for tracing.
"""

import os

# The one "is tracing off?" rule: TRACEML unset, empty or one of these (any case, spaces
# ignored). traceml.settings reads its yes/no values from here; the .pth line cannot import
# anything before deciding, so it spells the same tuple out, and tests/unit/test_off_rule.py
# checks that the two agree.
OFF_VALUES = ("", "0", "false", "no", "off")


def tracing_requested(environ: "os._Environ[str] | dict[str, str] | None" = None) -> bool:
    """Whether ``TRACEML`` asks for tracing."""
    env = os.environ if environ is None else environ
    return env.get("TRACEML", "").strip().lower() not in OFF_VALUES


def start() -> None:
    """Activate traceml when ``TRACEML`` is set; never raise into interpreter start-up."""
    if not tracing_requested():
        return
    import sys

    # Some venvs list one site-packages twice; start once, warn once.
    if getattr(sys, "_traceml_pth_ran", False):
        return
    sys._traceml_pth_ran = True
    try:
        from traceml.capture.bootstrap import activate

        activate()
    except Exception as exc:  # a broken install must not break every Python start
        print(
            f"traceml: tracing disabled, could not start ({type(exc).__name__}: {exc})",
            file=sys.stderr,
        )
