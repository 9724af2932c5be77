"""Across ranks: which rank is slowest in each field (medians compared), and which holds the
most memory. Feeds STRAGGLER and the report's imbalance lines."""

from __future__ import annotations

from typing import Any

from traceml import schema
from traceml.analysis import resources, stats
from traceml.analysis.reduce_rank import OWN_FIELDS

# Fields compared across ranks (imbalance, stragglers).
_RANK_COMPARED: tuple[str, ...] = (
    *schema.TIMED_FIELDS,
    schema.COMM,
    schema.GPU_STEP,
    schema.GPU_COMM,
    *schema.GPU_OF_PHASE.values(),
    *OWN_FIELDS,
)


def _imbalance(rank_entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    with_data = [e for e in rank_entries if (e[schema.PHASE_STATS].get(schema.STEP) or {})]
    if len(with_data) < 2:
        return None
    fields: dict[str, Any] = {}
    for fieldname in _RANK_COMPARED:
        per_rank = {
            e[schema.RANK]: e[schema.PHASE_STATS][fieldname]
            for e in with_data
            if e[schema.PHASE_STATS].get(fieldname)
        }
        medians = {rank: entry["median"] for rank, entry in per_rank.items()}
        if len(medians) < 2:
            continue
        middle = stats.quantile_sorted(sorted(medians.values()), 0.5)
        slowest = max(medians, key=lambda rank: medians[rank])
        # The slowest rank against the typical one of the *others* (with two ranks: the other).
        others = stats.quantile_sorted(
            sorted(v for rank, v in medians.items() if rank != slowest), 0.5
        )
        fields[fieldname] = {
            "max_over_median": medians[slowest] / middle if middle > 0 else None,
            "max_over_others": medians[slowest] / others if others > 0 else None,
            "slowest_rank": slowest,
            "median_across_ranks_ms": middle,
            "median_of_others_ms": others,
            "rank_medians_ms": {str(rank): value for rank, value in medians.items()},
            # Means too: a wait that comes every few steps (periodic syncs) has a median of 0.
            "rank_means_ms": {str(rank): entry["mean"] for rank, entry in per_rank.items()},
        }
    own = fields.get(schema.GPU_OWN_MS) or fields.get(schema.OWN_MS) or fields.get(schema.STEP)
    return {
        schema.IMBALANCE_FIELDS: fields,
        schema.SLOWEST_RANK: own["slowest_rank"] if own else None,
    }


def imbalance_with_memory(rank_entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """:func:`_imbalance`, plus which rank holds the most memory (telemetry, issue 15)."""
    imbalance = _imbalance(rank_entries)
    memory = resources.memory_imbalance(rank_entries)
    if imbalance is not None or memory is not None:
        imbalance = dict(imbalance or {})
        imbalance[schema.MEMORY_IMBALANCE] = memory
    return imbalance
