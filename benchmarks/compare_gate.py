"""The CI recipe of docs/compare.md on real repeated RF-DETR runs (issue 25).

Nine traced RF-DETR Nano CPU runs under ``traceml run``, interleaved (base, same, slow, base,
...) so that a machine getting busier hits every set alike: ``base1..3`` and ``same1..3`` are
identical, ``slow1..3`` add GATE_SLOW_MS to every optimizer step (a real regression of about
+30% of the step). Then the gate, as CI would run it (``traceml compare ... --fail-on-regression
5``), counting exit codes:

* identical runs one a side, default floor: every pair (15); the gate must never exit 1;
* identical runs one a side, with a floor measured by ``--noise-floor-from`` on three others;
* identical runs three a side (base vs same): never 1;
* the regression three a side (base vs slow): 1;
* the regression one a side with the measured floor: 1.

Prints a table; assert nothing (benchmarks/_common.py). About 5 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import PYTHON, ROOT, clean_env

TRACEML = str(Path(sys.executable).parent / "traceml")
WORKLOAD = Path(__file__).resolve().parent / "gate_workload.py"


def traced_run(logs: Path, name: str, images: int, slow_ms: float) -> None:
    env = clean_env(RFD_TRAIN_IMAGES=images, RFD_SKIP_EVAL=1, GATE_SLOW_MS=slow_ms)
    with tempfile.TemporaryDirectory() as work:
        env["RFD_WORKDIR"] = work
        command = [TRACEML, "run", str(WORKLOAD), "--logs-dir", str(logs), "--run-name", name]
        done = subprocess.run(
            [*command, "--no-report", "--no-live"],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    if done.returncode != 0:
        raise RuntimeError(f"{name} exited {done.returncode}:\n{done.stderr[-3000:]}")


def gate(*args: str) -> int:
    command = [TRACEML, "compare", *args, "--fail-on-regression", "5"]
    return subprocess.run(command, capture_output=True, timeout=120, env=clean_env()).returncode


def step_ms(logs: Path, name: str) -> float:
    import orjson

    summary = orjson.loads((logs / name / "final_summary.json").read_bytes())
    return summary["job_series"]["fields"]["step_ms"]["mean"]


def counts(codes: list[int]) -> str:
    return "  ".join(f"exit {c}: {codes.count(c)}" for c in sorted(set(codes)))


def measure(logs: Path, images: int, slow_ms: float) -> list[str]:
    names = {"base": [], "same": [], "slow": []}
    for index in range(1, 4):
        for kind in ("base", "same", "slow"):
            name = f"{kind}{index}"
            started = time.perf_counter()
            traced_run(logs, name, images, slow_ms if kind == "slow" else 0.0)
            print(f"  {name}: {time.perf_counter() - started:.0f} s", flush=True)
            names[kind].append(name)
    path = {name: str(logs / name) for kind in names.values() for name in kind}
    means = {name: step_ms(logs, name) for name in path}
    identical = names["base"] + names["same"]
    lines = ["mean step time per run (ms): " + ", ".join(f"{n} {means[n]:.0f}" for n in path)]
    one_a_side = [gate(path[a], path[b]) for a, b in itertools.combinations(identical, 2)]
    lines.append(f"identical, 1 a side, default floor (15 pairs): {counts(one_a_side)}")
    floor = ["--noise-floor-from", *(path[n] for n in names["base"])]
    measured = [gate(path[a], path[b], *floor) for a, b in itertools.combinations(names["same"], 2)]
    lines.append(f"identical, 1 a side, floor from base1-3 (3 pairs): {counts(measured)}")
    floor_text = subprocess.run(
        [TRACEML, "compare", *floor], capture_output=True, text=True, env=clean_env()
    ).stdout.splitlines()[0]
    lines.append(f"  {floor_text}")
    three = gate(*(path[n] for n in names["base"]), "--vs", *(path[n] for n in names["same"]))
    lines.append(f"identical, 3 a side (base vs same): exit {three}")
    slow3 = gate(*(path[n] for n in names["base"]), "--vs", *(path[n] for n in names["slow"]))
    lines.append(f"+{slow_ms:g} ms per optimizer step, 3 a side (base vs slow): exit {slow3}")
    same_floor = ["--noise-floor-from", *(path[n] for n in names["same"])]
    slow1 = [
        gate(path[b], path[s], *same_floor)
        for b, s in zip(names["base"], names["slow"], strict=True)
    ]
    lines.append(f"the same regression, 1 a side, floor from same1-3: {counts(slow1)}")
    slow_default = [
        gate(path[b], path[s]) for b, s in zip(names["base"], names["slow"], strict=True)
    ]
    lines.append(f"the same regression, 1 a side, default floor: {counts(slow_default)}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=48, help="training images per run (48)")
    parser.add_argument(
        "--slow-ms", type=float, default=100.0, help="added to each optimizer step (100)"
    )
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as logs:
        lines = measure(Path(logs), args.images, args.slow_ms)
    print(f"$ python benchmarks/compare_gate.py --images {args.images} --slow-ms {args.slow_ms:g}")
    print(f"RF-DETR Nano, CPU, {args.images} images (batch 2), 9 runs interleaved; gate 5%")
    for line in lines:
        print(line)
    print(f"elapsed {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    assert PYTHON
    sys.exit(main())
