"""One command for a machine with one CUDA GPU: is traceml's device-side timing right there?

Runs RF-DETR Nano training on the GPU (synthetic dataset made here, no downloads) as child
processes, alternating:

  plain      untraced, the training loop timed by the same wrapper as the traced runs
  traced     TRACEML=1, no injection
  injected   TRACEML=1, with known device work: ``torch.cuda._sleep`` (a kernel that spins for
             a number of GPU cycles, calibrated here to milliseconds) at the start of the
             detector's forward and after every optimizer step

and prints, per device phase, measured vs injected device time (CUDA events: traced runs'
gpu_forward_ms / gpu_optimizer_ms medians, injected minus traced), the peak allocated /
reserved memory the traced runs recorded, and the traced/plain training-loop time ratio.

    python benchmarks/gpu_check.py               # ~3-5 minutes on one GPU
    python benchmarks/gpu_check.py --nccl-only   # the NCCL cases alone, ~20 s

Before the trainings, the NCCL cases (one rank, a real NCCL process group, traceml's comm and
device timers driven by hand around known device work): device time between an async
collective's launch and its ``wait()`` is compute, not waiting (measured ~0, not the injected
sleep); two async collectives waited together are counted once (merged); a phase's device own
time is never negative. Issue 20; the same rules are unit-tested with fake events.
    python benchmarks/gpu_check.py --inject-ms 20 --images 96 --pairs 2

Needs torch with CUDA, rfdetr[train] and this repository's traceml installed (pip install -e .).
On a machine without CUDA it says so and exits 0. Prints measurements, asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "integrations" / "rfdetr_minimal.py"
LOOP_TIMER_DIR = ROOT / "tests" / "integration" / "scripts"


def cycles_per_ms() -> float:
    """GPU cycles torch.cuda._sleep spins per millisecond, measured with CUDA events."""
    import torch

    torch.cuda._sleep(1_000_000)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rates = []
    for _ in range(5):
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        rates.append(50_000_000 / start.elapsed_time(end))
    return statistics.median(rates)


# ----------------------------------------------------------------------------------------------
# Child: one training


def child(args: argparse.Namespace) -> int:
    import torch

    sys.path.insert(0, str(LOOP_TIMER_DIR))
    import loop_timer

    spec = importlib.util.spec_from_file_location("rfdetr_minimal", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    if args.inject_ms > 0:
        cycles = int(args.cycles_per_ms * args.inject_ms)
        from rfdetr.models.lwdetr import LWDETR

        original_forward = LWDETR.forward

        def forward(self, *inner, **kwargs):
            if self.training and torch.is_grad_enabled():
                torch.cuda._sleep(cycles)
            return original_forward(self, *inner, **kwargs)

        LWDETR.forward = forward

        from torch.optim.optimizer import register_optimizer_step_post_hook

        def after_step(optimizer, args, kwargs):
            torch.cuda._sleep(cycles)

        register_optimizer_step_post_hook(after_step)  # every optimizer's step

    loop_timer.install("pytorch_lightning")
    work = Path(args.workdir)
    dataset = example.make_demo_dataset(
        work / "dataset", seed=0, sizes={"train": args.images, "valid": 2, "test": 2}
    )
    from rfdetr import RFDETRNano

    model = RFDETRNano(pretrain_weights=None, num_queries=100, num_select=100, group_detr=1)
    model.train(
        dataset_dir=str(dataset),
        output_dir=str(work / "out"),
        epochs=1,
        batch_size=args.batch_size,
        grad_accum_steps=1,
        num_workers=2,
        resolution=args.resolution,
        device="cuda",
        multi_scale=False,
        tensorboard=False,
    )
    return 0


# ----------------------------------------------------------------------------------------------
# Parent


def run_child(mode: str, args: argparse.Namespace, work: Path, rate: float) -> dict:
    name = f"{mode}-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML")}
    env.update(LOOP_TIMER="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    if mode != "plain":
        env.update(
            TRACEML="1",
            TRACEML_LOGS_DIR=str(work / "logs"),
            TRACEML_RUN_NAME=name,
            TRACEML_REPORT="0",
        )
    command = [
        sys.executable,
        __file__,
        "--child",
        "--workdir",
        str(work / name),
        "--images",
        str(args.images),
        "--batch-size",
        str(args.batch_size),
        "--resolution",
        str(args.resolution),
        "--cycles-per-ms",
        str(rate),
        "--inject-ms",
        str(args.inject_ms if mode == "injected" else 0),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    subprocess.run(["rm", "-rf", str(work / name)], check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{result.stderr[-3000:]}")
    line = [x for x in result.stdout.splitlines() if x.startswith("LOOP_TIMER")][-1]
    timer = {k: float(v) for k, v in (item.split("=") for item in line.split()[1:])}
    out = {"loop_s": timer["seconds"], "batches": timer["batches"]}
    if mode != "plain":
        report = subprocess.run(
            [sys.executable, "-m", "traceml", "report", str(work / "logs" / name), "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        out["summary"] = json.loads(report.stdout)
    return out


# ----------------------------------------------------------------------------------------------
# NCCL cases (one rank)


def nccl_child(rate: float, sleep_ms: float = 10.0) -> int:
    """Drive traceml's CommTimer and CUDA step timer by hand around known device work."""
    import torch
    import torch.distributed as dist

    from traceml import schema
    from traceml.capture.cuda_timing import cuda_step_timer
    from traceml.capture.instruments.distributed import CommTimer
    from traceml.capture.step_clock import StepClock

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    tensor = torch.ones(1 << 22, device=device)
    now = time.perf_counter_ns
    results = {}
    for case in ("compute_between_launch_and_wait", "two_async_waited_together", "sync"):
        clock = StepClock(origin_ns=0, comm_enabled=True)
        gpu = cuda_step_timer(device)
        gpu.comm_enabled = True
        timer = CommTimer(on_failure=lambda reason: print("traceml failed:", reason))
        timer.clock, timer.gpu = clock, gpu
        timer.install_collectives(dist)
        timer.active = True
        for _step in range(3):
            clock.fetched(now(), now())
            gpu.step_started()
            clock.forward_started(now())
            gpu.phase_started("forward")
            if case == "sync":
                dist.all_reduce(tensor)
                torch.cuda._sleep(int(sleep_ms * rate))
            else:
                works = [dist.all_reduce(tensor, async_op=True)]
                if case == "two_async_waited_together":
                    works.append(dist.all_reduce(tensor.clone(), async_op=True))
                torch.cuda._sleep(int(sleep_ms * rate))  # compute overlapping the collective
                for work in works:
                    work.wait()
            gpu.phase_ended("forward")
            clock.forward_ended(now())
            clock.optimizer_started(now())
            record = clock.batch_ended(now())
            gpu.step_ended(record)
        records = list(gpu.drain())
        timer.uninstall()
        last = records[-1]
        comm = last.get(schema.GPU_COMM_OF_PHASE[schema.FORWARD])
        forward = last.get(schema.GPU_FORWARD)
        results[case] = {"gpu_forward_ms": forward, "gpu_comm_forward_ms": comm}
        own_ok = comm is not None and forward is not None and forward - comm >= 0
        print(
            f"  nccl {case:<34} device forward {forward:8.2f} ms, of it waiting {comm:6.2f} ms"
            f" (compute {sleep_ms:g} ms is not waiting: {'ok' if comm < sleep_ms / 2 else 'OFF'};"
            f" own time >= 0: {'ok' if own_ok else 'OFF'})",
            flush=True,
        )
    dist.destroy_process_group()
    print("NCCL_RESULT " + json.dumps(results), flush=True)
    return 0


