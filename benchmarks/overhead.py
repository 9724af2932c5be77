"""How much does tracing slow training down? Plain vs traced, alternating, in one invocation.

(a) RF-DETR Nano on CPU (the small config: 64 px, 20 queries, one query group), about 40
    optimizer steps per run.
(b) A Lightning stress case: a tiny MLP whose steps take ~1-3 ms, the worst case for a fixed
    per-step cost.

The time compared is the training loop itself: the sum of Lightning's per-batch loop body
(``_TrainingEpochLoop.advance``: fetch, transfer, forward, backward, optimizer, batch-end hooks),
wrapped identically in both variants, so validation, checkpoint writing and imports do not
dilute the ratio. Targets: <= 1% on (a), <= 20 us added per step on (b).

    python benchmarks/overhead.py                 # full run (~10 minutes on 2 cores)
    python benchmarks/overhead.py --pairs 2 --skip-rfdetr   # quick look
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from _common import PYTHON, RFDETR, TINY, alternate, clean_env, describe, paired_ratio, run, values


def loop_seconds(script: Path, env: dict[str, str], cwd: Path) -> tuple[float, float]:
    workdir = Path(env["RFD_WORKDIR"])
    try:
        result = run([PYTHON, script], env, cwd)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # a fresh dataset, no checkpoints kept
    timer = values(result.stdout, "LOOP_TIMER")
    return timer["seconds"], timer["batches"]


def bench(name: str, script: Path, pairs: int, workload: dict[str, object]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="traceml-overhead-") as tmp:
        work = Path(tmp)
        plain_env = clean_env(LOOP_TIMER="1", RFD_WORKDIR=work / "plain", **workload)
        traced_env = clean_env(
            LOOP_TIMER="1",
            RFD_WORKDIR=work / "traced",
            TRACEML="1",
            TRACEML_REPORT="0",
            TRACEML_LOGS_DIR=work / "logs",
            **workload,
        )
        counter = {"n": 0}
        batches: list[float] = []

        def plain() -> float:
            counter["n"] += 1
            env = dict(plain_env, RFD_WORKDIR=str(work / f"plain{counter['n']}"))
            seconds, count = loop_seconds(script, env, work)
            batches.append(count)
            return seconds

        def traced() -> float:
            counter["n"] += 1
            env = dict(
                traced_env,
                TRACEML_RUN_NAME=f"run{counter['n']}",
                RFD_WORKDIR=str(work / f"traced{counter['n']}"),
            )
            seconds, count = loop_seconds(script, env, work)
            batches.append(count)
            return seconds

        print(f"{name}: {pairs} pairs (plain vs traced)", flush=True)
        plain_s, traced_s = alternate(pairs, plain, traced, label=name)
    steps = statistics.median(batches)
    ratio, low, high = paired_ratio(plain_s, traced_s)
    added_us = [(t - p) / steps * 1e6 for p, t in zip(plain_s, traced_s, strict=True)]
    print(f"  plain  loop: {describe(plain_s, ' s')}")
    print(f"  traced loop: {describe(traced_s, ' s')}")
    print(f"  loop batches per run: {steps:.0f}")
    print(f"  traced/plain ratio: median {ratio:.4f} (min {low:.4f}, max {high:.4f})")
    print(
        f"  added per batch: median {statistics.median(added_us):.1f} us "
        f"(min {min(added_us):.1f}, max {max(added_us):.1f})"
    )
    return {"ratio": ratio, "added_us": statistics.median(added_us), "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--skip-rfdetr", action="store_true")
    parser.add_argument("--skip-stress", action="store_true")
    parser.add_argument("--stress-batches", type=int, default=3000)
    args = parser.parse_args()
    results = {}
    if not args.skip_rfdetr:
        results["rfdetr"] = bench(
            "rfdetr-nano-cpu",
            RFDETR,
            args.pairs,
            {"RFD_TRAIN_IMAGES": 40, "RFD_EPOCHS": 2, "RFD_SKIP_EVAL": 1},
        )
    if not args.skip_stress:
        results["stress"] = bench(
            "lightning-stress",
            TINY,
            args.pairs,
            {"TINY_BATCHES": args.stress_batches, "TINY_VALIDATE": 0},
        )
    parts = []
    if "rfdetr" in results:
        r = results["rfdetr"]
        parts.append(
            f"RF-DETR loop {100 * (r['ratio'] - 1):+.2f}% "
            f"({r['added_us']:.0f} us/step, target <= 1%)"
        )
    if "stress" in results:
        r = results["stress"]
        parts.append(
            f"stress {r['added_us']:.1f} us/step added, ratio {r['ratio']:.3f} (target <= 20 us)"
        )
    print("SUMMARY overhead: " + "; ".join(parts))


if __name__ == "__main__":
    main()
