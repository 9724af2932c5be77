"""traceml's added cost per step on the stress loop stays within twice its budget.

A ratio measured side by side in this one test, never an absolute time: plain and traced runs
of the tiny Lightning script alternate (order flipped every round), each timing only
Lightning's per-batch loop body (``scripts/loop_timer.py``) by the batches' 25th-percentile
wall time (batches slowed by other work on a shared runner lie above it). The ratio is the
least disturbed traced run's over the least disturbed plain run's (load on a shared runner only
ever adds time, to either variant; a real regression raises every traced run), and it must stay
under ``1 + 2 * BUDGET_RATIO``. The budget is 30 us added to the stress loop's ~650 us step
(docs/overhead.md); both are Python-bound, so the ratio carries over to faster or slower
machines where microseconds would not. A ratio above the bar is measured again with more rounds,
up to ``MAX_ROUNDS``, before the test fails: a spell of load on the runner can outlast six rounds
(it did on 2026-12-05: 1.123 after six, while the same commit read 1.002 and 1.087 that hour),
and the minimum over more runs only comes nearer the true cost; a regression raises every
traced run, however many.
It fails only when the median of the rounds' own ratios is above the bar too: a lucky plain
run (one quiet second on a loaded runner) lifts the ratio of the minima alone. It read 1.138
after twelve rounds in a loaded hour on 2026-12-06, the rounds' median 1.055; a regression
raises every traced run, so both.
``benchmarks/overhead.py --budget`` says which door went over.
"""

from __future__ import annotations

import statistics

from procs import FIGURES, PYTHON, TINY, clean_env, run

BUDGET_US_PER_STEP = 30.0
STRESS_STEP_US = 650.0  # the plain stress loop per batch (benchmarks/results/overhead.txt)
BUDGET_RATIO = BUDGET_US_PER_STEP / STRESS_STEP_US
BAR = 1 + 2 * BUDGET_RATIO
ROUNDS = 3
MORE_ROUNDS = 3  # each time the rounds so far read above the bar
MAX_ROUNDS = 12
BATCHES = 2000


def loop_seconds(tmp_path, traced: bool, index: int) -> float:
    env = clean_env(LOOP_TIMER="1", TINY_BATCHES=BATCHES, TINY_VALIDATE=0)
    if traced:
        env.update(
            TRACEML="1",
            TRACEML_REPORT="0",
            TRACEML_LOGS_DIR=str(tmp_path / "logs"),
            TRACEML_RUN_NAME=f"run{index}",
        )
    result = run([PYTHON, TINY], env, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("LOOP_TIMER")][-1]
    fields = dict(item.split("=") for item in line.split()[1:])
    assert int(fields["batches"]) == BATCHES
    return float(fields["p25_seconds"])


def measure(tmp_path, runs: dict[bool, list[float]], rounds: int) -> float:
    """``rounds`` more alternating rounds (order flipped each round) into ``runs``; the ratio
    of the least disturbed runs so far."""
    for _ in range(rounds):
        index = len(runs[True])
        order = [False, True] if index % 2 == 0 else [True, False]
        for traced in order:
            runs[traced].append(loop_seconds(tmp_path, traced, index))
    return min(runs[True]) / min(runs[False])


def median_ratio(runs: dict[bool, list[float]]) -> float:
    """The median of the rounds' own traced/plain ratios."""
    return statistics.median(t / p for t, p in zip(runs[True], runs[False], strict=True))


def test_added_cost_per_step_is_within_twice_the_budget(tmp_path):
    runs: dict[bool, list[float]] = {False: [], True: []}
    ratio = measure(tmp_path, runs, ROUNDS)
    paired = median_ratio(runs)
    while ratio > BAR and paired > BAR and len(runs[True]) < MAX_ROUNDS:
        ratio = measure(tmp_path, runs, MORE_ROUNDS)
        paired = median_ratio(runs)
    measured = (
        f"traced/plain {ratio:.3f} on the stress loop (~{(ratio - 1) * STRESS_STEP_US:.0f} us "
        f"per step on a {STRESS_STEP_US:.0f} us step; budget {BUDGET_US_PER_STEP:.0f} us, bar "
        f"{BAR:.3f}); {len(runs[True])} rounds, median of the rounds' ratios {paired:.3f}"
    )
    FIGURES.append(f"overhead ratio (issue 23): {measured}")
    assert ratio <= BAR or paired <= BAR, (
        f"above twice the budget (docs/overhead.md, issue 23): {measured}"
    )
