"""Where in the batch-time distribution does tracing add its time? Plain vs traced stress loop,
alternating, in one invocation; the added mean per batch split into quantile bands.

The target (<= 30 us per batch) is a mean, and the mean and the 25th-percentile batch disagree
by 20-30 us: the side-by-side mean counts periodic work (the flusher's encoding every 100 ms,
telemetry every second, RSS every 10 ms) and cold-cache slow batches that the p25 batch never
shows. Sorting each run's batch times, the mean difference is the sum over quantile bands of
(traced - plain) at the same rank, divided by the batch count; each band's share says whether
the cost is in every batch (the body) or in a few (the tail).

Also counts the garbage collector's runs and time per generation over the whole process
(imports included, the same in both but for traceml's own): a traced loop that allocated more
would collect more often.

    python benchmarks/overhead_tail.py                 # 5 pairs of 3,000 batches, ~3 minutes
    python benchmarks/overhead_tail.py --pairs 7 --batches 5000
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from _common import PYTHON, TINY, alternate, clean_env, run, values

BANDS = ((0, 25), (25, 50), (50, 75), (75, 90), (90, 99), (99, 99.9), (99.9, 100))
QUANTILES = (10, 25, 50, 75, 90, 99)

# Loaded at interpreter start: the collector's runs and time per generation, printed at exit
# as ``GC_COUNTS g0=<runs> g0_ms=<time> ...``.
_SITE = r"""
import atexit, gc, sys, time
stats = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
started = [0.0]

def callback(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        entry = stats[info["generation"]]
        entry[0] += 1
        entry[1] += time.perf_counter() - started[0]

gc.callbacks.append(callback)

def report():
    if "lightning.pytorch" not in sys.modules:  # a helper process of traceml's, not the training
        return
    items = " ".join(f"g{g}={n} g{g}_ms={t * 1000:.3f}" for g, (n, t) in stats.items())
    print("GC_COUNTS " + items, flush=True)

atexit.register(report)
"""


def sorted_durations(path: Path) -> list[int]:
    return sorted(int(line) for line in path.read_text().split())


def band_shares(plain: list[int], traced: list[int]) -> list[float]:
    """Each band's share of the mean difference, us per batch (the shares sum to it)."""
    n = min(len(plain), len(traced))
    plain, traced = plain[len(plain) - n :], traced[len(traced) - n :]
    shares = []
    for low, high in BANDS:
        first, last = int(n * low / 100), int(n * high / 100)
        added = sum(traced[i] - plain[i] for i in range(first, last))
        shares.append(added / n / 1000)
    return shares


def mean_us(durations: list[int]) -> float:
    return sum(durations) / len(durations) / 1000


def quantile_us(durations: list[int], q: float) -> float:
    return durations[min(len(durations) - 1, int(len(durations) * q / 100))] / 1000


def one_run(work: Path, name: str, traced: bool, batches: int, site: Path) -> dict:
    dump = work / f"{name}.txt"
    extra = {"TRACEML": "1", "TRACEML_REPORT": "0", "TRACEML_LOGS_DIR": work / "logs"}
    env = clean_env(
        LOOP_TIMER="1",
        LOOP_TIMER_DURATIONS=dump,
        RFD_WORKDIR=work / f"work-{name}",
        TRACEML_RUN_NAME=name,
        TINY_VALIDATE=0,
        TINY_BATCHES=batches,
        PYTHONPATH=site,
        **(extra if traced else {}),
    )
    result = run([PYTHON, TINY], env, work)
    gc_counts = values(result.stdout, "GC_COUNTS")
    return {"durations": sorted_durations(dump), "gc": gc_counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--batches", type=int, default=3000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="traceml-tail-") as tmp:
        work = Path(tmp)
        site = work / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(_SITE)
        counter = itertools.count()

        def runner(traced: bool) -> Callable[[], dict]:
            def one() -> dict:
                name = f"{'traced' if traced else 'plain'}{next(counter)}"
                return one_run(work, name, traced, args.batches, site)

            return one

        plain, traced = alternate(args.pairs, runner(False), runner(True))
    runs = {"plain": plain, "traced": traced}
    for index, (p, t) in enumerate(zip(plain, traced, strict=True)):
        diff = mean_us(t["durations"]) - mean_us(p["durations"])
        print(f"  pair {index + 1}/{args.pairs}: mean added {diff:+.1f} us a batch")
    report(runs)


def report(runs: dict[str, list[dict]]) -> None:
    pairs = list(zip(runs["plain"], runs["traced"], strict=True))
    print("\nbatch time by quantile, us (median over runs):")
    print("  variant  " + "  ".join(f"{f'p{q}':>7}" for q in QUANTILES) + "     mean")
    for variant in ("plain", "traced"):
        cells = [
            statistics.median(quantile_us(r["durations"], q) for r in runs[variant])
            for q in QUANTILES
        ]
        mean = statistics.median(mean_us(r["durations"]) for r in runs[variant])
        print(f"  {variant:7}  " + "  ".join(f"{c:7.1f}" for c in cells) + f"  {mean:7.1f}")
    print("\nadded mean per batch, split by quantile band (us per batch, median over pairs):")
    shares = [band_shares(p["durations"], t["durations"]) for p, t in pairs]
    for index, (low, high) in enumerate(BANDS):
        values_ = [s[index] for s in shares]
        print(
            f"  p{low:<5g}-p{high:<5g} {statistics.median(values_):+7.2f}"
            f"   (pairs: {', '.join(f'{v:+.1f}' for v in values_)})"
        )
    totals = [sum(s) for s in shares]
    print(
        f"  total          {statistics.median(totals):+7.2f}"
        f"   (pairs: {', '.join(f'{v:+.1f}' for v in totals)})"
    )
    print("\ngarbage collections in the process (median over runs):")
    for variant in ("plain", "traced"):
        cells = []
        for generation in range(3):
            count = statistics.median(r["gc"][f"g{generation}"] for r in runs[variant])
            ms = statistics.median(r["gc"][f"g{generation}_ms"] for r in runs[variant])
            cells.append(f"gen{generation} {count:.0f} runs {ms:.1f} ms")
        print(f"  {variant:7}  " + ", ".join(cells))


if __name__ == "__main__":
    main()
