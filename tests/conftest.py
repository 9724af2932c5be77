"""Shared helpers: building rank files by hand (unit tests) and running real processes."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Issue 21 (suite time): nearly all of it is real processes importing torch and Lightning, so the
# number of them is the figure to drive down. Counted in this (pytest's) process only: torchrun's
# ranks and `traceml run`'s children come on top. Printed at the end of the run.
_LAUNCHES: dict[str, int] = {}


def _count_launches() -> None:
    import subprocess

    original = subprocess.Popen.__init__

    def counting_init(self, args, *rest, **kwargs):  # type: ignore[no-untyped-def]
        try:
            first = args if isinstance(args, str | bytes) else next(iter(args), "")
            name = Path(str(first)).name or "?"
            _LAUNCHES[name] = _LAUNCHES.get(name, 0) + 1
        except Exception:
            pass
        original(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = counting_init  # type: ignore[method-assign]


_count_launches()


_SECONDS_BY_FILE: dict[str, float] = {}


def pytest_runtest_logreport(report):  # type: ignore[no-untyped-def]
    # Setup, call and teardown alike: a module-scoped fixture's trainings count where they run.
    path = report.nodeid.split("::", 1)[0]
    _SECONDS_BY_FILE[path] = _SECONDS_BY_FILE.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):  # type: ignore[no-untyped-def]
    if _LAUNCHES:
        counts = ", ".join(
            f"{n} {name}" for name, n in sorted(_LAUNCHES.items(), key=lambda kv: -kv[1])
        )
        terminalreporter.write_line(
            f"processes launched by the tests: {sum(_LAUNCHES.values())} ({counts})"
        )
    from procs import FIGURES

    for figure in FIGURES:
        terminalreporter.write_line(figure)
    slowest = sorted(_SECONDS_BY_FILE.items(), key=lambda kv: -kv[1])[:12]
    if slowest and slowest[0][1] >= 60:
        terminalreporter.write_line("seconds per test file (setup, call and teardown):")
        for path, seconds in slowest:
            terminalreporter.write_line(f"  {seconds:8.1f}  {path}")
