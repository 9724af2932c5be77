"""Robust trends over a run: is memory creeping, how fast, and when would it run out.

Pure functions over plain lists (no numpy: the reducer runs anywhere). The slope is
Theil-Sen's (the median of the slopes between every pair of points), which one-off jumps --
a validation pass, the allocator growing a pool -- cannot drag the way they drag least
squares: up to ~29% of the points can be arbitrary before it moves.

Long runs are first reduced to at most ``TREND_BINS`` points (the median step and the median
value of each run of consecutive steps), which keeps the O(n^2) pair count bounded and makes
neighbouring points closer to independent: per-step memory readings are strongly
autocorrelated (the allocator holds a level for many steps), and the significance test below
assumes independent points.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from traceml.analysis.clean import is_number
from traceml.analysis.stats import lag1_autocorrelation, quantile_sorted

TREND_BINS = 200
# Sen's interval for the slope at ~99% (two-sided): the slope is "significant" only when its
# lower end is above zero. Calibrated in tests/unit/test_trend.py (false-alarm rate on seeded
# non-leaking series, detection rate on leaking ones).
SIGNIFICANCE_Z = 2.5758293035489
# Fewer points than this (after binning) are not a trend.
MIN_POINTS = 8

MB = 1024 * 1024


def binned(xs: Sequence[float], ys: Sequence[float], bins: int = TREND_BINS) -> tuple[list, list]:
    """At most ``bins`` points: the median x and median y of consecutive runs of points."""
    n = len(xs)
    if n <= bins:
        return list(xs), list(ys)
    out_x: list[float] = []
    out_y: list[float] = []
    for index in range(bins):
        lo, hi = index * n // bins, (index + 1) * n // bins
        if hi <= lo:
            continue
        out_x.append(quantile_sorted(sorted(xs[lo:hi]), 0.5))
        out_y.append(quantile_sorted(sorted(ys[lo:hi]), 0.5))
    return out_x, out_y


def pair_slopes(xs: Sequence[float], ys: Sequence[float]) -> list[float]:
    """Sorted slopes between every pair of points with different x."""
    slopes = []
    n = len(xs)
    for i in range(n):
        xi, yi = xs[i], ys[i]
        for j in range(i + 1, n):
            dx = xs[j] - xi
            if dx:
                slopes.append((ys[j] - yi) / dx)
    slopes.sort()
    return slopes


def theil_sen(
    xs: Sequence[float], ys: Sequence[float], z: float = SIGNIFICANCE_Z
) -> tuple[float, float, float, float] | None:
    """Slope, intercept, and Sen's confidence interval for the slope (low, high); None when
    there are fewer than two distinct x.

    The interval is the nonparametric one from Kendall's S (Sen 1968; Hollander & Wolfe):
    C = z * sqrt(n(n-1)(2n+5)/18), and the bounds are the pair slopes at ranks (N - C)/2 and
    (N + C)/2 of the N sorted slopes (ties in x are ignored in the variance)."""
    slopes = pair_slopes(xs, ys)
    count = len(slopes)
    if not count:
        return None
    slope = quantile_sorted(slopes, 0.5)
    intercept = quantile_sorted(sorted(y - slope * x for x, y in zip(xs, ys, strict=True)), 0.5)
    n = len(xs)
    # Neighbouring readings are correlated (memory holds a level for a while): widen the
    # interval by the lag-1 autocorrelation of the residuals, (1 + r) / (1 - r), as in
    # Hamed & Rao's correction of the Mann-Kendall variance; without it a wandering but
    # level series reads as a trend.
    r = _lag1_autocorrelation([y - slope * x - intercept for x, y in zip(xs, ys, strict=True)])
    inflation = (1 + r) / (1 - r)
    spread = z * math.sqrt(n * (n - 1) * (2 * n + 5) / 18.0 * inflation)
    low_rank = max(0, min(count - 1, math.floor((count - spread) / 2.0)))
    high_rank = max(0, min(count - 1, math.ceil((count + spread) / 2.0)))
    return slope, intercept, slopes[low_rank], slopes[high_rank]


def _lag1_autocorrelation(residuals: Sequence[float]) -> float:
    """Lag-1 autocorrelation, clamped to [0, 0.9] (negative correlation is not credited)."""
    r = lag1_autocorrelation(residuals)
    return 0.0 if r is None else min(0.9, max(0.0, r))


def memory_trend(
    steps: Sequence[float],
    values: Sequence[float | None],
    *,
    headroom_bytes: float | None = None,
    settle_share: float = 0.0,
) -> dict[str, float | int | bool | None] | None:
    """The trend of one memory series (bytes against step index), or None when too short.

    ``settle_share``: the share of the points at the start left out (memory rises while the
    first steps allocate their working set; that is not a leak). ``headroom_bytes``: memory
    left at the end of the series, for the projected step at which it runs out.
    """
    pairs = [(x, y) for x, y in zip(steps, values, strict=True) if y is not None]
    pairs = pairs[int(len(pairs) * settle_share) :]
    xs, ys = binned([p[0] for p in pairs], [p[1] for p in pairs])
    if len(xs) < MIN_POINTS:
        return None
    fit = theil_sen(xs, ys)
    if fit is None:
        return None
    slope, intercept, low, high = fit
    # A creep keeps going: one jump (a pool grown once, a cache filled) makes the whole
    # series' slope significant too, but only one of its halves.
    half = len(xs) // 2
    halves = [theil_sen(xs[:half], ys[:half]), theil_sen(xs[half:], ys[half:])]
    sustained = low > 0 and all(fit is not None and fit[2] > 0 for fit in halves)
    span = pairs[-1][0] - pairs[0][0]
    last_step = pairs[-1][0]
    projected = None
    if headroom_bytes is not None and slope > 0 and sustained:
        # A huge headroom over a tiny slope is no forecast (and int() of it could not be
        # written to the summary): past the step fields' bound it stays unknown.
        exhaustion = last_step + headroom_bytes / slope
        projected = int(exhaustion) if is_number(exhaustion) else None
    return {
        "slope_mb_per_1k_steps": slope * 1000.0 / MB,
        "slope_low_mb_per_1k_steps": low * 1000.0 / MB,
        "slope_high_mb_per_1k_steps": high * 1000.0 / MB,
        "significant": sustained,
        "growth_mb": slope * span / MB,
        "points": len(pairs),
        "first_step": int(pairs[0][0]),
        "last_step": int(last_step),
        "first_bytes": intercept + slope * pairs[0][0],
        "last_bytes": intercept + slope * last_step,
        "headroom_bytes": headroom_bytes,
        "projected_exhaustion_step": projected,
    }


def downsample(xs: Sequence[float], ys: Sequence[float | None], points: int) -> list[list]:
    """At most ``points`` [x, y] pairs for a chart: the mean of consecutive runs (nulls left
    out; a run with no value is left out)."""
    n = len(xs)
    per = max(1, math.ceil(n / points)) if n else 1
    out = []
    for lo in range(0, n, per):
        present = [y for y in ys[lo : lo + per] if y is not None]
        if present:
            out.append([xs[lo], sum(present) / len(present)])
    return out
