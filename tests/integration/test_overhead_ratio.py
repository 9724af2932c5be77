"""traceml's added cost per step on the stress loop stays within twice its budget.

A ratio measured side by side in this one test, never an absolute time. Each pair is a plain
and a traced run of the tiny Lightning script at once, each pinned to a core of its own, their
loops released together (``benchmarks/side_by_side.py``): both time their loops over the same
seconds, so a spell of load on a shared runner slows both alike. Each times only Lightning's
per-batch loop body (``scripts/loop_timer.py``) by the batches' 25th-percentile wall time
(batches slowed by other work lie above it). The cores and the launch order are swapped from
pair to pair.

Why not one run after the other, as this test did until 2026-12-07: a spell of load outlasted
twelve alternating rounds there (traced/plain 1.218 by the least disturbed runs, the rounds'
median 1.114, in CI on a commit that read 0.999 alone ten minutes later and whose per-batch
work had not changed), while the side-by-side benchmark in the same hour read +48 us by the
p25 batch (1.07).

The ratio must stay under ``1 + 2 * BUDGET_RATIO``. The budget is 30 us added to the stress
loop's ~650 us step (docs/overhead.md); both are Python-bound, so the ratio carries over to
faster or slower machines where microseconds would not. The verdict is the median of the pairs'
own ratios (a regression raises every traced run, so every pair). A median above the bar is
measured again with more pairs, up to ``MAX_PAIRS``, before the test fails: the median of more
pairs only comes nearer the true cost. It also passes when the least disturbed traced run over
the least disturbed plain run is under the bar (a regression raises that too). Where runs
cannot go side by side (no ``taskset``, one core), they alternate, one after the other.
``benchmarks/overhead.py --budget`` says which door went over.
"""

from __future__ import annotations

import statistics
import sys

from traceml import schema

from procs import FIGURES, PYTHON, ROOT, TINY, clean_env, rank_records, run, steps_of

sys.path.insert(0, str(ROOT / "benchmarks"))  # side_by_side's own imports (_common)
try:
    import side_by_side
    from _common import values  # the LOOP_TIMER line, as side_by_side reads it
finally:
    sys.path.remove(str(ROOT / "benchmarks"))

BUDGET_US_PER_STEP = 30.0
STRESS_STEP_US = 650.0  # the plain stress loop per batch (benchmarks/results/overhead.txt)
BUDGET_RATIO = BUDGET_US_PER_STEP / STRESS_STEP_US
BAR = 1 + 2 * BUDGET_RATIO
PAIRS = 4
MORE_PAIRS = 4  # each time the pairs so far read above the bar
MAX_PAIRS = 16
BATCHES = 2000


def env_of(tmp_path, traced: bool, index: int) -> dict[str, str]:
    env = clean_env(LOOP_TIMER="1", TINY_BATCHES=str(BATCHES), TINY_VALIDATE="0")
    if traced:
        env.update(
            TRACEML="1",
            TRACEML_REPORT="0",
            TRACEML_LOGS_DIR=str(tmp_path / "logs"),
            TRACEML_RUN_NAME=f"run{index}",
        )
    return env


def p25_seconds(timer: dict[str, float]) -> float:
    assert int(timer["batches"]) == BATCHES
    return timer["p25_seconds"]


def one_after_the_other(tmp_path, traced: bool, index: int) -> float:
    result = run([PYTHON, TINY], env_of(tmp_path, traced, index), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return p25_seconds(values(result.stdout, "LOOP_TIMER"))


def measure(tmp_path, runs: dict[bool, list[float]], pairs: int, together: bool) -> None:
    """``pairs`` more pairs into ``runs`` (cores and launch order swapped from pair to pair;
    one after the other, the order flipped, where they cannot go together)."""
    for _ in range(pairs):
        index = len(runs[True])
        if together:
            plain, traced = side_by_side.run_together(
                TINY,
                [env_of(tmp_path, False, index), env_of(tmp_path, True, index)],
                tmp_path,
                flip=index % 2 == 1,
                later_first=index // 2 % 2 == 1,
            )
            runs[False].append(p25_seconds(plain))
            runs[True].append(p25_seconds(traced))
        else:
            for traced in [False, True] if index % 2 == 0 else [True, False]:
                runs[traced].append(one_after_the_other(tmp_path, traced, index))
        traced_every_step(tmp_path, index)


def traced_every_step(tmp_path, index: int) -> None:
    """The traced run traced its every batch to a completed footer: a traced run that stopped
    tracing (a failure turns it off, one warning) would read as no cost at all."""
    records = rank_records(tmp_path / "logs" / f"run{index}")
    assert records[-1]["kind"] == "footer", records[-1]
    assert records[-1]["status"] == schema.STATUS_COMPLETED, records[-1]
    assert len(steps_of(records)) == BATCHES


def ratios(runs: dict[bool, list[float]]) -> tuple[float, float]:
    """The median of the pairs' own traced/plain ratios; the least disturbed runs' ratio."""
    paired = statistics.median(t / p for t, p in zip(runs[True], runs[False], strict=True))
    return paired, min(runs[True]) / min(runs[False])


def test_added_cost_per_step_is_within_twice_the_budget(tmp_path):
    together = side_by_side.usable() is None
    runs: dict[bool, list[float]] = {False: [], True: []}
    measure(tmp_path, runs, PAIRS, together)
    paired, least = ratios(runs)
    while paired > BAR and least > BAR and len(runs[True]) < MAX_PAIRS:
        measure(tmp_path, runs, MORE_PAIRS, together)
        paired, least = ratios(runs)
    how = "side by side" if together else f"one after the other ({side_by_side.usable()})"
    measured = (
        f"traced/plain {paired:.3f} on the stress loop, the median of {len(runs[True])} pairs "
        f"{how} (~{(paired - 1) * STRESS_STEP_US:.0f} us per step on a {STRESS_STEP_US:.0f} us "
        f"step; budget {BUDGET_US_PER_STEP:.0f} us, bar {BAR:.3f}); the least disturbed runs' "
        f"{least:.3f}"
    )
    FIGURES.append(f"overhead ratio (issue 23): {measured}")
    assert paired <= BAR or least <= BAR, (
        f"above twice the budget (docs/overhead.md, issue 23): {measured}"
    )
