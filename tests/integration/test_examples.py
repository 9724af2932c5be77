"""The documented examples give the answers they promise (issue 25 item 3; docs/examples.md).

Each runs the documented command at CI size (``--resolution 64``, which only makes the model's
steps cheaper; the step counts that decide whether there is a verdict are the documented ones)
and asserts the promised answer: a verdict, not INSUFFICIENT-DATA; the compare example's Input
Wait change shown, not hidden. Offline: ``--no-pretrained``, synthetic data."""

from __future__ import annotations

import json

import pytest

from traceml import schema

from procs import EXAMPLE, clean_env, run, torchrun_2, traceml

CI_SIZE = ["--resolution", "64", "--no-pretrained", "--accelerator", "cpu"]


@pytest.fixture(autouse=True)
def _no_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def primary_verdict(run_dir) -> str:
    summary = json.loads((run_dir / schema.SUMMARY_JSON).read_text())
    return summary[schema.SUMMARY_VERDICTS][0][schema.VERDICT_KIND]


def run_compare_example(tmp_path):
    """docs/compare.md's example: the two runs and their compare; returns (the compare's
    result, its Input Wait row)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for workers in (0, 2):
        result = run(
            traceml(
                "run", EXAMPLE, "--logs-dir", tmp_path / "logs", "--run-name", f"workers{workers}",
                "--no-live", "--args", "--demo", "--output-dir", tmp_path / f"out{workers}",
                "--num-workers", str(workers), "--epochs", "2", "--read-latency-ms", "40", *CI_SIZE,
            ),
            clean_env(TMPDIR=tmp_path),
            tmp_path,
            timeout=900,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert "removed" in result.stderr and "checkpoints" in result.stderr
        assert not list((tmp_path / f"out{workers}").rglob("*.pth"))  # cleaned up, as said
        verdict = primary_verdict(tmp_path / "logs" / f"workers{workers}")
        assert verdict != schema.VERDICT_INSUFFICIENT_DATA
        assert result.stderr.rstrip().splitlines()[-1].startswith("Summary: ")
        summary_path = tmp_path / "logs" / f"workers{workers}" / schema.SUMMARY_JSON
        summary = json.loads(summary_path.read_text())
        assert summary["setup"]["num_workers"] == workers
    output = tmp_path / "comparisons" / "w0_vs_w2"
    result = run(
        traceml(
            "compare", tmp_path / "logs" / "workers0", tmp_path / "logs" / "workers2",
            "--output", output,
        ),
        clean_env(),
        tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # The files say what the terminal said; each phase row is there, and a phase is named as
    # moved exactly when its change is significant.
    assert (tmp_path / "comparisons" / "w0_vs_w2.txt").read_text() == result.stdout
    data = json.loads((tmp_path / "comparisons" / "w0_vs_w2.json").read_text())
    assert data["changes"] == ["DataLoader workers: 0 -> 2"]
    for label in ("Input Wait", "Forward", "Backward", "Optimizer", "Residual", "Step"):
        assert f"  {label}" in result.stdout
    for fieldname in schema.PHASES:
        entry = data["fields"][fieldname]
        assert (entry["label"] in data["phases_that_moved"]) == bool(entry.get("significant"))
    row = next(line for line in result.stdout.splitlines() if line.startswith("  Input Wait"))
    return result, row


def test_compare_example_shows_what_more_workers_changed(tmp_path):
    # docs/compare.md: workers0 vs workers2 reading from "slow storage" (40 ms a read), 2 epochs
    # each, then compare. On two busy cores more workers cannot speed up decoding (they compete
    # with training for the cores: measured, Input Wait 11.0 -> 11.4 ms without the latency);
    # they do hide waiting, which is what the example shows.
    result, row = run_compare_example(tmp_path / "first")
    if "hidden:" in row:
        # compare itself says the machine moved too much to tell (seen once in
        # CI: every phase +48% in one run, drift 40%): that is compare being honest, not the
        # example failing. Measure once more; the second pair must give the answer.
        result, row = run_compare_example(tmp_path / "again")
    # The promised answer: Input Wait fell, a real change the Phases line names.
    assert row.endswith("faster"), result.stdout
    moved = next(x for x in result.stdout.splitlines() if x.startswith("Phases that moved: "))
    assert "Input Wait" in moved, result.stdout
    assert "Changed between the runs: DataLoader workers: 0 -> 2" in result.stdout


def test_direct_ddp_example_with_three_epochs_gives_a_verdict(tmp_path):
    # docs/usage.md: TRACEML=1 torchrun --standalone --nproc-per-node 2 ... With 1 epoch the
    # 32 demo images give 8 steps per rank (6 after warm-up): INSUFFICIENT-DATA. 3 epochs: 24.
    env = clean_env(
        TRACEML="1", TRACEML_LOGS_DIR=tmp_path / "logs", TRACEML_RUN_NAME="direct-ddp",
        TMPDIR=tmp_path,
    )  # fmt: skip
    result = run(
        torchrun_2(
            EXAMPLE, "--demo", "--output-dir", tmp_path / "out", "--epochs", "3", *CI_SIZE
        ),
        env,
        tmp_path,
        timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "logs" / "direct-ddp"
    summary = json.loads((run_dir / schema.SUMMARY_JSON).read_text())
    assert [r[schema.SUMMARY_STEPS_RECORDED] for r in summary[schema.SUMMARY_RANKS]] == [24, 24]
    assert primary_verdict(run_dir) != schema.VERDICT_INSUFFICIENT_DATA
    text = (run_dir / "final_summary.txt").read_text()
    assert "22 of 24 steps per rank analysed" in text.splitlines()[0]
