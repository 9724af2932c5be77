"""Does traceml put injected time in the right phase, and name the right bottleneck?

Runs the tiny Lightning workload traced: once with no injection (the baseline cost of each
phase), then with a known sleep injected into one place per run: the DataLoader (Input Wait),
the model forward (Forward), the optimizer step (Optimizer), and, under 2-process DDP (gloo),
the DataLoader of rank 1 only (a straggler). The error of a phase is its reported median minus
(baseline median + injected time). Target: every phase within 5% (or 2 ms) of the truth and
every verdict right.

    python benchmarks/accuracy.py                # ~2 minutes
    python benchmarks/accuracy.py --inject-ms 50 --batches 40

Distributed truth on RF-DETR (``--distributed``, ~6 minutes with 2 ranks): RF-DETR Nano under
torchrun (gloo) with rank 1 slowed in its dataset, forward or backward, a balanced run, and a
sleeping communication hook on every rank. Per case: the STRAGGLER (or COMM_BOUND) verdict,
the named rank and phase, and the measured cost per step against the injected one.

    python benchmarks/accuracy.py --distributed              # 2 ranks
    python benchmarks/accuracy.py --distributed --ranks 4    # 4 ranks (too slow for CI)
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


RFD_DDP = Path(__file__).resolve().parent.parent / "tests/integration/scripts/rfdetr_ddp.py"


def rfdetr_ddp(work: Path, name: str, ranks: int, **inject: object) -> dict:
    env = clean_env(
        TRACEML="1",
        TRACEML_LOGS_DIR=work / "logs",
        TRACEML_RUN_NAME=name,
        TRACEML_REPORT="0",
        HF_HUB_OFFLINE="1",
        RFD_WORKDIR=work / "rfd",
        RFD_TRAIN_IMAGES=28 * ranks,
        **inject,
    )
    try:
        run([BIN_TORCHRUN, "--standalone", "--nproc-per-node", str(ranks), RFD_DDP], env, work)
    finally:
        import shutil

        shutil.rmtree(work / "rfd", ignore_errors=True)
    run([PYTHON, "-m", "traceml", "report", work / "logs" / name], clean_env(), work)
    return json.loads((work / "logs" / name / "final_summary.json").read_text())


def distributed(ranks: int) -> None:
    cases = [
        ("balanced", {}, None, None),
        (
            "rank 1 dataset +150 ms/image",
            dict(RFD_SLOW_WHERE="dataset", RFD_SLOW_MS=150),
            "input_wait_ms",
            300.0,
        ),
        (
            "rank 1 forward +300 ms",
            dict(RFD_SLOW_WHERE="forward", RFD_SLOW_MS=300),
            "forward_ms",
            300.0,
        ),
        (
            "rank 1 backward +300 ms",
            dict(RFD_SLOW_WHERE="backward", RFD_SLOW_MS=300),
            "backward_ms",
            300.0,
        ),
        ("comm hook +80 ms/bucket, every rank", dict(RFD_COMM_DELAY_MS=80), None, None),
    ]
    results = []
    with tempfile.TemporaryDirectory(prefix="traceml-accuracy-ddp-") as tmp:
        for index, (label, knobs, phase, injected) in enumerate(cases):
            if knobs.get("RFD_SLOW_WHERE"):
                knobs = {**knobs, "RFD_SLOW_RANK": 1}
            summary = rfdetr_ddp(Path(tmp), f"case{index}", ranks, **knobs)
            kinds = [v["kind"] for v in summary["verdicts"]]
            straggler = next((v for v in summary["verdicts"] if v["kind"] == "STRAGGLER"), None)
            if phase is None and "COMM_DELAY" in str(knobs):
                ok = "COMM_BOUND" in kinds and straggler is None
                detail = f"verdicts {kinds}"
            elif phase is None:
                ok = straggler is None
                detail = f"verdicts {kinds}"
            else:
                evidence = (straggler or {}).get("evidence", {})
                measured = (evidence.get("excess_ms") or {}).get(phase)
                cost = evidence.get("cost_ms_per_step")
                ok = bool(
                    straggler
                    and evidence["rank"] == 1
                    and evidence["cause_phase"] == phase
                    and measured is not None
                    and abs(measured - injected) <= max(0.1 * injected, 5.0)
                )
                detail = (
                    f"rank {evidence.get('rank')}, phase {evidence.get('cause_phase')}, "
                    f"+{measured or 0:.1f} ms in the phase, job cost {cost or 0:.1f} ms/step, "
                    f"injected {injected:g} ms"
                    if straggler
                    else f"no STRAGGLER (verdicts {kinds})"
                )
            print(f"  {'ok ' if ok else 'OFF'} {label}: {detail}", flush=True)
            results.append((label, ok))
    passed = sum(ok for _label, ok in results)
    print(
        f"SUMMARY accuracy --distributed ({ranks} ranks, RF-DETR): {passed}/{len(results)} "
        "cases right (rank, phase, injected cost within 10% or 5 ms; COMM_BOUND; no straggler "
        "when balanced)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inject-ms", type=float, default=30.0)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--distributed", action="store_true", help="the RF-DETR DDP cases")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    if args.distributed:
        distributed(args.ranks)
        return
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
