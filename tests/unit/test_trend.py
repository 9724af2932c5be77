"""traceml.analysis.trend: Theil-Sen slope, Sen's interval and the memory-creep decision, calibrated
on seeded synthetic memory series (false alarms on level ones, detection on leaking ones)."""

from __future__ import annotations

import random

from traceml.analysis.trend import MB, binned, downsample, memory_trend, theil_sen


def memory_series(
    seed: int, leak_mb_per_step: float, steps: int = 600, jump: bool = True
) -> tuple[list[int], list[float]]:
    """RSS-like readings: a level, AR(1) noise that wanders for ~20 steps (sd 8 MB), reading
    noise (sd 1 MB), optionally one jump of 20-80 MB at a random step (a pool grown once),
    plus the leak."""
    rng = random.Random(seed)
    level, wander, phi = 1500 * MB, 0.0, 0.95
    jump_at = rng.randrange(steps) if jump else -1
    values = []
    for step in range(steps):
        wander = phi * wander + rng.gauss(0, 8 * MB) * (1 - phi**2) ** 0.5
        if step == jump_at:
            level += rng.uniform(20, 80) * MB
        values.append(level + wander + rng.gauss(0, MB) + leak_mb_per_step * MB * step)
    return list(range(steps)), values


def test_theil_sen_recovers_a_line_and_ignores_outliers() -> None:
    xs = list(range(50))
    ys = [3.0 * x + 7.0 for x in xs]
    for index in (5, 17, 30, 41):  # 8% of the points wildly off
        ys[index] += 1e6
    slope, intercept, low, high = theil_sen(xs, ys)
    assert slope == 3.0 and intercept == 7.0
    assert low <= slope <= high


def test_binned_keeps_short_series_and_bounds_long_ones() -> None:
    assert binned([1, 2], [3, 4]) == ([1, 2], [3, 4])
    xs, ys = binned(list(range(1000)), [2.0 * x for x in range(1000)], bins=10)
    assert len(xs) == 10 and ys[0] == 2.0 * xs[0]


def test_level_series_rarely_read_as_creep() -> None:
    alarms = sum(
        memory_trend(*memory_series(seed, 0.0), settle_share=0.1)["significant"]
        for seed in range(100)
    )
    assert alarms <= 2  # measured: 0 of 200 at 1000 steps


def test_leaking_series_detected_with_accurate_slope() -> None:
    detected, errors = 0, []
    for seed in range(100):
        trend = memory_trend(*memory_series(seed, 0.5, jump=False), settle_share=0.1)
        detected += trend["significant"]
        errors.append(abs(trend["slope_mb_per_1k_steps"] / 500.0 - 1))
    assert detected >= 98
    assert max(errors) < 0.10


def test_leak_detected_despite_a_jump() -> None:
    detected = sum(
        memory_trend(*memory_series(seed, 0.5), settle_share=0.1)["significant"]
        for seed in range(50)
    )
    assert detected >= 48


def test_projection_and_short_series() -> None:
    xs = list(range(100))
    trend = memory_trend(xs, [1000 * MB + x * MB for x in xs], headroom_bytes=900 * MB)
    assert trend["significant"] and round(trend["slope_mb_per_1k_steps"]) == 1000
    assert trend["projected_exhaustion_step"] == 99 + 900
    assert memory_trend([1, 2, 3], [1.0, 2.0, None]) is None
    flat = memory_trend(xs, [5.0 * MB] * 100, headroom_bytes=MB)
    assert not flat["significant"] and flat["projected_exhaustion_step"] is None


def test_downsample_averages_and_skips_nulls() -> None:
    assert downsample([0, 1, 2, 3], [1.0, 3.0, None, None], 2) == [[0, 2.0]]


def test_projection_beyond_any_step_is_unknown() -> None:
    # A damaged headroom over a real slope: int() of it could not be written to the summary.
    xs = list(range(100))
    leaking = [1000 * MB + x * MB for x in xs]
    for headroom in (1e300, 1e308):
        trend = memory_trend(xs, leaking, headroom_bytes=headroom)
        assert trend["significant"] and trend["projected_exhaustion_step"] is None
