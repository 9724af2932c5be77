"""Per-node partials on a real run (issue 24): 2 gloo ranks of real Lightning training under
torchrun; the report merged from partials equals the single-pass report, whether both ranks
are one node or (headers relabelled) two, and through the real commands: ``python -m
traceml.finalize node-partial`` on each node, then ``traceml report``."""

from __future__ import annotations

import json
import shutil

import orjson
import pytest

from traceml import schema
from traceml.analysis.partials import load_partials, reduce_node
from traceml.analysis.rankfile import run_rank_files
from traceml.analysis.reduce import reduce_run
from traceml.thresholds import resolve_thresholds

from procs import PYTHON, clean_env, run

WARMUP = 3


@pytest.fixture(scope="module")
def real_run(direct_ddp_run):
    """A real direct torchrun launch (shared, tests/integration/conftest.py): 40 steps per rank."""
    return direct_ddp_run.run_dir


def relabelled(real_run, target, node_of_rank):
    """A copy of the run whose rank headers say which node each rank ran on."""
    shutil.copytree(real_run / "ranks", target / "ranks")
    for rank, node in node_of_rank.items():
        path = target / "ranks" / f"rank_{rank}.jsonl"
        first, rest = path.read_bytes().split(b"\n", 1)
        head = orjson.loads(first)
        head[schema.NODE_RANK], head[schema.LOCAL_RANK] = node, 0
        path.write_bytes(orjson.dumps(head) + b"\n" + rest)
    return target


def summary_of(run_dir):
    summary = reduce_run(run_dir, thresholds={"warmup_steps": WARMUP})
    for key in (schema.SUMMARY_GENERATED_AT, schema.SUMMARY_RUN_DIR):
        summary.pop(key)
    return summary


@pytest.mark.parametrize("layout", [{0: 0, 1: 0}, {0: 0, 1: 1}], ids=["one-node", "two-nodes"])
def test_merged_partials_equal_the_single_pass_on_a_real_run(real_run, tmp_path, layout):
    single = summary_of(relabelled(real_run, tmp_path / "single", layout))
    merged_dir = relabelled(real_run, tmp_path / "merged", layout)
    for node in sorted(set(layout.values())):
        assert reduce_node(merged_dir, node, WARMUP) is not None
    files, _ = run_rank_files(merged_dir)
    assert load_partials(merged_dir, files, WARMUP).covered == {0, 1}  # no rank file read
    merged = summary_of(merged_dir)
    assert merged == single
    assert merged[schema.SUMMARY_STEPS_RECORDED] >= 2 * 30
    assert merged[schema.SUMMARY_JOB_SERIES]["ranks"] == 2


def test_the_commands_merge_partials_into_the_same_report(real_run, tmp_path):
    single_dir = relabelled(real_run, tmp_path / "single", {0: 0, 1: 1})
    merged_dir = relabelled(real_run, tmp_path / "merged", {0: 0, 1: 1})
    for node in (0, 1):
        made = run(
            [PYTHON, "-m", "traceml.finalize", "node-partial", merged_dir, "--node", node],
            clean_env(),
            tmp_path,
        )
        assert made.returncode == 0, made.stderr
    files, _ = run_rank_files(merged_dir)
    warmup = int(resolve_thresholds(None)["warmup_steps"])  # the commands' default
    assert load_partials(merged_dir, files, warmup).covered == {0, 1}  # what report reads
    reports = {}
    for name, run_dir in (("single", single_dir), ("merged", merged_dir)):
        report = run([PYTHON, "-m", "traceml", "report", run_dir], clean_env(), tmp_path)
        assert report.returncode == 0, report.stderr
        summary = json.loads((run_dir / schema.SUMMARY_JSON).read_text())
        for key in (schema.SUMMARY_GENERATED_AT, schema.SUMMARY_RUN_DIR):
            summary.pop(key)
        reports[name] = (summary, report.stdout.replace(str(run_dir), "RUN"))
    assert reports["merged"][0] == reports["single"][0]
    assert reports["merged"][1] == reports["single"][1]
    # Node 1 died before reducing: its rank file is read instead, and the report says so.
    (merged_dir / schema.PARTIALS_DIR / "node_1.json").unlink()
    report = run([PYTHON, "-m", "traceml", "report", merged_dir], clean_env(), tmp_path)
    assert report.returncode == 0, report.stderr
    notes = json.loads((merged_dir / schema.SUMMARY_JSON).read_text())[schema.SUMMARY_NOTES]
    assert any("node 1" in note and "rank files were read" in note for note in notes)
