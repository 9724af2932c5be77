"""Where the stress loop's added time goes: traceml's doors, or the traced process around them.

Each pair runs the plain and the traced stress loop side by side (``side_by_side.py``: a core
each, loops released together, cores and launch order alternated). The traced run stops
tracing halfway (``TRACEML_TRACE_MAX_STEPS``): its doors come off and its per-step hooks go
quiet, while the process keeps what tracing made (threads, imports, the callback in
Lightning's list, its memory). Both runs keep every batch's time (``LOOP_TIMER_DURATIONS``).
Per pair, by the 25th-percentile batch of two windows, the middle of each half:

* doors: the traced run's first window minus its second, less the plain run's drift between
  the same windows. One process against itself: the memory layout (the method cache's
  lottery) and the process-to-process spread cancel. What it reads where nothing that costs
  changes halfway: two plain runs, +1.9 us (sd 6.0, 12 pairs); a plain run that starts an
  idle thread halfway, -3.1 (sd 14.4). Across processes the same pairs spread by 13-23 us.
* process: the traced run's second window minus the plain run's: a traced process whose
  doors are off, against plain, across processes.
* total: the first windows, traced minus plain (what ``overhead.py --side-by-side`` reads).

With ``--churn``, the second run is not traced: it is a plain run that, in its first half
only, makes Python objects each batch (300 small tuples, floats and dicts; 5 kept), as a
traced step's events and records do, then nothing. Its "process" figure is what a phase of
allocation alone leaves on the untraced loop after it (stop 53: +9.3 us a batch late in the
run, against +12.5 for the traced process with its doors off).

    python benchmarks/overhead_split.py                # 12 pairs of 3,000 batches, ~2 minutes
    python benchmarks/overhead_split.py --pairs 20 --batches 4000
    python benchmarks/overhead_split.py --churn
    python benchmarks/overhead_split.py --off forward,transfer,guard,input,telemetry

``--off DOORS`` switches those doors' work off in the traced run (``BUDGET_OFF``, as
``overhead.py --budget``): its "process" figure then says whether that work's after-effect is
what the door-free half pays (stop 53: with the training thread's doors off, +2.3 late in the
run; with the flusher's record and write off, +19.9).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import side_by_side
from _common import TINY, clean_env
from overhead import (  # the traced run's environment, as overhead.py's
    STRESS,
    traced_env,
    with_site,
    write_sitecustomize,
)

# The windows, as fractions of the batches: each half's middle, clear of the first batches
# (warm-up) and of the batches around the limit (the doors coming off, the last flush).
FIRST, SECOND = (0.13, 0.48), (0.52, 0.87)


def p25_us(durations_ns: list[int], window: tuple[float, float]) -> float:
    count = len(durations_ns)
    part = sorted(durations_ns[int(window[0] * count) : int(window[1] * count)])
    return part[len(part) // 4] / 1000.0


def read_durations(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()]


def split_pair(plain: list[int], traced: list[int]) -> dict[str, float]:
    """One pair's figures (us a batch), from each run's batch times in ns."""
    plain_first, plain_second = p25_us(plain, FIRST), p25_us(plain, SECOND)
    traced_first, traced_second = p25_us(traced, FIRST), p25_us(traced, SECOND)
    return {
        "doors": (traced_first - traced_second) - (plain_first - plain_second),
        "process": traced_second - plain_second,
        "total": traced_first - plain_first,
    }


CHURN = """\
import os
import torch.autograd

_backward, _left, _kept = torch.autograd.backward, [int(os.environ["SPLIT_CHURN_STEPS"])], []


def backward(*args, **kwargs):
    if _left[0] > 0:  # the first half: a traced step's worth of Python objects, a few kept
        _left[0] -= 1
        made = [(i, i + 0.5, {"k": i}) for i in range(300)]
        _kept.append(made[::60])
    return _backward(*args, **kwargs)


