"""Exit codes that hold (issue 25): a closed or broken stdout/stderr never changes what a
command decided; a crash inside traceml has a code of its own. Real processes, real pipes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from traceml.finalize import summarise

from procs import BIN, PYTHON, clean_env
from rankfiles import synthetic_run

TRACEML = str(BIN / "traceml")
BASE = dict(input=30, forward=30, backward=30, optimizer=5, residual=5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    made = {}
    for name, (scale, steps, seed) in {
        "a": (1.0, 200, 1),
        "same": (1.0, 200, 2),
        "slow": (1.3, 200, 3),
        "short": (1.0, 3, 4),
        "a2": (1.01, 200, 5),
        "a3": (0.99, 200, 6),
    }.items():
        path = root / name
        synthetic_run(path, steps=steps, seed=seed, **{k: v * scale for k, v in BASE.items()})
        summarise(path)
        made[name] = str(path)
    return made


def broken_pipe_run(argv: list[str], *, stderr_too: bool) -> int:
    """Run with stdout (and stderr) on a pipe whose reader has already gone."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            argv,
            stdout=write,
            stderr=write if stderr_too else subprocess.DEVNULL,
            env=clean_env(),
            timeout=120,
        )
    finally:
        os.close(write)
    return done.returncode


def head_run(argv: list[str]) -> int:
    """``argv 2>&1 | head -1`` in a real shell; the command's own exit code."""
    command = " ".join(f"'{a}'" for a in argv) + " 2>&1 | head -1 >/dev/null; exit ${PIPESTATUS[0]}"
    return subprocess.run(["bash", "-c", command], env=clean_env(), timeout=120).returncode


def closed_run(argv: list[str]) -> int:
    """``argv >&- 2>&-``: stdout and stderr closed before the command starts."""
    command = " ".join(f"'{a}'" for a in argv) + " >&- 2>&-"
    return subprocess.run(["bash", "-c", command], env=clean_env(), timeout=120).returncode


def plain_run(argv: list[str]) -> int:
    return subprocess.run(argv, capture_output=True, env=clean_env(), timeout=120).returncode


@pytest.mark.parametrize(
    ("a", "b", "extra", "expected"),
    [
        ("a", "same", [], 0),  # equivalent
        ("a", "slow", ["--noise-floor", "5"], 1),  # a regression against a given floor
        ("a", "slow", [], 3),  # one a side, assumed floor: no answer
        ("a", "short", [], 3),  # too few steps: inconclusive
        ("a", "slow", ["--noise-floor-from", "a", "a2", "a3"], 1),  # a measured floor
    ],
)
def test_compare_gate_exit_code_holds_on_broken_and_closed_outputs(runs, a, b, extra, expected):
    extra = [runs.get(x, x) for x in extra]
    argv = [TRACEML, "compare", runs[a], runs[b], "--fail-on-regression", "5", *extra]
    assert plain_run(argv) == expected
    assert broken_pipe_run(argv, stderr_too=False) == expected
    assert broken_pipe_run(argv, stderr_too=True) == expected
    assert head_run(argv) == expected
    assert closed_run(argv) == expected


def test_report_exit_codes_hold(runs, tmp_path):
    good = [TRACEML, "report", runs["a"]]
    assert broken_pipe_run(good, stderr_too=True) == 0
    assert head_run(good) == 0
    assert closed_run(good) == 0
    bad = [TRACEML, "report", str(tmp_path)]  # not a run: exit 2, whatever stderr is
    assert plain_run(bad) == 2
    assert broken_pipe_run(bad, stderr_too=True) == 2
    assert closed_run(bad) == 2


def test_run_passes_the_script_exit_code_through_broken_outputs(tmp_path):
    script = tmp_path / "quits.py"
    script.write_text("import sys\nsys.exit(7)\n")
    argv = [TRACEML, "run", str(script), "--logs-dir", str(tmp_path / "logs")]
    for index, runner in enumerate((plain_run, head_run, closed_run)):
        named = [*argv, "--run-name", f"r{index}"]
        assert runner(named) == 7, runner.__name__
    assert broken_pipe_run([*argv, "--run-name", "broken"], stderr_too=True) == 7


def test_a_crash_inside_traceml_has_its_own_exit_code(runs):
    # A fault injected into the comparison itself, in a real process: exit 70, never 1 (the
    # gate's "regression"), with a line saying it is traceml's bug; under a broken pipe too.
    code = (
        "import sys, traceml.compare_command as c\n"
        "def broken(*a, **k): raise RuntimeError('injected')\n"
        "c.compare = broken\n"
        "from traceml.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = [PYTHON, "-c", code, "compare", runs["a"], runs["slow"], "--fail-on-regression", "5"]
    done = subprocess.run(argv, capture_output=True, text=True, env=clean_env(), timeout=120)
    assert done.returncode == 70
    assert "RuntimeError: injected" in done.stderr
    assert "traceml: internal error (exit code 70)" in done.stderr
    assert broken_pipe_run(argv, stderr_too=True) == 70
    assert sys.executable  # the same interpreter as the tests
