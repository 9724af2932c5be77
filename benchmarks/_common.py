"""Shared by the benchmark scripts: clean environments, alternating runs, medians.

Benchmarks are not tests: they print measurements, they assert nothing. Every comparison is
made side by side in one invocation (A B A B ...) so that machine noise hits both sides alike.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "integration" / "scripts"
TINY = SCRIPTS / "tiny_lightning.py"
RFDETR = SCRIPTS / "rfdetr_train.py"
PYTHON = sys.executable
T = TypeVar("T")


def clean_env(**extra: object) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TRACEML", "TINY_", "RFD_", "TORCHELASTIC"))
        and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(args: Sequence[object], env: dict[str, str], cwd: Path | None = None, timeout: int = 900):
    result = subprocess.run(
        [str(a) for a in args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(map(str, args))} exited {result.returncode}:\n{result.stderr[-3000:]}"
        )
    return result


def values(stdout: str, prefix: str) -> dict[str, float]:
    """``PREFIX a=1 b=2.5`` -> {"a": 1.0, "b": 2.5} from the last such line."""
    line = [line for line in stdout.splitlines() if line.startswith(prefix)][-1]
    return {k: float(v) for k, v in (item.split("=", 1) for item in line.split()[1:])}


def alternate(
    pairs: int, first: Callable[[], T], second: Callable[[], T], label: str = ""
) -> tuple[list[T], list[T]]:
    """Run first/second alternately (order flipped every pair) and return both samples.
    ``label``: print each pair's two values (numbers) as it ends."""
    a_values: list[T] = []
    b_values: list[T] = []
    for index in range(pairs):
        order = [(first, a_values), (second, b_values)]
        if index % 2:
            order.reverse()
        for function, sink in order:
            sink.append(function())
        if label:
            print(
                f"  {label} pair {index + 1}/{pairs}: {a_values[-1]:.6g} vs {b_values[-1]:.6g}",
                flush=True,
            )
    return a_values, b_values


def describe(samples: list[float], unit: str = "", scale: float = 1.0) -> str:
    med, low, high = (
        statistics.median(samples) * scale,
        min(samples) * scale,
        max(samples) * scale,
    )
    return f"median {med:.4g}{unit} (min {low:.4g}, max {high:.4g}, n={len(samples)})"


def paired_ratio(plain: list[float], traced: list[float]) -> tuple[float, float, float]:
    """Median, min and max of traced/plain over the pairs."""
    ratios = [t / p for p, t in zip(plain, traced, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


BIN_TORCHRUN = Path(sys.executable).parent / "torchrun"


def synthetic_step(rng: random.Random, index: int, t_ms: float, cuda: bool) -> dict:
    """One step record as a traced RF-DETR-like run writes it (phases drawn from ``rng``);
    with ``cuda`` the device fields carry plausible numbers, else null as on CPU."""
    phases = {
        "input_wait_ms": rng.uniform(1, 5),
        "h2d_ms": rng.uniform(0.5, 1),
        "forward_ms": rng.uniform(40, 50),
        "backward_ms": rng.uniform(80, 100),
        "optimizer_ms": rng.uniform(5, 8),
        "residual_ms": rng.uniform(2, 4),
    }
    step_ms = sum(phases.values())
    device = {
        "gpu_h2d_ms": 0.8,
        "gpu_forward_ms": 45.0,
        "gpu_backward_ms": 90.0,
        "gpu_optimizer_ms": 6.0,
        "gpu_step_ms": step_ms,
        "mem_peak_allocated_bytes": 30 * 2**30,
        "mem_peak_reserved_bytes": 32 * 2**30,
    }
    return {
        "kind": "step",
        "step": index,
        "global_step": index + 1,
        "epoch": 0,
        "microbatches": 1,
        "optimizer_stepped": True,
        "t_ms": t_ms,
        "gap_ms": 0.3 if index else None,
        "step_ms": step_ms,
        **phases,
        "rss_bytes": 2_000_000_000,
        **(device if cuda else dict.fromkeys(device)),
    }
