"""Running real processes in tests: environment, timeouts, and reading what traceml wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Figures a passing test measured and wants in the run's log (tests/conftest.py prints them at
# the end: pytest shows nothing of a passing test otherwise).
FIGURES: list[str] = []

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "integration" / "scripts"
TINY = SCRIPTS / "tiny_lightning.py"
EXAMPLE = ROOT / "examples" / "integrations" / "rfdetr_minimal.py"
PYTHON = sys.executable
BIN = Path(sys.executable).parent


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any TRACEML_* or torchrun variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TRACEML", "TINY_", "TORCHELASTIC"))
        and k
        not in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GROUP_RANK",
            "NODE_RANK",
        )
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def traced_env(logs_dir: Path, run_name: str, **extra: object) -> dict[str, str]:
    """``clean_env`` for a traced run written to ``logs_dir/run_name``, with no report at the
    end (the tests read the rank files and summaries themselves)."""
    return clean_env(
        TRACEML="1",
        TRACEML_LOGS_DIR=logs_dir,
        TRACEML_RUN_NAME=run_name,
        TRACEML_REPORT="0",
        **extra,
    )


def warning_lines(stderr: str) -> list[str]:
    """traceml's warning lines, without the informational announcement of a direct launch
    ('traceml: tracing into <dir>; to watch it live: ...')."""
    return [
        line
        for line in stderr.splitlines()
        if line.startswith("traceml:") and "to watch it live:" not in line
    ]


def run(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 300):
    return subprocess.run(
        [str(a) for a in args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def traceml(*args: str) -> list[str]:
    return [str(BIN / "traceml"), *args]


def torchrun_2(script: object, *args: object) -> list[object]:
    """``torchrun --standalone --nproc-per-node 2 script args...``: 2 gloo ranks on this host."""
    return [BIN / "torchrun", "--standalone", "--nproc-per-node", "2", script, *args]


def rank_records(run_dir: Path, rank: int = 0) -> list[dict]:
    """Every record of a rank file; a compact step record (rank schema 1.3) reads every field,
    null where unmeasured, as the reducer reads it."""
    from traceml.analysis.rankfile import read_records

    return read_records(run_dir / "ranks" / f"rank_{rank}.jsonl")


def steps_written(path: Path) -> int:
    """Steps on disk so far, for a test that waits on a running process's rank file: a rows
    line (rank schema 3.0) counts its rows; a line still being written is not counted."""
    import orjson

    if not path.exists():
        return 0
    count = 0
    for line in path.read_bytes().splitlines():
        if b'"kind":"step"' in line:
            count += 1
        elif b'"kind":"steps"' in line:
            try:
                count += len(orjson.loads(line)["rows"])
            except orjson.JSONDecodeError:
                pass
    return count


def steps_of(records: list[dict]) -> list[dict]:
    return [r for r in records if r["kind"] == "step"]


def only_run_dir(logs: Path) -> Path:
    dirs = [p for p in logs.iterdir() if p.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def tiny_result(stdout: str) -> dict[str, int]:
    line = next(line for line in stdout.splitlines() if line.startswith("TINY_RESULT"))
    return {k: int(v) for k, v in (item.split("=") for item in line.split()[1:])}
