"""Summary -> verdicts: what is slow, how sure we are, and what to try next. Pure.

Each verdict is a dict: ``kind``, ``severity`` (critical / warn / info), ``why`` (one sentence
with the number), ``next`` (one sentence: what to try) and ``evidence`` (the figures used).
They come ordered by severity, then by how much of the step they explain; the first is the
headline. Thresholds come from :mod:`traceml.thresholds` (overridable).

The rules live by family: :mod:`diagnose_phases` (where a step's time goes),
:mod:`diagnose_ranks` (stragglers, communication, memory), :mod:`diagnose_resources`
(telemetry); :mod:`diagnose_base` holds what they share.
"""

from __future__ import annotations

from typing import Any

from traceml import schema
from traceml.analysis.diagnose_base import (  # noqa: F401  (names readers import from here)
    COMM_BOUND,
    COMPUTE_BOUND,
    CRITICAL,
    H2D_BOUND,
    INFO,
    INPUT_BOUND,
    INSUFFICIENT_DATA,
    MEMORY_PRESSURE,
    NO_CLEAR_BOTTLENECK,
    NOT_TRACED,
    OPTIMIZER_HEAVY,
    RESIDUAL_HEAVY,
    SEVERITY_ORDER,
    STRAGGLER,
    WARN,
    PhaseView,
    finish,
    label,
)
from traceml.analysis.diagnose_phases import (
    compute_bound,
    insufficient,
    no_clear_bottleneck,
    no_data,
    noise_caveat,
    outside_caveat,
    share_verdicts,
)
from traceml.analysis.diagnose_ranks import comm_bound, memory_pressure, straggler_verdict
from traceml.analysis.diagnose_resources import (  # noqa: F401
    HOST_CPU_SATURATED,
    HOST_MEMORY_PRESSURE,
    LOW_DEVICE_UTILIZATION,
    MEMORY_CREEP,
    resource_verdicts,
)
from traceml.thresholds import known_thresholds, resolve_thresholds

__all__ = ["diagnose", "label", "noise_caveat", "outside_caveat", "resource_verdicts"]


def diagnose(
    summary: dict[str, Any], thresholds: dict[str, float] | None = None
) -> list[dict[str, Any]]:
    """Verdicts for ``summary``, most important first (never empty)."""
    limits = resolve_thresholds(
        thresholds or known_thresholds(summary.get(schema.SUMMARY_THRESHOLDS))
    )
    early = no_data(summary) or insufficient(summary, limits)
    if early is not None:
        return [finish(early)]
    view = PhaseView.of(summary)
    verdicts = share_verdicts(summary, view, limits)
    compute = compute_bound(view, limits)
    if compute is not None:
        verdicts.append(compute)
    straggler = straggler_verdict(summary, limits)
    found = [straggler, comm_bound(summary, limits), memory_pressure(summary, limits)]
    verdicts.extend(verdict for verdict in found if verdict is not None)
    if not any(_is_finding(verdict) for verdict in verdicts):
        verdicts.append(no_clear_bottleneck(view))
    verdicts.extend(resource_verdicts(summary, view, limits))
    verdicts.sort(key=lambda v: (SEVERITY_ORDER[v[schema.VERDICT_SEVERITY]], -v["_weight"]))
    return [finish(v) for v in verdicts]


def _is_finding(verdict: dict[str, Any]) -> bool:
    """A verdict that says something: a warning, or the healthy COMPUTE_BOUND."""
    return (
        verdict[schema.VERDICT_SEVERITY] in (WARN, CRITICAL)
        or verdict[schema.VERDICT_KIND] == COMPUTE_BOUND
    )
