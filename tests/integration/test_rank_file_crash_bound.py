"""The rank file's crash guarantee, on a real training killed with SIGKILL.

Step records are batched in memory and written by a flusher thread every
``sink.FLUSH_INTERVAL_S`` (250 ms). The promise (docs/overhead.md): a rank killed with SIGKILL
keeps every step it finished before the last 250 ms. Checked against the training's own
ledger of finished steps, on a shared clock (CLOCK_MONOTONIC is system-wide on Linux).
"""

from __future__ import annotations

import random
import signal
import subprocess
import time

import orjson
import pytest

from traceml import schema
from traceml.capture.sink import FLUSH_INTERVAL_S
from traceml.step_record import STEP_KEYS
from traceml.step_rows import row_records

from procs import PYTHON, SCRIPTS, traced_env

LEDGER = SCRIPTS / "ledger_lightning.py"
# Scheduling on a loaded 2-core machine: the flusher may wait for the GIL and a core.
SLACK_S = 0.15
STEP_MS = 2  # the ledger script's step


def steps_on_disk(path) -> list[int]:
    steps = []
    for line in path.read_bytes().splitlines():
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a last line cut by the kill (the reducer tolerates it too)
        if record.get("kind") == "step":
            steps.append(record[STEP_KEYS[schema.STEP_INDEX]])
        elif record.get("kind") == schema.KIND_STEP_ROWS:  # the usual steps of one flush
            steps.extend(row[STEP_KEYS[schema.STEP_INDEX]] for row in row_records(record))
    return steps


def kill_while_training(tmp_path, name: str, seed: int) -> tuple[list[int], list[int], int]:
    ledger = tmp_path / f"{name}.ledger"
    env = traced_env(tmp_path / "logs", name, LEDGER_PATH=ledger, LEDGER_STEP_MS=STEP_MS)
    process = subprocess.Popen(
        [PYTHON, str(LEDGER)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 180
        # Enough steps that 200 of them lie before the kill's bound.
        before_kill = 200 + int((FLUSH_INTERVAL_S + SLACK_S) * 1000 / STEP_MS) + 100
        while not (ledger.exists() and ledger.read_bytes().count(b"\n") >= before_kill):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"training did not reach {before_kill} steps: {process.stderr.read()[-2000:]}"
                )
            time.sleep(0.02)
        time.sleep(random.Random(seed).uniform(0, 2 * FLUSH_INTERVAL_S))
        killed_at = time.monotonic_ns()
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    ledger_steps = [tuple(map(int, line.split())) for line in ledger.read_text().splitlines()]
    finished = [index for index, at in ledger_steps if at <= killed_at]
    bound_ns = int((FLUSH_INTERVAL_S + SLACK_S) * 1e9)
    must_keep = sum(1 for _, at in ledger_steps if at <= killed_at - bound_ns)
    return steps_on_disk(tmp_path / "logs" / name / "ranks" / "rank_0.jsonl"), finished, must_keep


@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_loses_at_most_the_last_flush_interval(tmp_path, seed):
    on_disk, finished, must_keep = kill_while_training(tmp_path, f"kill{seed}", seed)
    assert on_disk == list(range(len(on_disk)))  # in order, none missing in between
    assert len(on_disk) <= len(finished)
    # Every step finished before the last FLUSH_INTERVAL_S (+ scheduling slack) is on disk.
    assert len(on_disk) >= must_keep, (len(on_disk), must_keep, len(finished))
    # And batching is real: the records were not all written at the kill.
    assert must_keep >= 200
