"""Does traceml put injected time in the right phase, and name the right bottleneck?

Runs the tiny Lightning workload traced: once with no injection (the baseline cost of each
phase), then with a known sleep injected into one place per run: the DataLoader (Input Wait),
the model forward (Forward), the optimizer step (Optimizer), and, under 2-process DDP (gloo),
the DataLoader of rank 1 only (a straggler). The error of a phase is its reported median minus
(baseline median + injected time). Target: every phase within 5% (or 2 ms) of the truth and
every verdict right.

    python benchmarks/accuracy.py                # ~2 minutes
    python benchmarks/accuracy.py --inject-ms 50 --batches 40
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _common import BIN_TORCHRUN, PYTHON, TINY, clean_env, run

PHASES = ("input_wait_ms", "h2d_ms", "forward_ms", "backward_ms", "optimizer_ms", "residual_ms")


def traced_run(work: Path, name: str, ddp: bool = False, **tiny: object) -> dict:
    env = clean_env(
        TRACEML="1",
        TRACEML_LOGS_DIR=work / "logs",
        TRACEML_RUN_NAME=name,
        TRACEML_REPORT="0",
        TINY_VALIDATE=0,
        **tiny,
    )
    if ddp:
        run([BIN_TORCHRUN, "--standalone", "--nproc-per-node", "2", TINY], env, work)
    else:
        run([PYTHON, TINY], env, work)
    run([PYTHON, "-m", "traceml", "report", work / "logs" / name], clean_env(), work)
    return json.loads((work / "logs" / name / "final_summary.json").read_text())


def rank_medians(summary: dict, rank: int | None = None) -> dict[str, float]:
    source = summary["overall"] if rank is None else summary["ranks"][rank]
    return {p: (source["phases"][p] or {}).get("median", 0.0) for p in PHASES}


def check(label: str, measured: dict, baseline: dict, injected: dict, verdict_ok: bool) -> bool:
    ok = verdict_ok
    print(f"{label}:")
    for phase in PHASES:
        truth = baseline[phase] + injected.get(phase, 0.0)
        error = measured[phase] - truth
        tolerance = max(0.05 * truth, 2.0)
        within = abs(error) <= tolerance
        if phase in injected:
            ok = ok and within
        marker = "ok " if within else "OFF"
        print(
            f"  {marker} {phase:<14} measured {measured[phase]:8.2f} ms  truth {truth:8.2f} ms  "
            f"error {error:+7.2f} ms ({error / truth * 100 if truth else 0:+6.1f}%)"
        )
    print(f"  verdict {'right' if verdict_ok else 'WRONG'}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inject-ms", type=float, default=30.0)
    parser.add_argument("--batches", type=int, default=40)
    args = parser.parse_args()
    inject = args.inject_ms
    results = []
    with tempfile.TemporaryDirectory(prefix="traceml-accuracy-") as tmp:
        work = Path(tmp)
        common = {"TINY_BATCHES": args.batches}
        base = rank_medians(traced_run(work, "baseline", **common))
        print("baseline medians: " + ", ".join(f"{p} {v:.2f}" for p, v in base.items()))

        cases = [
            (
                "DataLoader sleep",
                "input",
                {"TINY_FETCH_SLEEP_MS": inject},
                {"input_wait_ms": inject},
                "INPUT_BOUND",
            ),
            (
                "forward sleep",
                "forward",
                {"TINY_FORWARD_SLEEP_MS": inject},
                {"forward_ms": inject},
                "COMPUTE_BOUND",
            ),
            (
                "optimizer sleep",
                "optimizer",
                {"TINY_OPTIMIZER_SLEEP_MS": inject},
                {"optimizer_ms": inject},
                "OPTIMIZER_HEAVY",
            ),
        ]
        for label, name, knobs, injected, expected in cases:
            summary = traced_run(work, name, **common, **knobs)
            verdict = summary["verdicts"][0]["kind"]
            ok = check(
                f"{label} ({inject:g} ms): verdict {verdict}",
                rank_medians(summary),
                base,
                injected,
                verdict == expected,
            )
            results.append((label, ok))

        ddp_base = traced_run(work, "ddp-baseline", ddp=True, **common)
        slow = traced_run(
            work,
            "ddp-slow-rank",
            ddp=True,
            TINY_SLOW_RANK=1,
            TINY_SLOW_RANK_EXTRA_MS=inject,
            **common,
        )
        straggler = next((v for v in slow["verdicts"] if v["kind"] == "STRAGGLER"), None)
        verdict_ok = bool(
            straggler
            and straggler["evidence"]["rank"] == 1
            and straggler["evidence"]["cause_phase"] == "input_wait_ms"
        )
        why = straggler["why"] if straggler else "no STRAGGLER verdict"
        ok = check(
            f"rank 1 DataLoader sleep under DDP ({inject:g} ms): {why}",
            rank_medians(slow, 1),
            rank_medians(ddp_base, 1),
            {"input_wait_ms": inject},
            verdict_ok,
        )
        results.append(("slow rank (DDP)", ok))

    passed = sum(ok for _label, ok in results)
    print(
        f"SUMMARY accuracy: {passed}/{len(results)} cases with the injected phase within "
        f"5% (or 2 ms) and the right verdict ("
        + ", ".join(f"{label}: {'ok' if ok else 'MISSED'}" for label, ok in results)
        + ")"
    )


if __name__ == "__main__":
    main()
