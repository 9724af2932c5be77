"""A traced training process loads the capture side only, even while it prints the report."""

from __future__ import annotations

import pytest

from procs import PYTHON, SCRIPTS, TINY, clean_env, run

pytestmark = pytest.mark.integration

WINGS_THAT_READ_FILES = ("traceml.analysis", "traceml.present", "traceml.finalize", "traceml.cli")


def test_a_direct_launch_reports_without_loading_the_analysis_side(tmp_path):
    modules_file = tmp_path / "modules.txt"
    env = clean_env(
        TRACEML="1",
        TRACEML_LOGS_DIR=tmp_path / "logs",
        TRACEML_RUN_NAME="boundary",
        MODULES_AT_EXIT=modules_file,
        TINY_BATCHES="6",
    )
    result = run([PYTHON, SCRIPTS / "modules_at_exit.py", TINY], env, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = modules_file.read_text().split()
    assert "traceml.capture.frameworks.lightning" in loaded  # it did trace
    assert [m for m in loaded if m.startswith(WINGS_THAT_READ_FILES)] == []
    # ... and the report still came, from the child process, on this process's stderr (the
    # script's stdout stays its own).
    run_dir = tmp_path / "logs" / "boundary"
    assert (run_dir / "final_summary.json").is_file()
    assert "Summary: " in result.stderr and "Summary: " not in result.stdout
