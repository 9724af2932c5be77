"""Small, exact statistics over plain lists of floats (no numpy: the reducer runs anywhere).

Quantiles use linear interpolation between order statistics (numpy's default, "type 7").
A *sketch* is a list of (value, weight) points standing for a larger sample; merging the
sketches of many ranks gives the overall distribution while the reducer holds one rank's
steps at a time.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Sequence

# Ranks with at most this many steps contribute every value (exact pooled quantiles);
# larger ranks contribute this many evenly spaced quantiles, each weighted n / SKETCH_POINTS.
SKETCH_POINTS = 2049
# Points kept in a summary's distribution of each phase (quantiles at 0, 0.1%, ..., 100%).
DISTRIBUTION_POINTS = 1001

Sketch = tuple[list[float], float]  # sorted values, the weight of each
# How far a quantile of merged sketches can be from the exact one, as a share of the sample's
# rank: a point of a sketch stands for 1/(SKETCH_POINTS - 1) of its rank's values and sits
# within half of that of its true position; interpolating between points adds at most the
# same again. Bounded by 1/1000 (p90 lies between the exact p89.9 and p90.1), held on seeded
# skewed samples in tests/unit/test_partials.py.
QUANTILE_RANK_ERROR = 0.001


def quantile_sorted(values: Sequence[float], p: float) -> float:
    """Type-7 quantile of already sorted ``values`` (non-empty)."""
    n = len(values)
    if n == 1:
        return values[0]
    h = (n - 1) * p
    lo = math.floor(h)
    hi = min(lo + 1, n - 1)
    return values[lo] + (h - lo) * (values[hi] - values[lo])


def describe_sorted(values: Sequence[float]) -> dict[str, float | int]:
    """count, sum, mean, min, median, p90, max of sorted, non-empty ``values``."""
    n = len(values)
    total = math.fsum(values)
    return {
        "count": n,
        "sum": total,
        "mean": total / n,
        "min": values[0],
        "median": quantile_sorted(values, 0.5),
        "p90": quantile_sorted(values, 0.9),
        "max": values[-1],
    }


def sketch_sorted(values: list[float]) -> Sketch:
    """The points that stand for sorted ``values`` when ranks are merged: all of them for a
    small rank, else SKETCH_POINTS evenly spaced order statistics (nearest rank)."""
    n = len(values)
    if n <= SKETCH_POINTS:
        return values, 1.0
    scale = (n - 1) / (SKETCH_POINTS - 1)
    return [values[round(i * scale)] for i in range(SKETCH_POINTS)], n / SKETCH_POINTS


def merged_quantiles(sketches: list[Sketch], ps: Sequence[float]) -> list[float]:
    """Quantiles of the union of weighted sketches; ``ps`` ascending.

    A point of weight w stands for w equal observations occupying ranks S..S+w-1 of the whole
    sample; it sits at the middle of that span, and type-7 interpolation runs over those
    positions. With every weight 1 this is exactly :func:`quantile_sorted` of the pooled values.
    """
    sketches = [s for s in sketches if s[0]]
    if not sketches:
        return [math.nan for _ in ps]
    if all(weight == 1.0 for _values, weight in sketches):
        pooled = sorted(v for values, _weight in sketches for v in values)
        return [quantile_sorted(pooled, p) for p in ps]
    # Built and searched at C speed (zip, accumulate, bisect): a run of many nodes merges
    # nodes x SKETCH_POINTS points per field. Same arithmetic, in the same order, as walking
    # the points: a point's position is the weight before it plus half its own less one.
    points = sorted(
        itertools.chain.from_iterable(
            zip(values, itertools.repeat(w), itertools.repeat((w - 1.0) / 2.0), strict=False)
            for values, w in sketches
        )
    )
    before = itertools.accumulate(map(_second, points), initial=0.0)
    positions = list(map(operator.add, before, map(_third, points)))
    total = sum(len(values) * weight for values, weight in sketches)
    results: list[float] = []
    for p in ps:
        h = (total - 1.0) * p
        index = bisect.bisect_left(positions, h)
        if index == len(positions):  # past the last point (rounding): the largest value
            results.append(points[-1][0])
        elif index == 0 or positions[index] == positions[index - 1]:
            results.append(points[index][0])
        else:
            prev_value, prev_pos = points[index - 1][0], positions[index - 1]
            fraction = (h - prev_pos) / (positions[index] - prev_pos)
            results.append(prev_value + fraction * (points[index][0] - prev_value))
    return results


_second = operator.itemgetter(1)
_third = operator.itemgetter(2)


def distribution_ps(points: int = DISTRIBUTION_POINTS) -> list[float]:
    last = points - 1
    return [i / last for i in range(points)]


def interpolate_distribution(distribution: Sequence[float], p: float) -> float:
    """Quantile ``p`` from an evenly spaced quantile list (as stored in summaries)."""
    return quantile_sorted(distribution, min(1.0, max(0.0, p)))


# ----------------------------------------------------------------------------------------------
# Intervals for means of correlated series (traceml compare, issue 17)

# Upper quantiles of Student's t for 1..10 degrees of freedom, for the two levels compare
# uses. Below ~10 df the Cornish-Fisher series used above that is off by more than 1%, and
# these small-sample cases (2 or 3 runs a side) are exactly where the interval matters most.
_T_SMALL_DF: dict[float, tuple[float, ...]] = {
    0.95: (6.313752, 2.919986, 2.353363, 2.131847, 2.015048,
           1.943180, 1.894579, 1.859548, 1.833113, 1.812461),
    0.975: (12.706205, 4.302653, 3.182446, 2.776445, 2.570582,
            2.446912, 2.364624, 2.306004, 2.262157, 2.228139),
}  # fmt: skip
_Z = {0.95: 1.6448536269514722, 0.975: 1.959963984540054}  # standard normal quantiles

# Batch means: at least this many batches (so the variance has some degrees of freedom), at
# most this many (so each batch spans many autocorrelation times on long runs).
MIN_BATCHES = 4
MAX_BATCHES = 30
# Batches shorter than this keep too much of the step-to-step correlation inside them: with
# AR(1) rho 0.5, 7-step batches understate the variance by ~18%, 10-step ones by ~13%.
MIN_BATCH_STEPS = 10


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile (0.95 or 0.975) of Student's t with ``df`` (possibly fractional)
    degrees of freedom; infinity below 1 df (no estimate of spread at all)."""
    table = _T_SMALL_DF[p]
    if not df >= 1.0:  # also catches nan
        return math.inf
    if df <= len(table):
        low = math.floor(df)
        if low == df:
            return table[low - 1]
        # Interpolate in 1/df, in which the quantile is nearly linear.
        weight = (1.0 / low - 1.0 / df) / (1.0 / low - 1.0 / (low + 1))
        return table[low - 1] + weight * (table[low] - table[low - 1])
    z = _Z[p]
    if math.isinf(df):
        return z
    # Cornish-Fisher expansion of t in powers of 1/df (Abramowitz & Stegun 26.7.5).
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def batch_count(points: int) -> int:
    """How many contiguous batches a series of ``points`` is cut into: about sqrt(n), so batch
    length and batch count grow together; at most MAX_BATCHES, batches of at least
    MIN_BATCH_STEPS unless that leaves fewer than MIN_BATCHES."""
    wanted = min(round(math.sqrt(points)), points // MIN_BATCH_STEPS, MAX_BATCHES)
    return max(1, min(points, max(MIN_BATCHES, wanted)))


def batch_means(
    values: Sequence[float], weights: Sequence[float] | None = None, batches: int | None = None
) -> tuple[float, float, int]:
    """(weighted mean, variance of that mean, batches used) by the method of batch means.

    Consecutive steps are correlated (warm caches, data order, other processes), so the plain
    s^2/n understates the variance of a mean. The means of long contiguous batches are nearly
    independent; their spread, divided by their number, estimates the variance of the overall
    mean whatever the correlation inside a batch. Degrees of freedom: batches - 1.
    """
    n = len(values)
    if weights is None:
        weights = [1.0] * n
    total = math.fsum(weights)
    if n == 0 or total <= 0:
        return math.nan, math.inf, 0
    mean = math.fsum(v * w for v, w in zip(values, weights, strict=True)) / total
    count = batch_count(n) if batches is None else max(1, min(batches, n))
    if count < 2:
        return mean, math.inf, count
    means = []
    for index in range(count):
        start, stop = (index * n) // count, ((index + 1) * n) // count
        weight = math.fsum(weights[start:stop])
        means.append(
            math.fsum(v * w for v, w in zip(values[start:stop], weights[start:stop], strict=True))
            / weight
        )
    centre = math.fsum(means) / count
    spread = math.fsum((m - centre) ** 2 for m in means) / (count - 1)
    return mean, spread / count, count


# Below this many batches, batch means alone understate the variance of a mean of correlated
# steps (batches only a few autocorrelation times long, and too few of them): the AR(1)
# estimate below is taken when it is larger.
SHORT_SERIES_BATCHES = 10
_MAX_LAG1 = 0.9


def lag1_autocorrelation(values: Sequence[float]) -> float | None:
    """Lag-1 autocorrelation of ``values`` (unclamped); None below 3 values or when they are
    all equal."""
    n = len(values)
    if n < 3:
        return None
    mean = math.fsum(values) / n
    centred = [value - mean for value in values]
    variance = math.fsum(value * value for value in centred)
    if variance <= 0:
        return None
    return math.fsum(a * b for a, b in itertools.pairwise(centred)) / variance


def ar1_mean_variance(values: Sequence[float]) -> float:
    """Variance of the mean of ``values`` if they were an AR(1) series: s^2/n (1+r)/(1-r), with
    the lag-1 autocorrelation r corrected for its downward small-sample bias (about
    -(1 + 3r)/n) and kept in [0, 0.9]; inf below 3 values."""
    n = len(values)
    if n < 3:
        return math.inf
    lag1 = lag1_autocorrelation(values)
    if lag1 is None:
        return 0.0  # all equal
    r = min(_MAX_LAG1, max(0.0, lag1 + (1.0 + 3.0 * lag1) / n))
    return weighted_sd(values) ** 2 / n * (1.0 + r) / (1.0 - r)


def weighted_sd(values: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """Standard deviation (n - 1 in the denominator, n = total weight)."""
    if weights is None:  # the same sums as with unit weights (fsum is exactly rounded)
        n = len(values)
        if n <= 1:
            return math.nan
        mean = math.fsum(values) / n
        return math.sqrt(math.fsum([(v - mean) ** 2 for v in values]) / (n - 1))
    total = math.fsum(weights)
    if total <= 1:
        return math.nan
    mean = math.fsum(v * w for v, w in zip(values, weights, strict=True)) / total
    square = math.fsum(w * (v - mean) ** 2 for v, w in zip(values, weights, strict=True))
    return math.sqrt(square / (total - 1))


def compress(sketches: list[Sketch], points: int = SKETCH_POINTS) -> Sketch:
    """One sketch of ``points`` evenly spaced quantiles standing for the union of
    ``sketches`` (each point weighs total / points): how a node's ranks, or many nodes, are
    merged into a bounded number of points."""
    total = math.fsum(len(values) * weight for values, weight in sketches)
    last = points - 1
    values = merged_quantiles(sketches, [i / last for i in range(points)])
    return values, total / points
