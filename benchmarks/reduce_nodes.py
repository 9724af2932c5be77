"""benchmarks/reduce.py --nodes: per-node partial reductions and their merge, timed apart.

One node's rank files are synthesised (compact records as traceml writes them: measured fields
only, whole microseconds, short keys as rank schema 2.0 spells them); the other nodes get
copies of them with their own headers (the work is the same whatever the numbers). Each node
is reduced in a fresh process (``python -m traceml.finalize node-partial``); the merge
(``finalize.summarise`` with every partial present: load, add up, diagnose, render, write) in
another, at a quarter, half and all of the nodes (hard links to the same rank files, so the
partials stay valid).
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import orjson
from _common import PYTHON, ROOT, clean_env, synthetic_step, values

from traceml import schema
from traceml.step_record import STEP_KEYS

NODE_CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from traceml.finalize import reduce_node
start = time.perf_counter(); cpu = time.process_time()
reduce_node({run_dir!r}, {node}, jobs={jobs})
print(f"NODE seconds={{time.perf_counter() - start}} cpu={{time.process_time() - cpu}}")
"""
MERGE_CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from traceml.finalize import summarise
start = time.perf_counter(); cpu = time.process_time()
summary, _ = summarise(Path({run_dir!r}), jobs={jobs})
elapsed = time.perf_counter() - start
assert not any("partial" in n for n in summary["notes"]), summary["notes"]
status = open("/proc/self/status").read()
peak = int(status.split("VmHWM:")[1].split()[0]) * 1024
print(f"MERGE seconds={{elapsed}} cpu={{time.process_time() - cpu}} "
      f"records={{summary['steps_recorded']}} peak_rss={{peak}}")
