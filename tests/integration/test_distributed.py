"""Distributed truth on real training: torchrun, 2 gloo ranks, a known cost injected on rank 1.

Each case must name the right rank and the right phase, with the cost per step within 10% (or
5 ms) of what was injected; a balanced run names no straggler; a sleeping communication hook
on every rank is COMM_BOUND. RF-DETR brings its own collectives (the criterion's all_reduce of
the box count inside training_step, DDP's buffer broadcast in forward), EMA, checkpoints and
validation; the tiny Lightning model has only DDP's gradient buckets.
"""

from __future__ import annotations

import json
import shutil

import pytest

from traceml import schema

from procs import (
    PYTHON,
    SCRIPTS,
    clean_env,
    rank_records,
    run,
    steps_of,
    torchrun_2,
    traced_env,
)

RFD_DDP = SCRIPTS / "rfdetr_ddp.py"
TINY = SCRIPTS / "tiny_lightning.py"

# (where the cost goes, injected ms per item, injected ms per step, the phase traceml must
# name, extra settings)
RFDETR_CASES = [
    # 150 ms per image, 2 images per batch: 300 ms per step in the dataset.
    ("dataset", 150.0, 300.0, schema.INPUT_WAIT, {}),
    ("forward", 300.0, 300.0, schema.FORWARD, {}),
    # The encoder frozen: on this 2-core machine the gloo threads all-reducing the full model's
    # 100 MB of gradients take CPU from rank 1's own gradient computation while it catches up
    # (measured: +350 ms of Backward compute for +300 ms injected when the machine is busy,
    # +309 ms when it is quiet). That is real time on this machine, not a timing error; with
    # the decoder's gradients only, the all-reduce steals little and the injected cost shows.
    ("backward", 300.0, 300.0, schema.BACKWARD, {"RFD_FREEZE_ENCODER": "1"}),
]


def torchrun_traced(tmp_path, name: str, script, **extra) -> dict:
    env = traced_env(
        tmp_path / "logs",
        name,
        HF_HUB_OFFLINE="1",
        **extra,
    )
    result = run(
        torchrun_2(script),
        env,
        tmp_path,
        timeout=600,
    )
    shutil.rmtree(tmp_path / "work", ignore_errors=True)  # RF-DETR checkpoints
    assert result.returncode == 0, result.stderr[-4000:]
    return reported(tmp_path / "logs" / name, tmp_path)


def reported(run_dir, cwd) -> dict:
    """``traceml report`` on a run directory: its summary, with the report's text as ``_text``."""
    report = run([PYTHON, "-m", "traceml", "report", run_dir], clean_env(), cwd)
    assert report.returncode == 0, report.stderr
    summary = json.loads((run_dir / "final_summary.json").read_text())
    summary["_text"] = report.stdout
    return summary


def rfdetr(tmp_path, name: str, **extra) -> dict:
    return torchrun_traced(tmp_path, name, RFD_DDP, RFD_WORKDIR=tmp_path / "work", **extra)


def tiny(tmp_path, name: str, **extra) -> dict:
    # 20 ms of work per step: gloo's all-reduce of the tiny model (~1-2 ms on this machine) is
    # then a small share, as in real training; with ~5 ms steps a balanced run is legitimately
    # COMM_BOUND (measured: 26% of the step waiting).
    return torchrun_traced(
        tmp_path, name, TINY, TINY_VALIDATE=0, TINY_BATCHES=28, TINY_STEP_SLEEP_MS=20, **extra
    )


def verdict(summary: dict, kind: str) -> dict | None:
    return next((v for v in summary["verdicts"] if v["kind"] == kind), None)


def assert_straggler(summary: dict, phase: str, injected_ms: float) -> None:
    straggler = verdict(summary, "STRAGGLER")
    assert straggler is not None, summary["_text"]
    evidence = straggler["evidence"]
    assert evidence["rank"] == 1, summary["_text"]
    assert evidence["method"] == "waits"
    assert evidence["cause_phase"] == phase, summary["_text"]
    # The injected cost lands in the named phase within 10% (or 5 ms). The whole-step cost
    # carries every other phase's noise as well (two ranks share two cores here): looser
    # (seen at 26% in a CI run on a host 2.4x slower than usual).
    assert abs(evidence["excess_ms"][phase] - injected_ms) <= max(0.10 * injected_ms, 5.0), summary[
        "_text"
    ]
    assert abs(evidence["cost_ms_per_step"] - injected_ms) <= max(0.30 * injected_ms, 5.0), summary[
        "_text"
    ]
    # The per-rank table marks the rank with the most own time, not the longest step.
    assert summary["imbalance"]["slowest_rank"] == 1
    assert "(slowest)" in next(
        line for line in summary["_text"].splitlines() if line.startswith("  1 ")
    )
    assert verdict(summary, "COMM_BOUND") is None


