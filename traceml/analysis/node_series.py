"""One node's share of the job series: per step number, the slowest rank's step time and the
sum of each phase over the node's ranks (with how many ranks measured it).

Mergeable exactly: nodes combine by max and by sums of the same numbers, so a job series
merged from per-node partials is the one a single pass computes (the accumulator adds ranks
within nodes, then nodes in order, either way). A partial stores this as binary arrays
(base64 of float64 and int64), so merging 100k steps of a node costs milliseconds to load.
"""

from __future__ import annotations

import base64
import operator
from array import array
from typing import Any

from traceml import schema

# The job's step waits for its slowest rank; phases are averaged (a phase's max over ranks
# would grow with the rank count on identical ranks, the very inflation the job series removes).
MAX_OVER_RANKS = frozenset({schema.STEP})


class NodeSeries:
    """Totals (max for the step, sums for phases) and counts per step number, from ``origin``."""

    def __init__(self) -> None:
        self.ranks = 0
        self.origin: int | None = None  # the step number at index 0 of the lists below
        self.length = 0  # slots in each list: the step numbers seen span this many
        self.totals: dict[str, list[float]] = {}
        self.counts: dict[str, list[int]] = {}
        # Fields whose count is this same number at every slot (a node's usual series: every
        # rank measured every step): merging two such needs no per-step work on the counts.
        self.uniform: dict[str, int] = {}

    # -- one rank at a time ------------------------------------------------------------------

    def add(self, series: dict[str, list[Any]], numbers_key: str) -> None:
        numbers = series.get(numbers_key)
        fields = {name: values for name, values in series.items() if name != numbers_key}
        if numbers is None:  # a series from before step numbers: positions
            numbers = list(range(max((len(v) for v in fields.values()), default=0)))
        self.ranks += 1
        if not numbers:
            return
        for name, totals in self.totals.items():  # loaded from a partial: lists to grow
            if type(totals) is array:
                self.totals[name] = totals.tolist()
        self._make_room(numbers[0], numbers[-1])
        origin = self.origin
        indices = [number - origin for number in numbers]  # type: ignore[operator]
        for fieldname, values in fields.items():
            self._add_field(fieldname, values, indices)

    def _make_room(self, first: int, last: int) -> None:
        """Grow the lists so step numbers ``first..last`` have a slot."""
        if self.origin is None or first < self.origin or last - self.origin + 1 > self.length:
            self.uniform.clear()  # new slots count 0
        if self.origin is None:
            self.origin = first
        if first < self.origin:
            grow = self.origin - first
            for name in self.totals:
                self.totals[name][:0] = [0.0] * grow
                self.counts[name][:0] = [0] * grow
            self.length += grow
            self.origin = first
        self.length = max(self.length, last - self.origin + 1)
        for name in self.totals:
            self._pad(name)

    def _pad(self, fieldname: str) -> None:
        totals = self.totals.setdefault(fieldname, [])
        counts = self.counts.setdefault(fieldname, [])
        if len(totals) < self.length:
            grow = self.length - len(totals)
            totals.extend([0.0] * grow)
            counts.extend([0] * grow)

    def _add_field(self, fieldname: str, values: list[Any], indices: list[int]) -> None:
        self.uniform.pop(fieldname, None)
        self._pad(fieldname)
        totals, counts = self.totals[fieldname], self.counts[fieldname]
        use_max = fieldname in MAX_OVER_RANKS
        first, count = (indices[0], len(indices)) if indices else (0, 0)
        if count == len(values) and indices[-1] - first == count - 1 and None not in values:
            # Consecutive step numbers, every one measured (the usual rank): whole slices at
            # C speed; an empty slot's 0.0 is neutral for max and sum of times (never < 0).
            end = first + count
            combine = max if use_max else operator.add
            totals[first:end] = map(combine, totals[first:end], values)
            counts[first:end] = [c + 1 for c in counts[first:end]]
            return
        for index, value in zip(indices, values, strict=False):
            if value is None:
                continue
            if counts[index] == 0:
                totals[index] = value
            elif use_max:
                totals[index] = max(totals[index], value)
            else:
                totals[index] += value
            counts[index] += 1

    # -- nodes -------------------------------------------------------------------------------

    def merge(self, other: NodeSeries) -> None:
        """Add another node's series (times are never negative, so an empty slot's 0.0 is
        neutral for both max and sum: whole lists combine at C speed)."""
        self.ranks += other.ranks
        if other.origin is None:
            return
        self._make_room(other.origin, other.origin + other.length - 1)
        offset = other.origin - self.origin  # type: ignore[operator]
        same_span = offset == 0 and other.length == self.length
        for fieldname in other.totals:
            mine = self.uniform.pop(fieldname, None) if fieldname in self.totals else 0
            self._pad(fieldname)
            combine = max if fieldname in MAX_OVER_RANKS else operator.add
            end = offset + other.length
            totals = self.totals[fieldname]
            totals[offset:end] = map(combine, totals[offset:end], other.totals[fieldname])
            theirs = other.uniform.get(fieldname)
            if same_span and mine is not None and theirs is not None:
                self.uniform[fieldname] = mine + theirs
                self.counts[fieldname] = [mine + theirs] * self.length
                continue
            counts = self.counts[fieldname]
            counts[offset:end] = map(operator.add, counts[offset:end], other.counts[fieldname])

    def job_values(self) -> dict[str, list[float]]:
        """Per field, the job's value at each step some rank measured, in step order."""
        values: dict[str, list[float]] = {}
        for fieldname, totals in self.totals.items():
            counts = self.counts[fieldname]
            if fieldname in MAX_OVER_RANKS:
                values[fieldname] = [t for t, c in zip(totals, counts, strict=True) if c]
            else:
                values[fieldname] = [t / c for t, c in zip(totals, counts, strict=True) if c]
        return values

    # -- stored in a partial -----------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        return {
            "ranks": self.ranks,
            "origin": self.origin,
            "length": self.length,
            "fields": {
                name: [_encode("d", self.totals[name]), _encode_counts(self.counts[name])]
                for name in self.totals
            },
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> NodeSeries:
        """Raises ValueError (or KeyError/TypeError) on a damaged state."""
        series = cls()
        series.ranks = int(state["ranks"])
        origin = state["origin"]
        series.origin = None if origin is None else int(origin)
        series.length = int(state["length"])
        for name, (totals, counts) in state["fields"].items():
            # Kept as an array (8 bytes a step, not a list's 32): a merge holds every node's
            # series until it adds them up, and map() reads arrays as fast as lists.
            series.totals[name] = _decode("d", totals)  # type: ignore[assignment]
            if type(counts) is int:
                series.uniform[name] = counts
                series.counts[name] = [counts] * series.length
            else:
                series.counts[name] = _decode("q", counts).tolist()
            if len(series.totals[name]) != series.length or len(series.counts[name]) != (
                series.length
            ):
                raise ValueError(f"job series field {name}: wrong length")
        return series


def _encode(typecode: str, values: list[Any]) -> str:
    return base64.b64encode(array(typecode, values).tobytes()).decode("ascii")


def _encode_counts(counts: list[int]) -> int | str:
    """Counts are nearly always the node's rank count at every step: one number then."""
    if counts and counts.count(counts[0]) == len(counts):
        return counts[0]
    return _encode("q", counts)


def _decode(typecode: str, text: str) -> array:
    values = array(typecode)
    values.frombytes(base64.b64decode(text, validate=True))
    return values


def node_of(header: dict[str, Any] | None) -> int:
    """The node a rank ran on, from its (cleaned) header; -1 when the file does not say."""
    node = (header or {}).get(schema.NODE_RANK)
    return node if type(node) is int and node >= 0 else -1
