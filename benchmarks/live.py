"""What does the live view cost? (a) the watcher's CPU per 1,000 new step records; (b) the traced
job's step time with the live view on vs off, side by side.

(a) In-process: synthetic rank files grow by 1,000 step records per rank per round; each round
    the follower reads what was appended (``poll``) and the view is rebuilt (window summary +
    diagnose + one line of text). CPU time (``time.process_time``), not wall time. Also: the
    first read of a finished 100k-step rank file, to show that catching up does not read it all.
(b) ``traceml run`` of the tiny Lightning MLP (millisecond steps: the most records per second
    for the view to read), ``--no-live`` vs the live view (stderr piped: plain lines; the
    reading is the same as on a terminal), alternating; compares the median traced step time
    from final_summary.json. The launcher's thread shares the machine's cores with training.

    python benchmarks/live.py                   # ~3 minutes on 2 cores
    python benchmarks/live.py --pairs 2 --batches 1000
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson
from _common import ROOT, TINY, alternate, clean_env, describe, run, synthetic_step

sys.path.insert(0, str(ROOT))
from traceml.present import live


def header(rank: int, ranks: int) -> bytes:
    record = {
        "kind": "header",
        "schema": "traceml.rank/1.0",
        "run": "bench",
        "rank": rank,
        "world_size": ranks,
        "host": "bench-host",
        "pid": 1,
        "device": {"type": "cpu"},
        "batch_size": 8,
    }
    return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)


def step_lines(rng: random.Random, start: int, count: int) -> bytes:
    return b"".join(
        orjson.dumps(
            synthetic_step(rng, index, index * 150.0, cuda=False),
            option=orjson.OPT_APPEND_NEWLINE,
        )
        for index in range(start, start + count)
    )


def watcher_cpu(ranks: int, rounds: int, per_round: int) -> dict[str, float]:
    rng = random.Random(ranks)
    with tempfile.TemporaryDirectory(prefix="traceml-live-") as tmp:
        run_dir = Path(tmp)
        paths = []
        for rank in range(ranks):
            path = run_dir / "ranks" / f"rank_{rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(header(rank, ranks))
            paths.append(path)
        follower = live.RunFollower(run_dir)
        follower.poll()
        poll_cpu = view_cpu = 0.0
        for index in range(rounds):
            for path in paths:
                with open(path, "ab") as handle:
                    handle.write(step_lines(rng, index * per_round, per_round))
            start = time.process_time()
            follower.poll()
            middle = time.process_time()
            view = live.build_view(follower.ranks, run="bench", collect_s=0)
            live.render_line(view)
            end = time.process_time()
            poll_cpu += middle - start
            view_cpu += end - middle
        records = ranks * rounds * per_round
        return {
            "poll_ms_per_1k": poll_cpu * 1000 / (records / 1000),
            "view_ms_per_round": view_cpu * 1000 / rounds,
            "records": records,
            "verdict": view.verdict_kind,
        }


def catch_up(steps: int) -> dict[str, float]:
    rng = random.Random(1)
    with tempfile.TemporaryDirectory(prefix="traceml-live-") as tmp:
        path = Path(tmp) / "ranks" / "rank_0.jsonl"
        path.parent.mkdir(parents=True)
        path.write_bytes(header(0, 1) + step_lines(rng, 0, steps) + b'{"kind":"footer"}\n')
        follower = live.RunFollower(Path(tmp))
        start = time.process_time()
        follower.poll()
        cpu = time.process_time() - start
        return {
            "file_mb": path.stat().st_size / 2**20,
            "read_mb": follower.bytes_read / 2**20,
            "cpu_ms": cpu * 1000,
            "steps_seen": follower.ranks[0].steps,
        }


def traced_step_ms(work: Path, batches: int, live_on: bool, counter: list[int]) -> float:
    counter[0] += 1
    name = f"{'live' if live_on else 'nolive'}-{counter[0]}"
    flags = ["--live-interval", "1"] if live_on else ["--no-live"]
    env = clean_env(
        TINY_BATCHES=batches, TINY_VALIDATE=0, TRACEML_LIVE_COLLECT_S=0, PYTHONPATH=str(ROOT)
    )
    command = [
        Path(sys.executable).parent / "traceml",
        "run",
        TINY,
        "--logs-dir",
        work / "logs",
        "--run-name",
        name,
        "--no-report",
        *flags,
    ]
    run(command, env, cwd=work)
    summary = json.loads((work / "logs" / name / "final_summary.json").read_text())
    shutil.rmtree(work / "logs" / name)
    return summary["overall"]["phases"]["step_ms"]["median"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5, help="live on/off pairs for (b)")
    parser.add_argument("--batches", type=int, default=3000, help="tiny MLP steps per run")
    parser.add_argument("--rounds", type=int, default=20, help="rounds of appends for (a)")
    args = parser.parse_args()

    print("(a) watcher CPU per 1,000 new step records (poll: read + parse + window)")
    results = {}
    for ranks in (1, 8, 64):
        result = watcher_cpu(ranks, args.rounds, 1000 if ranks < 64 else 200)
        results[ranks] = result
        print(
            f"  {ranks:>2} rank(s), {result['records']:>7} records: "
            f"poll {result['poll_ms_per_1k']:.2f} ms CPU per 1,000 records; "
            f"view (window summary + diagnose + text) {result['view_ms_per_round']:.1f} ms "
            f"per refresh; verdict {result['verdict']}"
        )
    caught = catch_up(100_000)
    print(
        f"  catching up on a finished 100k-step rank file ({caught['file_mb']:.0f} MB): "
        f"read {caught['read_mb']:.2f} MB, {caught['cpu_ms']:.1f} ms CPU, "
        f"{caught['steps_seen']} steps known"
    )

    print(
        f"(b) traced step time, live view on vs off: tiny MLP, {args.batches} steps, "
        f"{args.pairs} pairs"
    )
    with tempfile.TemporaryDirectory(prefix="traceml-live-bench-") as tmp:
        work = Path(tmp)
        counter = [0]
        off, on = alternate(
            args.pairs,
            lambda: traced_step_ms(work, args.batches, False, counter),
            lambda: traced_step_ms(work, args.batches, True, counter),
            label="median step ms off/on",
        )
    ratios = [b / a for a, b in zip(off, on, strict=True)]
    print(f"  live off: median step {describe(off, ' ms')}")
    print(f"  live on:  median step {describe(on, ' ms')}")
    print(f"  on/off ratio per pair: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(
        "SUMMARY live: watcher "
        f"{results[1]['poll_ms_per_1k']:.2f} ms CPU per 1k records (1 rank), "
        f"{results[8]['poll_ms_per_1k']:.2f} (8 ranks), {results[64]['poll_ms_per_1k']:.2f} "
        f"(64 ranks); view refresh {results[8]['view_ms_per_round']:.1f} ms (8 ranks); "
        f"step time on/off ratio {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} pairs)"
    )


if __name__ == "__main__":
    main()