@pytest.mark.parametrize(("where", "per_item_ms", "injected_ms", "phase", "extra"), RFDETR_CASES)
def test_rfdetr_straggler_is_named_with_its_phase(
    tmp_path, where, per_item_ms, injected_ms, phase, extra
):
    summary = rfdetr(
        tmp_path,
        where,
        RFD_SLOW_RANK=1,
        RFD_SLOW_WHERE=where,
        RFD_SLOW_MS=per_item_ms,
        **extra,
    )
    assert_straggler(summary, phase, injected_ms)
    records = steps_of(rank_records(tmp_path / "logs" / where, 0))
    # Rank 0 waited for rank 1 inside timed collectives; the phases still add up.
    assert all(r[schema.COMM] is not None and r[schema.COMM_COUNT] >= 1 for r in records)
    for record in records:
        assert abs(sum(record[p] for p in schema.PHASES) - record[schema.STEP]) < 0.001
        assert sum(record[f] for f in schema.COMM_OF_PHASE.values()) == pytest.approx(
            record[schema.COMM], abs=1e-6
        )


def test_rfdetr_balanced_run_names_no_straggler_and_times_every_wait(tmp_path):
    summary = rfdetr(tmp_path, "balanced")
    assert verdict(summary, "STRAGGLER") is None, summary["_text"]
    assert summary["setup"][schema.BUCKET_TIMING] == "on"
    records = steps_of(rank_records(tmp_path / "logs" / "balanced", 1))
    # DDP's gradient buckets, the criterion's all_reduce and DDP's buffer broadcast.
    assert min(r[schema.COMM_COUNT] for r in records) >= 3
    assert all(r[schema.COMM_BYTES] > 1_000_000 for r in records)
    assert "Comm wait" in summary["_text"]


def test_rfdetr_slow_interconnect_is_comm_bound(tmp_path):
    summary = rfdetr(tmp_path, "comm", RFD_COMM_DELAY_MS=80)
    comm = verdict(summary, "COMM_BOUND")
    assert comm is not None and comm["severity"] in ("warn", "critical"), summary["_text"]
    assert verdict(summary, "STRAGGLER") is None, summary["_text"]
    # The user's own hook was wrapped, not replaced: its sleep is timed as communication.
    assert summary["setup"][schema.BUCKET_TIMING] == "on"
    assert comm["evidence"]["least_share"] >= 0.25


@pytest.mark.parametrize(
    ("where", "phase"),
    [("fetch", schema.INPUT_WAIT), ("forward", schema.FORWARD), ("backward", schema.BACKWARD)],
)
def test_lightning_straggler_is_named_with_its_phase(tmp_path, where, phase):
    summary = tiny(
        tmp_path,
        where,
        TINY_SLOW_RANK=1,
        TINY_SLOW_WHERE=where,
        TINY_SLOW_RANK_EXTRA_MS=40,
        TINY_PACKAGE="pytorch_lightning",
    )
    assert_straggler(summary, phase, 40.0)


def report_of(run_dir, tmp_path) -> dict:
    """``traceml report`` on a copy of a finished run: its summary, with the text as ``_text``."""
    copy = tmp_path / run_dir.name
    shutil.copytree(run_dir / "ranks", copy / "ranks")
    return reported(copy, tmp_path)


def test_lightning_balanced_and_comm_bound(tmp_path, direct_ddp_run):
    # The balanced run is the shared direct launch (tests/integration/conftest.py): the same
    # 20 ms steps as tiny() above, 40 per rank.
    balanced = report_of(direct_ddp_run.run_dir, tmp_path)
    assert verdict(balanced, "STRAGGLER") is None, balanced["_text"]
    assert verdict(balanced, "COMM_BOUND") is None, balanced["_text"]
    slow_network = tiny(tmp_path, "comm", TINY_COMM_DELAY_MS=20)
    assert verdict(slow_network, "COMM_BOUND") is not None, slow_network["_text"]
    assert verdict(slow_network, "STRAGGLER") is None, slow_network["_text"]
