"""How much does tracing slow training down? Plain vs traced, alternating, in one invocation.

(a) RF-DETR Nano on CPU (the small config: 64 px, 20 queries, one query group), about 40
    optimizer steps per run.
(b) A Lightning stress case: a tiny MLP whose steps take well under a millisecond, the worst
    case for a fixed per-step cost.

The time compared is the training loop itself: the sum of Lightning's per-batch loop body
(``_TrainingEpochLoop.advance``: fetch, transfer, forward, backward, optimizer, batch-end hooks),
wrapped identically in both variants, so validation, checkpoint writing and imports do not
dilute the ratio. Targets: <= 0.3% on (a), <= 30 us added per step on (b).

``--budget`` (stress loop only): where the added microseconds go. Besides plain and traced, one
traced variant per door with that door switched off (``loop_timer_doors.py``), all of them in
rotating order in every round; a door's cost is traced minus door-off, per batch, median over
the rounds. Also prints the records' own ``traceml_us`` against the side-by-side total.

``--clock instructions`` (with ``--budget``) counts instructions under callgrind instead of
time (``callgrind_window.py``): the same every run, where this VM's clocks drift by +-30%.
``--doors RUNS``: each entry point's own time per call (the guard's timer, kept per door);
with ``--floor``, the same doors with only a list append behind each (what any clock behind
these doors cannot go below).
``--layouts`` (with ``--budget``): round i runs every variant with a different number of
classes made at start (``loop_timer_doors.shift_layout``). CPython's method cache slot is a
hash of a type's version tag and the name's address, both moved by anything made before: one
layout's figure carries up to ~+-13,000 instructions a batch of luck (stop 49).

``--side-by-side``: each pair's two runs at once, each on a core of its own (swapped every
pair), their loops released together (``side_by_side.py``): both meet the same seconds of the
machine's load. ``--aa``: both runs of every pair plain, what a method reads for no change.

    python benchmarks/overhead.py                 # full run (~10 minutes on 2 cores)
    python benchmarks/overhead.py --skip-rfdetr --side-by-side --pairs 8    # ~2 minutes
    python benchmarks/overhead.py --skip-rfdetr --side-by-side --pairs 8 --aa   # its A/A
    python benchmarks/overhead.py --pairs 2 --skip-rfdetr   # quick look
    python benchmarks/overhead.py --budget --rounds 3       # the per-door table
    python benchmarks/overhead.py --budget --clock instructions --rounds 1   # ~25 minutes
    python benchmarks/overhead.py --budget --clock instructions --rounds 3 --layouts \
        --variants plain,traced              # ~15 minutes
    python benchmarks/overhead.py --doors 3                 # time inside each door
    python benchmarks/overhead.py --doors 3 --floor         # ... with nothing behind them
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import callgrind_window
import side_by_side
from _common import PYTHON, RFDETR, TINY, alternate, clean_env, describe, paired_ratio, run, values

from traceml.analysis.rankfile import read_records

HERE = Path(__file__).resolve().parent
DOORS = ("guard", "write", "record", "telemetry", "input", "forward", "transfer")
STRESS = {"TINY_VALIDATE": 0}


# Which loop time to compare: "seconds" (wall), "cpu_seconds" (the process's CPU time, all
# threads) or "p25_seconds" (the batches' 25th-percentile wall time times their count: batches
# slowed by other processes lie above it; periodic costs such as the flusher's write, ~1 in 150
# batches, lie above it too and are counted in traceml_us instead). Set from --clock.
CLOCK = {"field": "seconds"}
# --layouts (--budget): round i runs every variant with CLASSES[i] classes made at start
# (loop_timer_doors.shift_layout): the method cache's collisions differ from round to round.
LAYOUTS: dict = {"on": False, "classes": (0, 37, 400, 13, 101, 211)}
# --side-by-side: each pair's two runs at once, on a core each (side_by_side.py).
SIDE_BY_SIDE = {"on": False, "aa": False}
# Clocks counted under callgrind (deterministic: the same run gives the same count).
SIMULATED = ("instructions", "cycles")
# --clock instructions: the callgrind window (callgrind_window.py) and the stretch of traceml's
# time-based intervals (a batch under callgrind takes ~this many times as long in wall time).
CG: dict = {"library": "", "warm": 300, "batches": 400, "scale": 60.0}


def loop_seconds(script: Path, env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """The loop time of one run by CLOCK (or its window's instructions) and its batch count."""
    if CLOCK["field"] in SIMULATED:
        return loop_instructions(script, env, cwd)
    timer = loop_timer(script, env, cwd)
    return timer[CLOCK["field"]], timer["batches"]


def loop_timer(script: Path, env: dict[str, str], cwd: Path) -> dict[str, float]:
    """One native run's whole LOOP_TIMER line (every clock, the batch count)."""
    workdir = Path(env["RFD_WORKDIR"])
    try:
        result = run([PYTHON, script], env, cwd)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # a fresh dataset, no checkpoints kept
    door = [line for line in result.stdout.splitlines() if line.startswith("BUDGET_OFF")]
    if env.get("BUDGET_OFF") and door != [f"BUDGET_OFF applied={env['BUDGET_OFF']}"]:
        raise RuntimeError(f"door {env['BUDGET_OFF']} was not switched off: {door}")
    return values(result.stdout, "LOOP_TIMER")


def loop_instructions(
    script: Path, env: dict[str, str], cwd: Path, keep: Path | None = None
) -> tuple[float, float]:
    """Run under callgrind; the instructions of CG["batches"] loop batches after CG["warm"].
    ``keep``: an empty folder for callgrind's dumps, left in place (callgrind_profile.py)."""
    dumps = keep or callgrind_window.out_dir()
    paths = [str(HERE), *filter(None, [env.get("PYTHONPATH")])]
    env = {
        **env,
        "CG_LIBRARY": CG["library"],
        "CG_WARM": str(CG["warm"]),
        "CG_BATCHES": str(CG["batches"]),
        "CG_SCALE": str(CG["scale"]),
        "PYTHONPATH": os.pathsep.join(paths),
        "TINY_BATCHES": str(CG["warm"] + CG["batches"] + 10),
    }
    try:
        cycles = CLOCK["field"] == "cycles"
        prefix = callgrind_window.valgrind_prefix(dumps, cache_sim=cycles)
        run([*prefix, PYTHON, script], env, cwd, timeout=3600)
        events = callgrind_window.window_events(dumps)
        if cycles:
            print(f"    events: {events}", flush=True)
            return callgrind_window.estimated_cycles(events), CG["batches"]
        return events["Ir"], CG["batches"]
    finally:
        if keep is None:
            shutil.rmtree(dumps, ignore_errors=True)
        shutil.rmtree(env["RFD_WORKDIR"], ignore_errors=True)


def traced_env(work: Path, name: str, workload: dict[str, object], **extra: object) -> dict:
    return clean_env(
        LOOP_TIMER="1",
        RFD_WORKDIR=work / f"work-{name}",
        TRACEML="1",
        TRACEML_REPORT="0",
        TRACEML_LOGS_DIR=work / "logs",
        TRACEML_RUN_NAME=name,
        **workload,
        **extra,
    )


def bench(name: str, script: Path, pairs: int, workload: dict[str, object]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="traceml-overhead-") as tmp:
        work = Path(tmp)
        counter = {"n": 0}
        batches: list[float] = []
        # Each run's whole loop timer, by variant: its p50/p25 batch (times the batch count) are
        # reported too; a batch slowed by another process lies above them.
        timers: dict[str, list[dict[str, float]]] = {"plain": [], "traced": []}

        def keep(variant: str, env: dict[str, str]) -> float:
            timer = loop_timer(script, env, work)
            batches.append(timer["batches"])
            timers[variant].append(timer)
            return timer[CLOCK["field"]]

        def plain_env(prefix: str) -> dict[str, str]:
            workdir = work / f"{prefix}{counter['n']}"
            return clean_env(LOOP_TIMER="1", RFD_WORKDIR=workdir, **workload)

        def plain() -> float:
            counter["n"] += 1
            return keep("plain", plain_env("plain"))

        def second_env() -> dict[str, str]:
            if SIDE_BY_SIDE["aa"]:  # --aa: both plain (what the method reads for no change)
                return plain_env("aa")
            return traced_env(work, f"run{counter['n']}", workload)

        def traced() -> float:
            counter["n"] += 1
            return keep("traced", second_env())

        if SIDE_BY_SIDE["on"]:
            print(f"{name}: {pairs} pairs (plain vs traced), each pair side by side", flush=True)
            plain_s, traced_s = [], []
            for index in range(pairs):
                counter["n"] += 1
                envs = [plain_env("plain"), second_env()]
                try:
                    # Cores swapped every pair, the launch order every second pair: the run
                    # started second read ~9 us a batch slower in an A/A with one order.
                    pair = side_by_side.run_together(
                        script, envs, work, flip=bool(index % 2), later_first=bool(index // 2 % 2)
                    )
                finally:
                    for env in envs:
                        shutil.rmtree(env["RFD_WORKDIR"], ignore_errors=True)
                for variant, timer, sink in zip(
                    ("plain", "traced"), pair, (plain_s, traced_s), strict=True
                ):
                    batches.append(timer["batches"])
                    timers[variant].append(timer)
                    sink.append(timer[CLOCK["field"]])
                print(
                    f"  {name} pair {index + 1}/{pairs}: {plain_s[-1]:.6g} vs {traced_s[-1]:.6g}",
                    flush=True,
                )
        else:
            print(f"{name}: {pairs} pairs (plain vs traced)", flush=True)
            plain_s, traced_s = alternate(pairs, plain, traced, label=name)
        own_us = own_cost_us(work / "logs")
        own_mean_us = own_cost_us(work / "logs", per_run=statistics.fmean)
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
    runs = list(zip(timers["plain"], timers["traced"], strict=True))
    for label, field in (("p50", "p50_seconds"), ("p25", "p25_seconds")):
        if all(field in p and field in t for p, t in runs):  # an older loop timer has no p50
            added = [(t[field] - p[field]) / steps * 1e6 for p, t in runs]
            print(
                f"  added per batch by the {label} batch: median "
                f"{statistics.median(added):.1f} us (min {min(added):.1f}, max {max(added):.1f})"
            )
    quiet = quiet_pairs(runs)
    if quiet:
        added = [added_us[index] for index in quiet]
        others = [f"{added_us[i]:.1f}" for i in range(len(runs)) if i not in quiet]
        print(
            f"  added per batch over the quiet pairs ({len(quiet)} of {len(runs)}: both runs' p25 "
            f"batch within {QUIET:.0%} of their variant's best): median "
            f"{statistics.median(added):.1f} us (min {min(added):.1f}, max {max(added):.1f}); "
            f"the other pairs: {', '.join(others) or '-'}"
        )
    print(
        f"  traceml_us in the records (median over runs): median step {own_us:.1f} us, "
        f"mean step {own_mean_us:.1f} us"
    )
    return {"ratio": ratio, "added_us": statistics.median(added_us), "steps": steps}


# A run whose p25 batch is more than this above the best p25 of its variant in the same
# invocation ran in one of this VM's slow spells (every batch slower: 10-60% for seconds).
QUIET = 0.05


def quiet_pairs(runs: list[tuple[dict[str, float], dict[str, float]]]) -> list[int]:
    """The pairs whose two runs both ran outside a slow spell, judged by each run's p25 batch
    against the best of its own variant (never against the other variant, so a constant cost
    of traceml's cannot make a pair quiet or not; one that varied from run to run would be
    filtered like a slow spell, hence the other pairs are printed too). A spell shorter than
    three quarters of a run leaves the p25 batch as it is: such a pair counts as quiet.
    Empty without p25 timers."""
    if not runs or not all("p25_seconds" in p and "p25_seconds" in t for p, t in runs):
        return []
    best_plain = min(p["p25_seconds"] / p["batches"] for p, _ in runs)
    best_traced = min(t["p25_seconds"] / t["batches"] for _, t in runs)
    return [
        index
        for index, (p, t) in enumerate(runs)
        if p["p25_seconds"] / p["batches"] <= best_plain * (1 + QUIET)
        and t["p25_seconds"] / t["batches"] <= best_traced * (1 + QUIET)
    ]


def own_cost_us(logs: Path, runs: str = "*", per_run=statistics.median) -> float:
    """Median over the runs (``runs``: a glob of run names) of each run's ``per_run``
    (median by default) ``traceml_us`` per step. The mean is the report's figure and the one
    to set beside the side-by-side total (also a mean): the flusher's writes are counted on
    one step every ~250 ms, which the median step never shows."""
    medians = []
    for path in logs.glob(f"{runs}/ranks/rank_*.jsonl"):
        costs = [
            record["traceml_us"]
            for record in read_records(path)  # step fields by name, whatever the rank schema
            if record is not None
            and record.get("kind") == "step"
            and record.get("traceml_us") is not None
        ]
        if costs:
            medians.append(per_run(costs))
    return statistics.median(medians) if medians else float("nan")


def write_sitecustomize(folder: Path) -> None:
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE)!r})\n"
        "import loop_timer_doors\nloop_timer_doors.install()\n"
    )


