"""The input pipeline's breakdown on real Lightning (issue 16): an injected slow __getitem__ is
attributed to the dataset and a slow collate_fn to collate, within 10%, in the training process
and with 2 forked, spawned and forkserver workers; non-persistent workers' start-up is measured
at every epoch."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from procs import PYTHON, SCRIPTS, clean_env, rank_records, run, steps_written, traced_env

SCRIPT = SCRIPTS / "input_pipeline.py"
# Long enough that the dataset's own work (random tensors, a fresh worker's first torch call)
# and sleep overshoot on a loaded 2-core host stay well inside the 10%.
SLEEP_MS = 100.0


def inputs_of(tmp_path, **knobs):
    env = traced_env(
        tmp_path / "logs",
        "a",
        **{"IP_BATCH_SIZE": 2, "IP_BATCHES": 6, **knobs},
    )
    result = run([PYTHON, SCRIPT], env, tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "IP_RESULT" in result.stdout  # the script checked the user's objects came back
    return [r for r in rank_records(tmp_path / "logs" / "a") if r["kind"] == "input"]


def totals(records):
    producers = [p for r in records for p in r["producers"]]
    return {
        key: sum(p[key] for p in producers)
        for key in ("batches", "samples", "getitem_ms", "collate_ms")
    }


# (workers, start method): in the training process; forked workers (named: Python 3.14's
# default is forkserver); spawned and forkserver workers, which unpickle the dataset, time
# their own copy (the worker_init_fn wrapper) and report through a file-backed map, removed
# at the end.
PIPELINES = [(0, None), (2, "fork"), (2, "spawn"), (2, "forkserver")]


@pytest.mark.parametrize(
    ("workers", "method"), PIPELINES, ids=["0", "2-fork", "2-spawn", "2-forkserver"]
)
def test_a_slow_getitem_and_a_slow_collate_are_each_attributed(tmp_path, workers, method):
    # Both slow in one run, by different amounts: a swap, or either leaking into the other,
    # takes one of them outside its 10%. (One run per pipeline: issue 21, suite time.)
    getitem_ms, collate_ms = SLEEP_MS, 1.5 * SLEEP_MS
    shm = Path("/dev/shm")
    before = set(shm.glob("traceml-input-*")) if shm.is_dir() else set()
    context = {"IP_MP_CONTEXT": method} if method else {}
    records = inputs_of(
        tmp_path,
        IP_NUM_WORKERS=workers,
        IP_GETITEM_SLEEP_MS=getitem_ms,
        IP_COLLATE_SLEEP_MS=collate_ms,
        **context,
    )
    assert [r["num_workers"] for r in records] == [workers]
    if workers:
        assert records[0]["start_method"] == method
    if workers:
        assert sorted(p["worker"] for p in records[0]["producers"]) == [0, 1]
    sums = totals(records)
    assert sums["batches"] == 6 and sums["samples"] == 12
    per_sample = sums["getitem_ms"] / sums["samples"]
    assert getitem_ms <= per_sample <= 1.10 * getitem_ms, per_sample
    per_batch = sums["collate_ms"] / sums["batches"]
    assert collate_ms <= per_batch <= 1.10 * collate_ms, per_batch
    after = set(shm.glob("traceml-input-*")) if shm.is_dir() else set()
    assert after <= before


def test_worker_start_up_is_measured_at_every_epoch(tmp_path):
    start_ms = 300.0
    records = inputs_of(
        tmp_path, IP_NUM_WORKERS=2, IP_EPOCHS=3, IP_WORKER_START_MS=start_ms, IP_BATCHES=2
    )
    assert [r["epoch"] for r in records] == [0, 1, 2]
    for record in records:
        assert start_ms <= record["worker_startup_ms"] <= start_ms * 1.5, record
        assert record["first_batch_ms"] >= record["worker_startup_ms"]


def test_persistent_workers_start_once(tmp_path):
    records = inputs_of(
        tmp_path,
        IP_NUM_WORKERS=2,
        IP_EPOCHS=2,
        IP_PERSISTENT=1,
        IP_WORKER_START_MS=300,
        IP_BATCHES=2,
    )
    assert records[0]["worker_startup_ms"] >= 300
    assert records[1]["worker_startup_ms"] is None
    assert totals(records[1:])["batches"] == 2


# RF-DETR's own __getitem__ at 64 px is a few ms, tens on a loaded 2-core host: inside 10%.
RFDETR_SLEEP_MS = 200.0


@pytest.mark.parametrize("workers", [0, 2])
def test_rfdetr_slow_dataset_is_attributed_to_getitem(tmp_path, workers):
    pytest.importorskip("rfdetr")
    env = traced_env(
        tmp_path / "logs",
        "a",
        RFD_WORKDIR=tmp_path / "work",
        RFI_NUM_WORKERS=workers,
        RFI_GETITEM_SLEEP_MS=RFDETR_SLEEP_MS,
    )
    result = run([PYTHON, SCRIPTS / "rfdetr_input.py"], env, tmp_path, timeout=300)
    shutil.rmtree(tmp_path / "work", ignore_errors=True)  # ~0.7 GB of RF-DETR checkpoints
    assert result.returncode == 0, result.stderr[-3000:]
    records = [r for r in rank_records(tmp_path / "logs" / "a") if r["kind"] == "input"]
    assert [r["num_workers"] for r in records] == [workers]
    sums = totals(records)
    # 16 images, batch 2: RF-DETR's sampler gives 8 batches.
    assert sums["batches"] == 8 and sums["samples"] == 16
    per_sample = sums["getitem_ms"] / sums["samples"]
    assert RFDETR_SLEEP_MS <= per_sample <= 1.10 * RFDETR_SLEEP_MS, per_sample
    assert sums["collate_ms"] < 0.10 * sums["getitem_ms"]


def test_a_killed_training_leaves_no_counters_file(tmp_path):
    """SIGKILL (the OOM killer) gives traceml no chance to clean up: the spawned workers'
    counters file must still go (multiprocessing's resource tracker removes it)."""
    import os
    import signal
    import subprocess
    import time

    env = traced_env(
        tmp_path / "logs",
        "a",
        IP_BATCH_SIZE=2,
        IP_BATCHES=400,
        IP_NUM_WORKERS=1,
        IP_MP_CONTEXT="spawn",
        IP_STEP_SLEEP_MS=50,
    )
    process = subprocess.Popen(
        [str(PYTHON), str(SCRIPT)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    shm = Path("/dev/shm")
    mine = f"traceml-input-{process.pid}-"
    rank_file = tmp_path / "logs" / "a" / "ranks" / "rank_0.jsonl"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if steps_written(rank_file) >= 1:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the training never reached a step")
        assert [p for p in shm.glob(mine + "*")], "no counters file while training"
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(30)
    deadline = time.monotonic() + 60
    while list(shm.glob(mine + "*")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not list(shm.glob(mine + "*"))


def test_reloaded_dataloaders_leave_no_old_workers_and_say_what_is_timed(tmp_path):
    # traceml held the previous epoch's fetcher until its next hook: its workers were alive
    # (4 processes, not 2) when the new epoch began, and their shutdown was traceml's cost.
    # The input breakdown covered the first epoch's DataLoader only, silently.
    script = SCRIPTS / "lightning_shapes.py"
    plain = run([PYTHON, script], clean_env(SHAPE="reloading"), tmp_path)
    env = traced_env(tmp_path / "logs", "traced", SHAPE="reloading")
    traced = run([PYTHON, script], env, tmp_path)
    assert plain.returncode == traced.returncode == 0, traced.stderr[-3000:]
    counts = [line for line in traced.stdout.splitlines() if line.startswith("EPOCH")]
    assert counts == [line for line in plain.stdout.splitlines() if line.startswith("EPOCH")]
    assert len(counts) == 3
    records = rank_records(tmp_path / "logs" / "traced")
    notes = [r["message"] for r in records if r["kind"] == "event"]
    assert sum("timed for the first DataLoader only" in n for n in notes) == 1, notes