def run_nccl_cases(rate: float) -> None:
    result = subprocess.run(
        [sys.executable, __file__, "--nccl-child", "--cycles-per-ms", str(rate)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(result.stdout, end="")
    if result.returncode:
        print(f"  nccl cases failed (exit {result.returncode}): {result.stderr[-2000:]}")


def median_of(runs: list[dict], fieldname: str) -> float | None:
    values = [(r["summary"]["overall"]["phases"].get(fieldname) or {}).get("median") for r in runs]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--cycles-per-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--inject-ms", type=float, default=10.0)
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--resolution", type=int, default=384)
    parser.add_argument("--pairs", type=int, default=2, help="plain/traced/injected rounds")
    parser.add_argument("--nccl-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nccl-only", action="store_true", help="only the NCCL cases")
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.nccl_child:
        return nccl_child(args.cycles_per_ms)

    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed; nothing to check")
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine; nothing to check (exit 0)")
        return 0
    rate = cycles_per_ms()
    print(f"device: {torch.cuda.get_device_name(0)}; torch.cuda._sleep: {rate:,.0f} cycles/ms")
    print("NCCL cases (one rank):")
    run_nccl_cases(rate)
    if args.nccl_only:
        return 0
    runs: dict[str, list[dict]] = {"plain": [], "traced": [], "injected": []}
    with tempfile.TemporaryDirectory(prefix="traceml-gpu-check-") as tmp:
        work = Path(tmp)
        for round_index in range(args.pairs):
            order = ["plain", "traced", "injected"]
            if round_index % 2:
                order.reverse()
            for mode in order:
                result = run_child(mode, args, work, rate)
                runs[mode].append(result)
                print(
                    f"  {mode:<9} loop {result['loop_s']:.2f} s over {result['batches']:.0f} "
                    "batches",
                    flush=True,
                )

    print("\nDevice phases (median ms per step; injected minus traced vs what was injected):")
    ok = True
    for label, fieldname in (("Forward", "gpu_forward_ms"), ("Optimizer", "gpu_optimizer_ms")):
        base, injected = (
            median_of(runs["traced"], fieldname),
            median_of(runs["injected"], fieldname),
        )
        if base is None or injected is None:
            print(f"  {label:<10} not measured (no CUDA-event times in the summary)")
            ok = False
            continue
        measured = injected - base
        error = measured - args.inject_ms
        within = abs(error) <= max(0.05 * args.inject_ms, 0.5)
        ok = ok and within
        print(
            f"  {'ok ' if within else 'OFF'} {label:<10} traced {base:8.2f}  "
            f"injected {injected:8.2f}"
            f"  measured +{measured:.2f} ms vs +{args.inject_ms:g} ms (error {error:+.2f} ms)"
        )
    host_step = median_of(runs["traced"], "step_ms")
    gpu_step = median_of(runs["traced"], "gpu_step_ms")
    print(f"  step: host {host_step} ms, device {gpu_step} ms (median, traced runs)")
    overall = runs["traced"][-1]["summary"]["overall"]
    print(
        "Peak memory (traced): allocated "
        f"{(overall.get('mem_peak_allocated_bytes') or 0) / 2**20:.0f} MiB, reserved "
        f"{(overall.get('mem_peak_reserved_bytes') or 0) / 2**20:.0f} MiB"
    )
    ratios = [t["loop_s"] / p["loop_s"] for t, p in zip(runs["traced"], runs["plain"], strict=True)]
    print(
        f"SUMMARY gpu_check: device phases {'within' if ok else 'NOT within'} 5% (or 0.5 ms) of "
        f"the injected {args.inject_ms:g} ms; traced/plain loop time ratio "
        f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}, "
        f"{len(ratios)} pairs)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
