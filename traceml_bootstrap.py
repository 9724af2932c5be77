"""Interpreter-start entry point for Python 3.15+ (PEP 829 ``traceml_bootstrap.start``).

Older interpreters run the one guarded line of ``traceml_bootstrap.pth`` instead; a
matching ``.start`` file makes 3.15+ skip that line and call :func:`start`. Both do the
same thing: nothing at all unless ``TRACEML`` asks for tracing.
"""

import os

_OFF_VALUES = ("", "0", "false", "no", "off")


def start() -> None:
    """Activate traceml when ``TRACEML`` is set; never raise into interpreter start-up."""
    if os.environ.get("TRACEML", "").strip().lower() in _OFF_VALUES:
        return
    import sys

    # Some venvs list one site-packages twice; start once, warn once.
    if getattr(sys, "_traceml_pth_ran", False):
        return
    sys._traceml_pth_ran = True
    try:
        from traceml.bootstrap import activate

        activate()
    except Exception as exc:  # a broken install must not break every Python start
        print(
            f"traceml: tracing disabled, could not start ({type(exc).__name__}: {exc})",
            file=sys.stderr,
        )
