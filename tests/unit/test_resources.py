"""Telemetry in the summary and its verdicts (issue 15), from synthetic rank files with
"sample" records: MEMORY_CREEP on device memory, LOW_DEVICE_UTILIZATION naming the host phase,
HOST_CPU_SATURATED, HOST_MEMORY_PRESSURE, memory imbalance, and files without samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from traceml import schema
from traceml.analysis.diagnose import diagnose
from traceml.analysis.reduce import read_rank_file, reduce_run
from traceml.present import report, report_html

from rankfiles import footer, header, step, write_rank

GIB = 2**30


def sample(at_step: int, **fields: Any) -> dict[str, Any]:
    return {
        schema.KIND: schema.KIND_SAMPLE,
        schema.AT_STEP: at_step,
        schema.T_START_MS: at_step * 100.0,
        **fields,
    }


def cuda_header(rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    record = header(rank, world_size)
    record[schema.DEVICE] = {"type": "cuda", "name": "H200", "total_memory_bytes": 80 * GIB}
    return record


def write(run_dir: Path, records_by_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    for rank, records in enumerate(records_by_rank):
        write_rank(run_dir, rank, records)
    summary = reduce_run(run_dir)
    summary[schema.SUMMARY_VERDICTS] = diagnose(summary)  # as finalize does
    return summary


def kinds(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v[schema.VERDICT_KIND]: v for v in diagnose(summary)}


def cuda_rank(steps: int = 60, leak_per_step: int = 0, busy_ms: float = 20.0) -> list[dict]:
    records = [cuda_header()]
    for index in range(steps):
        record = step(index, index * 101.0, input=60.0, forward=20.0, backward=15.0, residual=5.0)
        record[schema.GPU_FORWARD] = busy_ms / 2
        record[schema.GPU_BACKWARD] = busy_ms / 2
        record[schema.GPU_STEP] = busy_ms
        records.append(record)
        records.append(
            sample(
                index + 1,
                **{
                    schema.DEVICE_MEM_ALLOCATED: 10 * GIB + leak_per_step * index,
                    schema.DEVICE_MEM_RESERVED: 12 * GIB + leak_per_step * index,
                    schema.ALLOC_RETRIES: 3,
                    schema.DEVICE_OOMS: 0,
                    schema.NVML_GPU_UTIL_PCT: 30.0,
                },
            )
        )
    records.append(footer(steps))
    return records


def test_cuda_device_memory_creep_and_idle_device(tmp_path: Path) -> None:
    summary = write(tmp_path, [cuda_rank(leak_per_step=64 * 2**20)])
    telemetry = summary[schema.SUMMARY_RANKS][0][schema.TELEMETRY]
    assert telemetry[schema.DEVICE_MEMORY]["alloc_retries"] == 3
    assert telemetry[schema.DEVICE_MEMORY]["overhang_ratio"] > 1
    assert telemetry[schema.NVML]["gpu_util_pct_mean"] == 30.0
    assert telemetry[schema.DEVICE_BUSY]["share"] == 0.2
    verdicts = kinds(summary)
    creep = verdicts[schema.VERDICT_MEMORY_CREEP][schema.VERDICT_EVIDENCE]
    assert creep["basis"] == "device_allocated"
    assert round(creep["slope_mb_per_1k_steps"]) == 64_000
    # 80 GiB - ~13.7 GiB allocated at 64 MiB per step: ~1,060 steps left -> critical.
    assert (
        verdicts[schema.VERDICT_MEMORY_CREEP][schema.VERDICT_SEVERITY] == schema.SEVERITY_CRITICAL
    )
    assert 1000 < creep["projected_exhaustion_step"] < 1200
    idle = verdicts[schema.VERDICT_LOW_DEVICE_UTILIZATION]
    assert idle[schema.VERDICT_SEVERITY] == schema.SEVERITY_CRITICAL  # busy 20%
    assert idle[schema.VERDICT_EVIDENCE]["host_phase"] == schema.INPUT_WAIT
    text = report.render_text(summary)
    assert "MEMORY-CREEP" in text
    assert "Memory" in text
    html = report_html.render_html(summary)
    assert "memory over steps" in html.lower()


def test_steady_device_memory_no_creep(tmp_path: Path) -> None:
    summary = write(tmp_path, [cuda_rank(busy_ms=90.0)])
    verdicts = kinds(summary)
    assert schema.VERDICT_MEMORY_CREEP not in verdicts
    assert schema.VERDICT_LOW_DEVICE_UTILIZATION not in verdicts


def cpu_rank(
    system_pct: float, available: int, steps: int = 40, workers_pct: float = 350.0
) -> list[dict]:
    records = [header(num_workers=4)]
    for index in range(steps):
        records.append(step(index, index * 101.0, input=70.0, forward=20.0, backward=10.0))
        records.append(
            sample(
                index + 1,
                **{
                    schema.CPU_PROCESS_PCT: 30.0,
                    schema.CPU_WORKERS_PCT: workers_pct,
                    schema.CPU_SYSTEM_PCT: system_pct,
                    schema.CPU_COUNT: 4,
                    schema.HOST_MEM_AVAILABLE: available,
                    schema.HOST_MEM_TOTAL: 64 * GIB,
                },
            )
        )
    records.append(footer(steps))
    return records


def test_host_cpu_saturated_only_when_cores_are_busy(tmp_path: Path) -> None:
    busy = kinds(write(tmp_path / "busy", [cpu_rank(97.0, 32 * GIB)]))
    assert schema.VERDICT_INPUT_BOUND in busy and schema.VERDICT_HOST_CPU_SATURATED in busy
    evidence = busy[schema.VERDICT_HOST_CPU_SATURATED][schema.VERDICT_EVIDENCE]
    assert evidence["workers_cpu_pct"] == 350.0
    idle = kinds(write(tmp_path / "idle", [cpu_rank(40.0, 32 * GIB)]))
    assert schema.VERDICT_INPUT_BOUND in idle and schema.VERDICT_HOST_CPU_SATURATED not in idle
    assert schema.VERDICT_HOST_MEMORY_PRESSURE not in idle
    # Busy cores, but the 4 workers mostly wait (I/O, a slow store): more of them still help,
    # so the CPUs are not called the limit.
    waiting = kinds(write(tmp_path / "waiting", [cpu_rank(97.0, 32 * GIB, workers_pct=40.0)]))
    assert schema.VERDICT_INPUT_BOUND in waiting
    assert schema.VERDICT_HOST_CPU_SATURATED not in waiting


def test_host_memory_pressure(tmp_path: Path) -> None:
    verdicts = kinds(write(tmp_path, [cpu_rank(40.0, 2 * GIB)]))  # 97% in use
    pressure = verdicts[schema.VERDICT_HOST_MEMORY_PRESSURE]
    assert pressure[schema.VERDICT_SEVERITY] == schema.SEVERITY_CRITICAL


def test_memory_imbalance_and_files_without_samples(tmp_path: Path) -> None:
    ranks = []
    for rank, rss in ((0, 1 * GIB), (1, 3 * GIB)):
        records = [header(rank, 2)]
        for index in range(20):
            record = step(index, index * 10.0, forward=5.0, backward=5.0)
            record[schema.RSS] = rss
            records.append(record)
        ranks.append([*records, footer(20)])
    summary = write(tmp_path, ranks)
    memory = summary[schema.SUMMARY_IMBALANCE][schema.MEMORY_IMBALANCE]
    assert memory["rank"] == 1 and memory["max_over_median"] == 1.5
    telemetry = summary[schema.SUMMARY_RANKS][0][schema.TELEMETRY]
    assert telemetry["samples"] == 0 and telemetry[schema.HOST_CPU] is None
    assert schema.VERDICT_MEMORY_CREEP not in kinds(summary)
    report.render_text(summary)
    report_html.render_html(summary)


def test_reader_keeps_samples_on_the_fast_path(tmp_path: Path) -> None:
    records = [step(0), sample(1, **{schema.CPU_SYSTEM_PCT: 5.0}), step(1)]
    path = write_rank(tmp_path, 0, [header(), *records, footer(2)])
    data = read_rank_file(path, 0)
    assert data.step_count == 2 and len(data.samples) == 1
    path = write_rank(tmp_path, 1, records)  # no header/footer: only steps and samples
    data = read_rank_file(path, 1)
    assert data.step_count == 2 and len(data.samples) == 1


def test_compare_lists_memory_and_utilization_deltas(tmp_path: Path) -> None:
    from traceml.analysis.compare import compare
    from traceml.present.compare_text import render_comparison

    a = write(tmp_path / "a", [cpu_rank(40.0, 32 * GIB)])
    b = write(tmp_path / "b", [cpu_rank(80.0, 32 * GIB)])
    result = compare(a, b)
    host = result["resources"]["host_cpu_pct"]
    assert (host["a"], host["b"], host["change"]) == (40.0, 80.0, 40.0)
    assert "Host CPU (% of all cores): 40.0 -> 80.0 (+40.0)" in render_comparison(result)


def test_device_busy_share_is_the_same_whether_every_step_is_timed_or_not():
    # Every step timed on both sides takes a C-speed path; one step without device times
    # takes the step-by-step one. Both must give what walking the steps gives.
    import math
    import random

    from traceml.analysis.resources import _DEVICE_PHASES, _device_busy

    rng = random.Random(7)
    steps = [rng.uniform(5, 20) for _ in range(500)]
    columns = {schema.STEP: steps}
    for fieldname in _DEVICE_PHASES:
        columns[fieldname] = [rng.uniform(0, 6) for _ in steps]

    def walked(columns, skipped):
        busy = host = 0.0
        used = 0
        for index in range(skipped, len(steps)):
            phases = [columns[f][index] for f in _DEVICE_PHASES if columns[f][index] is not None]
            if not phases:
                continue
            busy += min(columns[schema.STEP][index], math.fsum(phases))
            host += columns[schema.STEP][index]
            used += 1
        return {"share": busy / host, "steps": used}

    assert _device_busy(columns, 10) == walked(columns, 10)
    assert _device_busy(columns, 10)["steps"] == 490
    gap = {name: list(values) for name, values in columns.items()}
    for fieldname in _DEVICE_PHASES:
        gap[fieldname][100] = None
    assert _device_busy(gap, 10) == walked(gap, 10)
    assert _device_busy(gap, 10)["steps"] == 489


def test_telemetry_beyond_the_value_bound_is_unmeasured_and_the_summary_writes(
    tmp_path: Path,
) -> None:
    # int(1e300) is a Python int that orjson cannot write: such a sample is damage, unmeasured.
    import orjson

    records = cuda_rank(steps=20)
    for record in records:
        if record.get(schema.KIND) == schema.KIND_SAMPLE:
            record[schema.WORKER_PROCESSES] = 1e300
            record[schema.CPU_SYSTEM_PCT] = 10.0
            record[schema.ALLOC_RETRIES] = 1e300
            record[schema.HOST_MEM_AVAILABLE] = 1e300
            record[schema.HOST_MEM_TOTAL] = 2e300
    summary = write(tmp_path, [records])
    telemetry = summary[schema.SUMMARY_RANKS][0][schema.TELEMETRY]
    assert telemetry[schema.HOST_CPU]["worker_processes_max"] is None
    assert telemetry[schema.DEVICE_MEMORY]["alloc_retries"] is None
    assert telemetry[schema.HOST_MEMORY] is None
    orjson.dumps(summary)


def test_device_busy_leaves_out_steps_whose_device_phases_went_unmeasured():
    # Backward timed on the host but not on the device is unknown device time, not idle: read
    # as 0 it made a compute-bound run LOW-DEVICE-UTILIZATION.
    from traceml.analysis.resources import _device_busy

    steps = 10
    columns = {
        schema.STEP: [100.0] * steps,
        schema.H2D: [None] * steps,  # no transfer seen: no device time either
        schema.FORWARD: [30.0] * steps,
        schema.BACKWARD: [60.0] * steps,
        schema.OPTIMIZER: [0.0] * steps,  # no optimizer step: none on the device either
        schema.GPU_H2D: [None] * steps,
        schema.GPU_FORWARD: [29.0] * steps,
        schema.GPU_BACKWARD: [None] * steps,
        schema.GPU_OPTIMIZER: [None] * steps,
    }
    assert _device_busy(columns, 0) is None
    columns[schema.GPU_BACKWARD] = [59.0] * 5 + [None] * 5
    assert _device_busy(columns, 0) == {"share": 0.88, "steps": 5}