def with_site(site: Path) -> str:
    """PYTHONPATH with the sitecustomize folder first and the caller's own after it (a
    PYTHONPATH=<checkout> names the traceml being measured, e.g. an older commit's)."""
    return os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])


def budget(rounds: int, batches: int, only: list[str] | None = None) -> None:
    """Every variant once per round, in an order rotated each round; medians per batch.
    ``only``: the variants to run (plain, traced, off:<door>), default all of them."""
    workload = {**STRESS, "TINY_BATCHES": batches}
    names = only or ["plain", "traced", *(f"off:{door}" for door in DOORS)]
    per_batch: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="traceml-budget-") as tmp:
        work = Path(tmp)
        site = work / "site"
        write_sitecustomize(site)
        for index in range(rounds):
            order = names[index % len(names) :] + names[: index % len(names)]
            for name in order:
                run_name = f"r{index}-{name.replace(':', '-')}"
                layout = {}
                if LAYOUTS["on"]:  # every variant of a round in the same shifted layout
                    classes = LAYOUTS["classes"][index % len(LAYOUTS["classes"])]
                    layout = {"LAYOUT_CLASSES": classes, "PYTHONPATH": with_site(site)}
                if name == "plain":
                    env = clean_env(
                        LOOP_TIMER="1", RFD_WORKDIR=work / run_name, **workload, **layout
                    )
                elif name == "traced":
                    env = traced_env(work, run_name, workload, **layout)
                else:
                    env = traced_env(
                        work,
                        run_name,
                        workload,
                        BUDGET_OFF=name[4:],
                        **{"PYTHONPATH": with_site(site), **layout},
                    )
                seconds, count = loop_seconds(TINY, env, work)
                per_batch[name].append(seconds / count * 1e6)
            print(
                f"  round {index + 1}/{rounds}: "
                + " ".join(f"{n}={per_batch[n][-1]:.1f}" for n in names),
                flush=True,
            )
        if CLOCK["field"] in SIMULATED and "plain" not in per_batch:
            for name, values_ in per_batch.items():  # an A/B of traced variants only
                per = statistics.median(values_) / 1e6
                print(f"  {name}: {per:,.0f} {CLOCK['field']} per batch")
            return
        if CLOCK["field"] in SIMULATED:
            to_us(per_batch, native_plain_us(work, workload))
            own_us = own_cost_us(work / "logs", "native*", per_run=statistics.fmean)
        else:
            own_us = own_cost_us(work / "logs", "*-traced", per_run=statistics.fmean)
    print_budget(per_batch, own_us, rounds, batches)


