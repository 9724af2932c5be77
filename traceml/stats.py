"""Small, exact statistics over plain lists of floats (no numpy: the reducer runs anywhere).

Quantiles use linear interpolation between order statistics (numpy's default, "type 7").
A *sketch* is a list of (value, weight) points standing for a larger sample; merging the
sketches of many ranks gives the overall distribution while the reducer holds one rank's
steps at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Ranks with at most this many steps contribute every value (exact pooled quantiles);
# larger ranks contribute this many evenly spaced quantiles, each weighted n / SKETCH_POINTS.
SKETCH_POINTS = 2049
# Points kept in a summary's distribution of each phase (quantiles at 0, 0.1%, ..., 100%).
DISTRIBUTION_POINTS = 1001

Sketch = tuple[list[float], float]  # sorted values, the weight of each


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
    points = sorted((v, w) for values, w in sketches for v in values)
    total = sum(len(values) * weight for values, weight in sketches)
    targets = [(total - 1.0) * p for p in ps]
    results: list[float] = []
    prev_value = prev_pos = None
    cumulative = 0.0
    index = 0
    for value, weight in points:
        position = cumulative + (weight - 1.0) / 2.0
        cumulative += weight
        while index < len(targets) and targets[index] <= position:
            h = targets[index]
            if prev_value is None or position == prev_pos:
                results.append(value)
            else:
                fraction = (h - prev_pos) / (position - prev_pos)
                results.append(prev_value + fraction * (value - prev_value))
            index += 1
        prev_value, prev_pos = value, position
        if index == len(targets):
            break
    while len(results) < len(ps):
        results.append(prev_value)
    return results


def distribution_ps(points: int = DISTRIBUTION_POINTS) -> list[float]:
    last = points - 1
    return [i / last for i in range(points)]


def interpolate_distribution(distribution: Sequence[float], p: float) -> float:
    """Quantile ``p`` from an evenly spaced quantile list (as stored in summaries)."""
    return quantile_sorted(distribution, min(1.0, max(0.0, p)))
