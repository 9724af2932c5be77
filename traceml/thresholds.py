"""The one table of numbers that turn a summary into verdicts.

Shares are fractions of median step time. Every entry can be overridden without code:
``TRACEML_THRESHOLD_<NAME>=value`` in the environment, or ``--threshold name=value`` on
``traceml run`` / ``traceml report``. docs/diagnosis.md documents each entry.
"""

from __future__ import annotations

from traceml.errors import ThresholdError

__all__ = [
    "THRESHOLDS",
    "ThresholdError",
    "known_thresholds",
    "parse_threshold_override",
    "resolve_thresholds",
]

# typing costs ~8 ms to import at start-up; annotations are strings (PEP 563) anyway.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from collections.abc import Mapping

THRESHOLDS: dict[str, float] = {
    # First steps of every rank that the reducer leaves out of the statistics: they carry
    # one-off costs (DataLoader worker start-up, lazy initialisation, allocator growth).
    "warmup_steps": 2,
    # Fewer steady (post-warm-up) steps than this on any rank: INSUFFICIENT_DATA.
    "min_steps": 10,
    # Input Wait share of step time: INPUT_BOUND.
    "input_warn": 0.25,
    "input_critical": 0.50,
    # H2D share: H2D_BOUND.
    "h2d_warn": 0.20,
    "h2d_critical": 0.40,
    # Optimizer share: OPTIMIZER_HEAVY.
    "optimizer_warn": 0.30,
    "optimizer_critical": 0.50,
    # Residual share (loss, matching, logging, anything no phase names): RESIDUAL_HEAVY.
    "residual_warn": 0.35,
    "residual_critical": 0.60,
    # Forward + Backward share at or above which the run is COMPUTE_BOUND (the healthy case).
    "compute_share": 0.60,
    # Slowest rank's own time (step minus its waits on other ranks) over the other ranks'
    # median: STRAGGLER. Differences under straggler_min_ms are noise.
    "straggler_warn": 1.20,
    "straggler_critical": 1.50,
    "straggler_min_ms": 1.0,
    # Where waits on other ranks are timed, the others must also wait longer than the slow rank
    # by at least this share of its excess own time: a straggler makes the others wait. Two
    # ranks sharing noisy cores can differ in own-time medians while waiting alike (CI, stop 34).
    "straggler_wait_share": 0.5,
    # Share of step time that even the rank waiting least spends blocked in communication
    # (collectives, DDP's gradient buckets): COMM_BOUND.
    "comm_warn": 0.25,
    "comm_critical": 0.50,
    # Step time p90 over its median at or above which the report adds a caveat: steps vary
    # so much that the shares (sums over all steps) mostly describe the slow ones.
    "noisy_steps": 2.0,
    # Share of the time from the first step's start to the last step's end spent between
    # steps at or above which the report adds a caveat: the verdicts and the throughput
    # describe the steps only (work after optimizer.step() is between them).
    "outside_steps": 0.5,
    # Peak reserved device memory over device capacity: MEMORY_PRESSURE.
    "memory_warn": 0.90,
    "memory_critical": 0.97,
    # MEMORY_CREEP (issue 15): memory (RSS on CPU, allocated device memory on CUDA) keeps
    # growing over the analysed steps: a sustained Theil-Sen slope (traceml/analysis/trend.py) whose
    # growth over the run is at least memory_creep_min_mb. Warn when, at that rate, the
    # headroom (host available memory; device capacity minus allocated) runs out within
    # memory_creep_warn_steps steps after the last one (or the headroom is unknown);
    # critical within memory_creep_critical_steps.
    "memory_creep_min_mb": 32,
    "memory_creep_warn_steps": 1_000_000,
    "memory_creep_critical_steps": 20_000,
    # LOW_DEVICE_UTILIZATION (CUDA): share of step time the device was not running the traced
    # phases (waiting for input, transfers, Python between phases).
    "device_idle_warn": 0.50,
    "device_idle_critical": 0.75,
    # HOST_CPU_SATURATED: the run is INPUT_BOUND and the host's CPUs were at least this busy
    # on average (system-wide share of all cores): more DataLoader workers would not help.
    "host_cpu_busy": 0.90,
    # HOST_MEMORY_PRESSURE: the most host memory in use (1 - available/total) during the run.
    "host_memory_warn": 0.90,
    "host_memory_critical": 0.95,
}

# Entries that count steps rather than measure a ratio.
INTEGER_THRESHOLDS = frozenset({"warmup_steps", "min_steps"})
MAX_STEP_THRESHOLD = 2**31


def parse_threshold_override(name: str, raw: str) -> tuple[str, float]:
    """Validate one ``name=value`` override; return the canonical name and the number."""
    key = name.strip().lower().replace("-", "_")
    if key not in THRESHOLDS:
        known = ", ".join(sorted(THRESHOLDS))
        raise ThresholdError(f"unknown threshold {name!r} (known: {known})")
    try:
        value = float(raw)
    except ValueError:
        raise ThresholdError(f"threshold {key}={raw!r} is not a number") from None
    # inf is no number a summary can store (JSON has none; orjson writes null).
    if not 0 <= value < float("inf"):
        raise ThresholdError(f"threshold {key}={raw!r} must be a finite non-negative number")
    if key in INTEGER_THRESHOLDS:
        if value != int(value):
            raise ThresholdError(f"threshold {key}={raw!r} must be a whole number")
        # A step count past any run's length; a bigger one would not fit the summary's JSON.
        if value > MAX_STEP_THRESHOLD:
            raise ThresholdError(
                f"threshold {key}={raw!r} must be at most {MAX_STEP_THRESHOLD:,} steps"
            )
        value = int(value)
    return key, value


def known_thresholds(stored: Mapping[str, float] | None) -> dict[str, float]:
    """The entries of a summary's stored thresholds that this version knows. A summary written
    by a newer traceml may carry entries added since; re-diagnosing it must not fail on them
    (the user's own overrides stay strict: a typo there is an error)."""
    return {name: value for name, value in (stored or {}).items() if name in THRESHOLDS}


def resolve_thresholds(overrides: Mapping[str, float] | None = None) -> dict[str, float]:
    """The defaults with validated overrides applied."""
    merged = dict(THRESHOLDS)
    for name, value in (overrides or {}).items():
        key, number = parse_threshold_override(name, str(value))
        merged[key] = number
    return merged