def native_plain_us(work: Path, workload: dict[str, object], pairs: int = 3) -> float:
    """Plain (and traced, for their records' traceml_us) at native speed, p25 per batch."""
    simulated, CLOCK["field"] = CLOCK["field"], "p25_seconds"
    plain: list[float] = []
    for index in range(pairs):
        env = clean_env(LOOP_TIMER="1", RFD_WORKDIR=work / f"native-plain{index}", **workload)
        seconds, count = loop_seconds(TINY, env, work)
        plain.append(seconds / count * 1e6)
        loop_seconds(TINY, traced_env(work, f"native{index}", workload), work)
    CLOCK["field"] = simulated
    print(f"  native plain loop (p25): {describe(plain, ' us')} per batch", flush=True)
    return statistics.median(plain)


def to_us(per_batch: dict[str, list[float]], plain_us: float) -> None:
    """Instructions per batch (given per 1e6 batches) -> microseconds at the plain loop's
    native rate (instructions per microsecond of the plain loop on this machine)."""
    rate = statistics.median(per_batch["plain"]) / 1e6 / plain_us
    print(
        f"  {CLOCK['field']} per batch: "
        + " ".join(f"{name}={statistics.median(v) / 1e6:.0f}" for name, v in per_batch.items())
    )
    print(f"  plain loop: {rate:.0f} {CLOCK['field']} per us (native p25)", flush=True)
    for values_ in per_batch.values():
        values_[:] = [v / 1e6 / rate for v in values_]


