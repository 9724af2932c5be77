"""Telemetry on real Lightning training (issue 15): a model that leaks a tensor of known size
every step is called MEMORY_CREEP with the injected slope; the same model without the leak is
not; samples sit between the step records of the rank file."""

from __future__ import annotations

from pathlib import Path

from traceml import schema
from traceml.analysis.diagnose import diagnose
from traceml.analysis.reduce import reduce_run

from procs import PYTHON, TINY, clean_env, rank_records, run, tiny_result

LEAK_KIB = 2048
BATCHES = 200


def train(tmp_path: Path, leak_kib: int) -> dict:
    env = clean_env(
        TRACEML="1",
        TRACEML_RUN_NAME="mem",
        TRACEML_REPORT="0",
        TINY_BATCHES=str(BATCHES),
        TINY_STEP_SLEEP_MS="10",  # RSS is read at most every 50 ms: every ~5th step here
        TINY_VALIDATE="0",
        TINY_LEAK_KIB=str(leak_kib),
    )
    result = run([PYTHON, TINY], env, tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert tiny_result(result.stdout)["global_step"] == BATCHES
    return reduce_run(tmp_path / "logs" / "mem")


def test_leak_is_memory_creep_with_the_injected_slope(tmp_path: Path) -> None:
    summary = train(tmp_path, LEAK_KIB)
    verdicts = {v[schema.VERDICT_KIND]: v for v in diagnose(summary)}
    creep = verdicts[schema.VERDICT_MEMORY_CREEP]
    injected = LEAK_KIB / 1024 * 1000  # MB per 1,000 steps
    slope = creep[schema.VERDICT_EVIDENCE]["slope_mb_per_1k_steps"]
    assert abs(slope / injected - 1) < 0.20, slope
    assert creep[schema.VERDICT_EVIDENCE]["basis"] == "rss"

    records = rank_records(tmp_path / "logs" / "mem")
    kinds = [r["kind"] for r in records]
    samples = [r for r in records if r["kind"] == schema.KIND_SAMPLE]
    assert samples, "no telemetry samples in the rank file"
    # Interleaved: the first is written with the first step record, the last before the footer.
    assert kinds.index(schema.KIND_SAMPLE) < len(kinds) - 2 and kinds[-2] == schema.KIND_SAMPLE
    assert all(s[schema.HOST_MEM_TOTAL] > s[schema.HOST_MEM_AVAILABLE] > 0 for s in samples)
    telemetry = summary[schema.SUMMARY_RANKS][0][schema.TELEMETRY]
    assert telemetry[schema.HOST_MEMORY]["total_bytes"] > 0
    assert telemetry[schema.CHARTS]["memory"]


def test_no_leak_no_memory_creep(tmp_path: Path) -> None:
    summary = train(tmp_path, 0)
    kinds = {v[schema.VERDICT_KIND] for v in diagnose(summary)}
    assert schema.VERDICT_MEMORY_CREEP not in kinds
    trend = summary[schema.SUMMARY_RANKS][0][schema.TELEMETRY][schema.MEMORY_TREND]["rss"]
    assert abs(trend["slope_mb_per_1k_steps"]) < 0.05 * LEAK_KIB / 1024 * 1000