torch.autograd.backward = backward
"""


def churn_env(work: Path, common: dict, steps: int, **extra: object) -> dict[str, str]:
    """A plain run whose first ``steps`` backward calls also make objects (``CHURN``, loaded
    by a ``sitecustomize`` on PYTHONPATH)."""
    site = work / "churn-site"
    if not site.exists():
        site.mkdir()
        (site / "sitecustomize.py").write_text(CHURN)
    return clean_env(**common, **extra, SPLIT_CHURN_STEPS=steps, PYTHONPATH=site)


def second_env(
    args: argparse.Namespace, work: Path, index: int, common: dict, durations: Path
) -> dict[str, str]:
    """The second run's environment: traced (its doors' work switched off with ``--off``), or
    with ``--churn`` plain and making objects."""
    half = args.batches // 2
    if args.churn:
        return churn_env(
            work,
            common,
            half,
            LOOP_TIMER=1,
            RFD_WORKDIR=work / f"w{index}c",
            LOOP_TIMER_DURATIONS=durations,
        )
    env = traced_env(
        work, f"split{index}", common, LOOP_TIMER_DURATIONS=durations, TRACEML_TRACE_MAX_STEPS=half
    )
    if args.off:
        site = work / "site"
        if not site.exists():
            write_sitecustomize(site)
        env.update(BUDGET_OFF=args.off, PYTHONPATH=with_site(site))
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument(
        "--churn", action="store_true", help="second run: plain, making objects in its first half"
    )
    parser.add_argument(
        "--off", default="", help="doors whose work the traced run switches off (BUDGET_OFF)"
    )
    args = parser.parse_args()
    second = "traced" + (f" (off: {args.off})" if args.off else "")
    if args.churn:
        second = "churning plain"
    why = side_by_side.usable()
    if why:
        parser.error(f"runs cannot go side by side here: {why}")
    with tempfile.TemporaryDirectory(prefix="traceml-split-") as tmp:
        work = Path(tmp)
        figures: dict[str, list[float]] = {"doors": [], "process": [], "total": []}
        print(
            f"lightning-stress split: {args.pairs} pairs side by side, {args.batches} batches, "
            f"the {second} run's first {args.batches // 2} differ",
            flush=True,
        )
        for index in range(args.pairs):
            files = [work / f"plain{index}.ns", work / f"traced{index}.ns"]
            common = {**STRESS, "TINY_BATCHES": args.batches}
            envs = [
                clean_env(
                    **common,
                    LOOP_TIMER=1,
                    RFD_WORKDIR=work / f"w{index}p",
                    LOOP_TIMER_DURATIONS=files[0],
                ),
                second_env(args, work, index, common, files[1]),
            ]
            side_by_side.run_together(
                TINY, envs, work, flip=bool(index % 2), later_first=bool(index // 2 % 2)
            )
            pair = split_pair(*(read_durations(path) for path in files))
            for name, value in pair.items():
                figures[name].append(value)
            print(
                f"  pair {index + 1}/{args.pairs}: doors {pair['doors']:+.1f}, process "
                f"{pair['process']:+.1f}, total {pair['total']:+.1f} us a batch",
                flush=True,
            )
    for name, what in (
        ("doors", f"the {second} run's first half against its second, less plain's drift"),
        ("process", f"the {second} run's second half (doors off, no churn), against plain"),
        ("total", f"the {second} run's first half against plain's"),
    ):
        values = figures[name]
        print(
            f"  {name:<8} median {statistics.median(values):+6.1f} us a batch "
            f"(sd {statistics.pstdev(values):4.1f}, min {min(values):+.1f}, max {max(values):+.1f})"
            f": {what}"
        )
    print(
        f"SUMMARY split: doors {statistics.median(figures['doors']):+.1f} us, process "
        f"{statistics.median(figures['process']):+.1f} us, total "
        f"{statistics.median(figures['total']):+.1f} us a batch (p25, {args.pairs} pairs)"
    )


if __name__ == "__main__":
    main()