def print_budget(per_batch: dict[str, list[float]], own_us: float, rounds: int, batches: int):
    def paired(a: str, b: str) -> float:
        return statistics.median(x - y for x, y in zip(per_batch[a], per_batch[b], strict=True))

    total = paired("traced", "plain")
    print(
        f"lightning-stress budget: {rounds} rounds, {batches} batches per run, us per batch "
        f"({CLOCK['field']})"
    )
    print(f"  plain loop: {statistics.median(per_batch['plain']):.1f} us per batch")
    print(f"  {'door switched off':<22}{'cost (traced - off)':>22}{'share':>8}")
    accounted = 0.0
    for door in DOORS:
        if f"off:{door}" not in per_batch:
            continue
        cost = paired("traced", f"off:{door}")
        accounted += cost
        print(f"  {door:<22}{cost:>19.1f} us{100 * cost / total:>7.0f}%")
    if all(f"off:{door}" in per_batch for door in DOORS):
        rest = total - accounted
        print(f"  {'rest: fetch + hooks':<22}{rest:>19.1f} us{100 * rest / total:>7.0f}%")
    print(f"  {'total (traced - plain)':<22}{total:>19.1f} us")
    print(
        f"  traceml_us in the records (mean step): {own_us:.1f} us per step "
        f"({100 * own_us / total:.0f}% of the side-by-side total)"
    )
    print(f"SUMMARY budget: stress {total:.1f} us/step added; traceml_us {own_us:.1f}")


