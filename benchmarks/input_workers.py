"""Does the INPUT_BOUND advice predict the Input Wait of a run with more workers? (issue 16)

Runs tests/integration/scripts/input_pipeline.py traced with few workers (each sample sleeps in
__getitem__, each step in training_step), takes the advice's predicted Input Wait for more
workers from that run's summary, then runs with that many workers and measures it. Target:
within 25% (or 3 ms, for waits near zero).

    .venv/bin/python benchmarks/input_workers.py [workers_before] [workers_after]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "integration" / "scripts" / "input_pipeline.py"
sys.path.insert(0, str(ROOT))

from traceml import schema  # noqa: E402
from traceml.analysis import input_pipeline  # noqa: E402
from traceml.analysis.rankfile import read_records  # noqa: E402

KNOBS = {"IP_BATCH_SIZE": "2", "IP_BATCHES": "24", "IP_GETITEM_SLEEP_MS": "50",
         "IP_STEP_SLEEP_MS": "20"}  # fmt: skip
SKIP = 4  # first steps: worker start-up and the pipeline filling


def traced_run(workers: int, logs: Path) -> tuple[dict, list[float]]:
    env = {**os.environ, **KNOBS, "IP_NUM_WORKERS": str(workers), "TRACEML": "1",
           "TRACEML_LOGS_DIR": str(logs), "TRACEML_RUN_NAME": f"w{workers}",
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}  # fmt: skip
    subprocess.run([sys.executable, str(SCRIPT)], env=env, check=True, capture_output=True)
    run_dir = logs / f"w{workers}"
    summary = json.loads((run_dir / schema.SUMMARY_JSON).read_text())
    path = run_dir / schema.RANKS_DIR / schema.rank_file_name(0)
    # Step fields by name, whatever the rank schema (short keys, rows lines).
    steps = [r for r in read_records(path) if r is not None and r["kind"] == schema.KIND_STEP]
    return summary, [step[schema.INPUT_WAIT] for step in steps[SKIP:]]


def mean(values: list[float]) -> float:
    # Not the median: two workers finish their batches together, so waits alternate between
    # near zero and twice the mean; the model predicts the mean.
    return sum(values) / len(values)


def main() -> int:
    before = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    after = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    with tempfile.TemporaryDirectory() as tmp:
        summary, waits = traced_run(before, Path(tmp))
        phases = summary[schema.SUMMARY_OVERALL][schema.PHASE_STATS]
        step_ms = phases[schema.STEP]["mean"]
        wait_ms = phases[schema.INPUT_WAIT]["mean"]
        breakdown = summary[schema.SUMMARY_INPUT_PIPELINE]
        loop_ms = step_ms - wait_ms
        predicted = input_pipeline.predicted_input_wait_ms(breakdown, loop_ms, after)
        print(f"{before} workers: Input Wait mean {mean(waits):.1f} ms per step; "
              f"batch {breakdown['busy_ms_per_batch']:.1f} ms, loop {loop_ms:.1f} ms")  # fmt: skip
        for verdict in summary[schema.SUMMARY_VERDICTS]:
            if verdict[schema.VERDICT_KIND] == schema.VERDICT_INPUT_BOUND:
                print("advice:", verdict[schema.VERDICT_NEXT])
        summary_after, actual_waits = traced_run(after, Path(tmp))
        actual = mean(actual_waits)
        made = summary_after[schema.SUMMARY_INPUT_PIPELINE]
        print(f"{after} workers made a batch in {made['busy_ms_per_batch']:.1f} ms, "
              f"busy {made['worker_busy_share'] * 100:.0f}%")  # fmt: skip
    miss = abs(actual - predicted)
    ok = miss <= max(0.25 * actual, 3.0)
    print(f"{after} workers: predicted Input Wait {predicted:.1f} ms, actual mean "
          f"{actual:.1f} ms ({'within' if ok else 'OUTSIDE'} 25%)")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