"""


def compact(record: dict) -> dict:
    out = {}
    for key, value in record.items():
        if value is None or schema.STEP_DEFAULTS.get(key, object()) == value:
            continue
        out[STEP_KEYS.get(key, key)] = round(value, 3) if isinstance(value, float) else value
    return out


def header(rank: int, world: int, per_node: int) -> dict:
    node = rank // per_node
    return {
        "kind": "header",
        "schema": schema.RANK_SCHEMA,
        "run": "bench",
        "rank": rank,
        "local_rank": rank % per_node,
        "world_size": world,
        "node_rank": node,
        "local_world_size": per_node,
        "host": f"node{node}",
        "pid": 1,
        "versions": {},
        "device": {"type": "cuda", "name": "synthetic", "total_memory_bytes": 80 * 2**30},
        "timing": "host+cuda_events",
        "comm_timing": "host+cuda_events",
        "script": "train.py",
        "integration": "rfdetr",
        "accumulate_grad_batches": 1,
        "batch_size": 8,
        "settings": {},
    }


def write_layout(run_dir: Path, nodes: int, per_node: int, steps: int) -> None:
    ranks_dir = run_dir / schema.RANKS_DIR
    ranks_dir.mkdir(parents=True, exist_ok=True)
    world = nodes * per_node
    bodies = []
    for local in range(per_node):
        rng = random.Random(local)
        lines, t = [], 0.0
        for index in range(steps):
            record = synthetic_step(rng, index, t, cuda=True)
            record["comm_ms"] = record["comm_backward_ms"] = rng.uniform(1, 3)
            record["comm_count"], record["comm_bytes"] = 26, 102_760_448
            t += record["step_ms"] + 0.3
            lines.append(orjson.dumps(compact(record)))
        lines.append(orjson.dumps({"kind": "footer", "status": "completed", "steps": steps}))
        bodies.append(b"\n".join(lines) + b"\n")
    for rank in range(world):
        path = ranks_dir / schema.rank_file_name(rank)
        path.write_bytes(orjson.dumps(header(rank, world, per_node)) + b"\n")
        with open(path, "ab") as handle:
            handle.write(bodies[rank % per_node])


def subset(full: Path, target: Path, nodes: int, per_node: int) -> None:
    """A run directory of the first ``nodes`` nodes: hard links to their rank files (same
    size and mtime, so their partials stay trusted) and copies of their partials."""
    (target / schema.RANKS_DIR).mkdir(parents=True)
    (target / schema.PARTIALS_DIR).mkdir()
    for rank in range(nodes * per_node):
        name = schema.rank_file_name(rank)
        os.link(full / schema.RANKS_DIR / name, target / schema.RANKS_DIR / name)
    for node in range(nodes):
        name = f"node_{node}.json"
        partial = orjson.loads((full / schema.PARTIALS_DIR / name).read_bytes())
        for part in partial["parts"]:  # the world these nodes make up
            part["header"]["world_size"] = nodes * per_node
        (target / schema.PARTIALS_DIR / name).write_bytes(orjson.dumps(partial))


def child(code: str, key: str) -> dict[str, float]:
    result = subprocess.run(
        [PYTHON, "-c", code], env=clean_env(), capture_output=True, text=True, check=True
    )
    return values(result.stdout, key)


def run_nodes(args) -> None:
    nodes, per_node, steps = args.nodes, args.ranks_per_node, args.steps
    base = Path(args.dir or tempfile.mkdtemp(prefix="traceml-nodes-"))
    full = base / "full"
    shutil.rmtree(full, ignore_errors=True)
    print(f"{nodes} nodes x {per_node} ranks x {steps} steps: writing rank files...", flush=True)
    start = time.perf_counter()
    write_layout(full, nodes, per_node, steps)
    files = list((full / schema.RANKS_DIR).iterdir())
    size = sum(p.stat().st_size for p in files)
    records = nodes * per_node * steps
    print(
        f"  {size / 2**30:.2f} GiB, {size / records:.0f} bytes per step line "
        f"(written in {time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    jobs = args.jobs
    node_times, node_cpu = [], []
    for node in range(nodes):
        code = NODE_CHILD.format(root=str(ROOT), run_dir=str(full), node=node, jobs=jobs)
        measured = child(code, "NODE")
        node_times.append(measured["seconds"])
        node_cpu.append(measured["cpu"])
        print(f"  node {node}: reduced in {measured['seconds']:.2f} s", flush=True)
    per_node_records = per_node * steps
    partial_bytes = sum(p.stat().st_size for p in (full / schema.PARTIALS_DIR).iterdir())
    print(
        f"per-node reduction ({per_node} x {steps} steps, --jobs {jobs}): median "
        f"{statistics.median(node_times):.2f} s (min {min(node_times):.2f}, max "
        f"{max(node_times):.2f}) = {per_node_records / statistics.median(node_times) / 1e6:.2f} "
        f"M records/s per node; partials {partial_bytes / nodes / 2**20:.1f} MiB each",
        flush=True,
    )
    merges = {}
    for count in sorted({max(1, nodes // 4), max(1, nodes // 2), nodes}):
        target = base / f"merge{count}"
        shutil.rmtree(target, ignore_errors=True)
        subset(full, target, count, per_node)
        runs = [
            child(MERGE_CHILD.format(root=str(ROOT), run_dir=str(target), jobs=jobs), "MERGE")
            for _ in range(args.repeats)
        ]
        seconds = statistics.median(r["seconds"] for r in runs)
        merges[count] = seconds
        peak = max(r["peak_rss"] for r in runs) / 2**20
        print(
            f"merge of {count} partials ({count * per_node} ranks, "
            f"{int(runs[0]['records'])} records): median {seconds:.2f} s "
            f"(min {min(r['seconds'] for r in runs):.2f}); peak RSS {peak:.0f} MiB",
            flush=True,
        )
        shutil.rmtree(target, ignore_errors=True)
    counts = sorted(merges)
    slope = (merges[counts[-1]] - merges[counts[0]]) / max(1, counts[-1] - counts[0])
    target_nodes = -(-1000 // per_node)
    projected_merge = merges[counts[-1]] + slope * (target_nodes - counts[-1])
    projected = max(node_times) + projected_merge
    print(
        f"SUMMARY nodes: per-node {statistics.median(node_times):.2f} s (max "
        f"{max(node_times):.2f}); merge {', '.join(f'{c}: {merges[c]:.2f} s' for c in counts)}; "
        f"{slope:.3f} s per node; 1,000 ranks ({target_nodes} nodes x {per_node}, {steps} steps): "
        f"{max(node_times):.1f} s + {projected_merge:.1f} s = {projected:.1f} s projected",
        flush=True,
    )
    shutil.rmtree(base, ignore_errors=True)