def doors(runs: int, batches: int, floor: bool = False) -> None:
    """Where the time inside traceml goes: each entry point's own duration (the guard's
    timer, kept per door by ``loop_timer_doors.py`` with DOOR_TIMES=1), median per call,
    median over ``runs`` traced runs, against the records' ``traceml_us``. What no door sees
    (Lightning's dispatch of the hooks, torch's hooked-module path) is in the side-by-side
    total only."""
    workload = {**STRESS, "TINY_BATCHES": batches}
    per_door: dict[str, list[float]] = {}
    calls: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="traceml-doors-") as tmp:
        work = Path(tmp)
        write_sitecustomize(work / "site")
        for index in range(runs):
            extra = {"DOOR_FLOOR": 1} if floor else {}
            env = traced_env(
                work,
                f"d{index}",
                workload,
                DOOR_TIMES=1,
                PYTHONPATH=with_site(work / "site"),
                **extra,
            )
            result = run([PYTHON, TINY], env, work)
            shutil.rmtree(env["RFD_WORKDIR"], ignore_errors=True)
            for line in result.stderr.splitlines():
                if line.startswith("DOOR_TIME "):
                    name, *fields = line.split()[1:]
                    found = dict(field.split("=") for field in fields)
                    per_door.setdefault(name, []).append(int(found["p50_ns"]) / 1000)
                    calls[name] = int(found["calls"]) / batches
        own_us = own_cost_us(work / "logs")
    what = " with nothing behind them (--floor)" if floor else ""
    print(f"lightning-stress doors{what}: {runs} traced runs, {batches} batches each")
    print(f"  {'entry point':<36}{'calls/batch':>12}{'us per call (p50)':>19}{'us/batch':>10}")
    total = 0.0
    for name, values_ in sorted(per_door.items(), key=lambda kv: -statistics.median(kv[1])):
        per_batch = statistics.median(values_) * calls[name]
        total += per_batch
        print(
            f"  {name:<36}{calls[name]:>12.2f}{statistics.median(values_):>19.2f}{per_batch:>10.1f}"
        )
    print(f"  {'sum':<36}{'':>12}{'':>19}{total:>10.1f}")
    if not floor:  # the floor's runs record no steps
        print(f"  traceml_us in the records (median step): {own_us:.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--skip-rfdetr", action="store_true")
    parser.add_argument("--skip-stress", action="store_true")
    parser.add_argument("--stress-batches", type=int, default=3000)
    parser.add_argument("--budget", action="store_true", help="per-door table (stress only)")
    parser.add_argument(
        "--layouts",
        action="store_true",
        help="with --budget: each round in another memory layout (0, 37, 400, 13, 101, 211 "
        "classes made at start), so that the medians over rounds are not one layout's luck",
    )
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="each pair's plain and traced run at once, each on a core of its own (the same "
        "seconds of the machine's load for both; side_by_side.py)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --budget")
    parser.add_argument(
        "--doors", type=int, default=0, metavar="RUNS", help="per-entry-point time, RUNS runs"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="with --doors: each door with only a list append behind it (the doors' own floor)",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu", "p25", *SIMULATED),
        default="wall",
        help="loop time compared (instructions, cycles: under callgrind, budget only; cycles "
        "simulates the caches and counts callgrind's cycle estimate)",
    )
    parser.add_argument(
        "--variants",
        help="with --budget: comma-separated variants to run (plain,traced,off:<door>)",
    )
    parser.add_argument(
        "--aa",
        action="store_true",
        help="both runs of a pair plain: the spread the method reads where nothing changed",
    )
    args = parser.parse_args()
    SIDE_BY_SIDE["aa"] = args.aa
    LAYOUTS["on"] = args.layouts
    CLOCK["field"] = {
        "wall": "seconds",
        "cpu": "cpu_seconds",
        "p25": "p25_seconds",
        "instructions": "instructions",
        "cycles": "cycles",
    }[args.clock]
    if args.clock in SIMULATED:
        if not args.budget:
            parser.error(f"--clock {args.clock} goes with --budget")
        CG["library"] = str(callgrind_window.build_library(Path(tempfile.mkdtemp())))
    if args.side_by_side:
        why = side_by_side.usable()
        if why or args.budget or args.doors or args.clock in SIMULATED:
            parser.error(f"--side-by-side: {why or 'goes with the pairs only, on a native clock'}")
        SIDE_BY_SIDE["on"] = True
    print(f"clock: {args.clock} time of the loop body", flush=True)
    if args.doors:
        doors(args.doors, args.stress_batches, args.floor)
        return
    if args.budget:
        only = args.variants.split(",") if args.variants else None
        budget(args.rounds, args.stress_batches, only)
        return
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
            "lightning-stress", TINY, args.pairs, {**STRESS, "TINY_BATCHES": args.stress_batches}
        )
    parts = []
    if "rfdetr" in results:
        r = results["rfdetr"]
        parts.append(
            f"RF-DETR loop {100 * (r['ratio'] - 1):+.2f}% "
            f"({r['added_us']:.0f} us/step, target <= 0.3%)"
        )
    if "stress" in results:
        r = results["stress"]
        parts.append(
            f"stress {r['added_us']:.1f} us/step added, ratio {r['ratio']:.3f} (target <= 30 us)"
        )
    print("SUMMARY overhead: " + "; ".join(parts))


if __name__ == "__main__":
    main()
