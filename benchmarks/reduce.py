"""How fast is the reducer, and is its memory bounded by one rank's records?

Synthesises rank files (default: 8 ranks x 100k steps, 64 ranks x 10k steps, and 1 rank x
100k steps as the memory reference), then times reduce + diagnose + writing the summary files
in a fresh process and reads that process's peak RSS. Target: >= 1M step records/s; peak RSS
about the same for 8 x 100k as for 1 x 100k (bounded by the largest rank, not the total).

    python benchmarks/reduce.py                      # ~2 minutes, ~700 MB of temporary files
    python benchmarks/reduce.py --scale 0.1          # 10x smaller

At scale, by simulation (issue 24): rank files laid out as node directories' worth of ranks
(compact schema-1.3 records, as traceml writes them now), each node reduced into its partial
(timed one node at a time: on a cluster the nodes do this in parallel), then the merge of the
partials into the summary timed separately, at 1/4, 1/2 and all of the nodes (the merge's
growth with the node count gives the 1,000-rank projection):

    python benchmarks/reduce.py --nodes 16 --ranks-per-node 8 --steps 100000   # ~4 GB on disk
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import tempfile
from pathlib import Path

import orjson
from _common import PYTHON, ROOT, clean_env, synthetic_step, values

CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from traceml.finalize import summarise
start = time.perf_counter()
summary, _text = summarise(__import__('pathlib').Path({run_dir!r}), jobs={jobs})
elapsed = time.perf_counter() - start
# VmHWM, not ru_maxrss: after fork+exec Linux carries the parent's peak into ru_maxrss.
status = open("/proc/self/status").read()
peak = int(status.split("VmHWM:")[1].split()[0]) * 1024
print(f"REDUCE seconds={{elapsed}} records={{summary['steps_recorded']}} peak_rss={{peak}}")
"""


def synthesize(run_dir: Path, ranks: int, steps: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    for rank in range(ranks):
        path = run_dir / "ranks" / f"rank_{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {
            "kind": "header",
            "schema": "traceml.rank/1.0",
            "run": "bench",
            "rank": rank,
            "local_rank": rank % 8,
            "world_size": ranks,
            "node_rank": rank // 8,
            "local_world_size": 8,
            "host": f"node{rank // 8}",
            "pid": 1,
            "versions": {},
            "device": {"type": "cuda", "name": "synthetic", "total_memory_bytes": 80 * 2**30},
            "timing": "host+cuda_events",
            "script": "train.py",
            "integration": "rfdetr",
            "accumulate_grad_batches": 1,
            "batch_size": 8,
            "settings": {},
        }
        lines = [orjson.dumps(header)]
        t = 0.0
        for index in range(steps):
            record = synthetic_step(rng, index, t, cuda=True)
            step_ms = record["step_ms"]
            t += step_ms + 0.3
            lines.append(orjson.dumps(record))
        lines.append(orjson.dumps({"kind": "footer", "status": "completed", "steps": steps}))
        path.write_bytes(b"\n".join(lines) + b"\n")


def measure(run_dir: Path, jobs: int = 1) -> dict[str, float]:
    code = CHILD.format(root=str(ROOT), run_dir=str(run_dir), jobs=jobs)
    result = subprocess.run(
        [PYTHON, "-c", code], env=clean_env(), capture_output=True, text=True, check=True
    )
    return values(result.stdout, "REDUCE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=0, help="simulate a multi-node layout")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the step counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: cores)"
    )
    args = parser.parse_args()
    if args.nodes:
        from reduce_nodes import run_nodes

        run_nodes(args)
        return
    cases = [(1, 100_000), (8, 100_000), (64, 10_000)]
    rates = {}
    peaks = {}
    parallel_rates = {}
    with tempfile.TemporaryDirectory(prefix="traceml-reduce-") as tmp:
        for ranks, steps in cases:
            steps = max(10, int(steps * args.scale))
            run_dir = Path(tmp) / f"r{ranks}x{steps}"
            print(f"{ranks} ranks x {steps} steps: writing rank files...", flush=True)
            synthesize(run_dir, ranks, steps)
            size = sum(p.stat().st_size for p in (run_dir / "ranks").iterdir()) / 2**20
            runs = [measure(run_dir) for _ in range(args.repeats)]
            seconds = [r["seconds"] for r in runs]
            records = runs[0]["records"]
            rate = records / statistics.median(seconds)
            peak = max(r["peak_rss"] for r in runs) / 2**20
            rates[(ranks, steps)] = rate
            peaks[(ranks, steps)] = peak
            print(
                f"  {size:.0f} MiB of rank files; reduce+diagnose+write: median "
                f"{statistics.median(seconds):.2f} s (min {min(seconds):.2f}, max "
                f"{max(seconds):.2f}) = {rate / 1e6:.2f} M records/s; peak RSS {peak:.0f} MiB",
                flush=True,
            )
            if ranks > 1 and args.jobs > 1:
                parallel = [measure(run_dir, args.jobs) for _ in range(args.repeats)]
                p_seconds = statistics.median(r["seconds"] for r in parallel)
                p_rate = records / p_seconds
                parallel_rates[(ranks, steps)] = p_rate
                print(
                    f"  with --jobs {args.jobs}: median {p_seconds:.2f} s = "
                    f"{p_rate / 1e6:.2f} M records/s; peak RSS (parent) "
                    f"{max(r['peak_rss'] for r in parallel) / 2**20:.0f} MiB",
                    flush=True,
                )
    parts = []
    for key, rate in rates.items():
        text = f"{key[0]}x{key[1]}: {rate / 1e6:.2f} M rec/s, {peaks[key]:.0f} MiB"
        if key in parallel_rates:
            text += f" ({parallel_rates[key] / 1e6:.2f} M rec/s with {args.jobs} jobs)"
        parts.append(text)
    print("SUMMARY reduce: " + "; ".join(parts) + " (target >= 1 M rec/s, RSS ~ one rank)")


if __name__ == "__main__":
    main()
