"""The noise floor of a one-run-a-side comparison, measured from identical runs.

With one run a side, a comparison cannot see how much a whole run differs from the next one
(a fast first run, a busy machine): within-run statistics are blind to it. The floor says how
large a step-time change two runs of the *same* code show on this machine. From ``n`` identical
runs the spread ``s`` of their log mean step times estimates the run-to-run noise; the
difference of two new such runs is ``N(0, 2 s^2)``, and with ``s`` estimated on ``n - 1``
degrees of freedom its one-sided 95% prediction bound is ``t(0.95, n - 1) * sqrt(2) * s``: the
same 5%-per-claim level as compare's intervals. Few runs give a wide floor (t is 2.92 on two
degrees of freedom), which is the honest price of knowing little.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from traceml import schema
from traceml.analysis import stats
from traceml.analysis.compare_estimate import MIN_EFFECT, pct_change, run_estimate
from traceml.analysis.compare_load import CompareInputError
from traceml.analysis.compare_setup import setup_spread

MIN_RUNS = 2  # two runs give one degree of freedom (a very wide floor); 3 or more recommended
RECOMMENDED_RUNS = 3
MAX_FLOOR_PCT = 100.0  # what --noise-floor accepts (a percentage in [0, 100))


@dataclass(frozen=True)
class NoiseFloor:
    """The floor (in %), and what it rests on."""

    pct: float
    runs: int
    run_cv_pct: float  # the spread of the runs' log mean step times, ~ run-to-run CV
    df: int


def measure_noise_floor(summaries: list[dict[str, Any]]) -> NoiseFloor:
    """The floor from identical runs' summaries; CompareInputError when they cannot give one."""
    if len(summaries) < MIN_RUNS:
        raise CompareInputError(
            f"--noise-floor-from needs at least {MIN_RUNS} runs of the same code "
            f"({RECOMMENDED_RUNS} or more recommended), got {len(summaries)}"
        )
    differ = setup_spread(summaries)
    if differ:
        raise CompareInputError(
            "--noise-floor-from needs runs of the same setup: " + "; ".join(differ)
        )
    logs = []
    for summary in summaries:
        estimate = run_estimate(summary, schema.STEP)
        if estimate is None or estimate.mean <= 0:
            raise CompareInputError(
                f"{summary.get('_path') or summary.get(schema.RUN)} has no step times to measure"
            )
        logs.append(math.log(estimate.mean))
    mean = sum(logs) / len(logs)
    df = len(logs) - 1
    spread = math.sqrt(sum((x - mean) ** 2 for x in logs) / df)
    bound = stats.t_quantile(0.95, df) * math.sqrt(2.0) * spread
    floor = max(pct_change(bound), MIN_EFFECT * 100)
    if not round(floor, 1) < MAX_FLOOR_PCT:
        # Suggesting it would suggest a command that --noise-floor refuses (and a floor that
        # hides any change): runs this far apart measure no floor at all.
        names = ", ".join(str(s.get("_path") or s.get(schema.RUN)) for s in summaries)
        raise CompareInputError(
            f"{names} are too different to measure a noise floor: their mean step times spread "
            f"by {spread * 100:.0f}%, a floor of {floor:.0f}% (--noise-floor takes under "
            f"{MAX_FLOOR_PCT:g}%); give runs of the same code and setup on one machine"
        )
    return NoiseFloor(pct=floor, runs=len(logs), run_cv_pct=spread * 100, df=df)
