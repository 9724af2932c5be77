"""One node's quantile sketches per field, kept bounded as its ranks are added.

A rank contributes its sketch (:func:`stats.sketch_sorted`: every value up to SKETCH_POINTS,
else that many order statistics); a node's sketches of a field are compressed into one when
they pass COMPRESS_AT points, and once the node is complete an approximate group becomes one
sketch of SKETCH_POINTS points (:meth:`NodeSketches.finish`), so the merge costs O(nodes)
points, not O(ranks). The single pass and the merge of per-node partials add the
same sketches in the same order per node: their quantiles are identical. Each compression
adds at most about 1/SKETCH_POINTS of rank error (see stats.QUANTILE_RANK_ERROR).
"""

from __future__ import annotations

from typing import Any

from traceml.analysis import stats, workers

COMPRESS_AT = 4 * stats.SKETCH_POINTS
# Below this many sketch points in all, a run's quantiles are taken in this process (a pool
# costs more than it saves).
PARALLEL_POINTS = 500_000


_NUMBERS = {int, float}


class NodeSketches:
    def __init__(self) -> None:
        self.fields: dict[str, list[stats.Sketch]] = {}

    def add(self, fieldname: str, sketch: stats.Sketch) -> None:
        group = self.fields.setdefault(fieldname, [])
        group.append(sketch)
        if sum(len(values) for values, _weight in group) > COMPRESS_AT:
            group[:] = [stats.compress(group)]

    def finish(self, fieldname: str | None = None) -> None:
        """The node is complete: an approximate group (some rank had more than SKETCH_POINTS
        steps) becomes one sketch of SKETCH_POINTS points, so a merge of N nodes handles
        N x SKETCH_POINTS points per field. Idempotent; a node's partial is finished before it
        is written, the single pass finishes each node when it takes the run's quantiles."""
        for name in [fieldname] if fieldname else list(self.fields):
            group = self.fields.get(name)
            if not group:
                continue
            points = sum(len(values) for values, _weight in group)
            approximate = any(weight != 1.0 for _values, weight in group)
            if approximate and (len(group) > 1 or points > stats.SKETCH_POINTS):
                group[:] = [stats.compress(group)]

    def to_state(self) -> dict[str, Any]:
        return {
            name: [[values, weight] for values, weight in group]
            for name, group in self.fields.items()
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> NodeSketches:
        """Raises ValueError / TypeError on a damaged state."""
        sketches = cls()
        for name, group in state.items():
            checked = []
            for values, weight in group:
                if not isinstance(values, list) or not set(map(type, values)) <= _NUMBERS:
                    raise ValueError(f"sketch of {name}: not a list of numbers")
                checked.append((values, float(weight)))
            sketches.fields[name] = checked
        return sketches


def field_quantiles(
    groups: list[list[stats.Sketch]], wanted: list[float]
) -> tuple[list[float], bool]:
    """One field's run quantiles at ``wanted`` from its nodes' sketch groups (in node order),
    each group finished first; and whether they are approximate. Picklable in and out: the
    fields of a run are independent, so a process pool can take one each."""
    sketches: list[stats.Sketch] = []
    for group in groups:
        node = NodeSketches()
        node.fields["f"] = list(group)
        node.finish("f")
        sketches.extend(node.fields["f"])
    approximate = any(weight != 1.0 for _values, weight in sketches)
    return stats.merged_quantiles(sketches, wanted), approximate


def all_field_quantiles(
    nodes: dict[int, NodeSketches], wanted: dict[str, list[float]], jobs: int
) -> dict[str, tuple[list[float], bool]]:
    """:func:`field_quantiles` for every field in ``wanted``, in worker processes when the
    sketches are many (a run of many nodes: each field sorts nodes x SKETCH_POINTS points)."""
    groups = {
        name: [nodes[n].fields[name] for n in sorted(nodes) if nodes[n].fields.get(name)]
        for name in wanted
    }
    points = sum(len(v) for gs in groups.values() for g in gs for v, _w in g)
    names = list(wanted)
    if jobs <= 1 or len(names) <= 1 or points < PARALLEL_POINTS:
        return {name: field_quantiles(groups[name], wanted[name]) for name in names}
    found = workers.pool_map(
        min(jobs, len(names)),
        field_quantiles,
        [groups[n] for n in names],
        [wanted[n] for n in names],
    )
    return dict(zip(names, found, strict=True))


def exactness(approximate: bool) -> dict[str, Any]:
    """What the summary's figures are: which are exact and, for the approximate ones, the bound
    (the same whether the run was reduced in one pass or merged from per-node partials)."""
    return {
        "exact": (
            "counts, sums, means, min and max of every field; shares; every rank's own "
            "statistics (its median and p90 too); the job series; every verdict's evidence"
        ),
        "approximate": (
            ["overall median and p90 of each field", "overall distributions"] if approximate else []
        ),
        "quantile_rank_error": stats.QUANTILE_RANK_ERROR if approximate else 0.0,
        "note": (
            "quantiles pooled over ranks come from mergeable sketches (ranks with more than "
            f"{stats.SKETCH_POINTS} steps): each is within {stats.QUANTILE_RANK_ERROR:.1%} of "
            "rank of the exact one (p90 between the exact p89.9 and p90.1)"
            if approximate
            else "every figure is exact"
        ),
    }
