"""The usual step's record, from its door events' integers: made by the capture side's flusher
(``closed_step``, ``StepClock.usual_record``) or by a reader, from a rows line.

Why rows (rank schema 3.0): one-door timing's flusher made ~1,000 step records a second on a
fast loop (the phases' rounding, Residual, the cost field, a dict of 13 keys, an
``orjson.dumps`` each), holding the GIL that the training thread wants. For the usual steps of
one flush it now writes their integers instead, in one line, one ``orjson.dumps``
(``step_events``); readers turn each row into the record the flusher would have made, with
:func:`usual_record`, the one arithmetic both sides run. A rows line::

    {"kind": "steps", "origin_ns": O, "first_step": I, "last_end_ns": L, "cost_ns": C,
     "write_ns": W, "rows": [[fetch_start, fetch_end, h2d_start, h2d_end, forward_start,
     forward_end, backward_start, backward_end, stepped, end, global_step, epoch, rss, cost],
     ...]}

A row's timestamps are in order (the flusher writes no other step as a row), so its phases
never overlap. Shared base: no wing imported.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from itertools import chain, compress, repeat
from operator import and_, contains, eq, itemgetter, not_
from typing import Any

from traceml import schema
from traceml.step_record import STEP_KEYS, StepRecord

_StepRecord = StepRecord
_K = STEP_KEYS
_KIND, _KIND_STEP, _STEP_INDEX = schema.KIND, schema.KIND_STEP, _K[schema.STEP_INDEX]
_GLOBAL_STEP, _EPOCH = _K[schema.GLOBAL_STEP], _K[schema.EPOCH]
_T_START, _GAP = _K[schema.T_START_MS], _K[schema.GAP_MS]
_STEP, _INPUT_WAIT, _H2D = _K[schema.STEP], _K[schema.INPUT_WAIT], _K[schema.H2D]
_FORWARD, _BACKWARD, _OPTIMIZER = _K[schema.FORWARD], _K[schema.BACKWARD], _K[schema.OPTIMIZER]
_RESIDUAL, _RSS, _COST = _K[schema.RESIDUAL], _K[schema.RSS], _K[schema.TRACEML_COST_US]
# A row's length: ten timestamps, the global step, the epoch, RSS (or None), traceml's cost.
ROW_LENGTH = 14
_TIMES, _STEPS = itemgetter(slice(0, 10)), itemgetter(slice(10, 12))  # a row's
_NAME, _FIELDS = itemgetter(0), itemgetter(slice(1, None))  # a door event's
_IS_TUPLE = partial(type.__instancecheck__, tuple)  # isinstance(x, tuple), as a C callable
_joined = chain.from_iterable


def usual_record(
    clock: Any,
    index: int,
    global_step: int,
    epoch: int,
    start: int,
    end: int,
    last_end: int,
    input_ns: int,
    h2d: int,
    forward: int,
    backward: int,
    optimizer: int,
) -> StepRecord:
    """The usual step's record (every phase measured, one microbatch that stepped, a step
    before it, no comm fields): the record ``Group._phases`` makes, the same keys in the
    same order, rounded the same way, in one dict display. ``clock``: its ``origin_ns`` and
    ``overlaps`` (an overlap, a negative Residual, is counted there)."""
    step_ns = end - start
    residual_ns = step_ns - input_ns - h2d - forward - backward - optimizer
    if residual_ns < 0:
        clock.overlaps += 1
        step_ns -= residual_ns
    input_us = (input_ns + 500) // 1000
    h2d_us = (h2d + 500) // 1000
    forward_us = (forward + 500) // 1000
    backward_us = (backward + 500) // 1000
    optimizer_us = (optimizer + 500) // 1000
    step_us = (step_ns + 500) // 1000
    residual_us = step_us - input_us - h2d_us - forward_us - backward_us - optimizer_us
    if residual_us < 0:  # rounding only: the overlap case was handled in ns
        step_us -= residual_us
        residual_us = 0
    return _StepRecord(
        {
            _KIND: _KIND_STEP,
            _STEP_INDEX: index,
            _GLOBAL_STEP: global_step,
            _EPOCH: epoch,
            _T_START: ((start - clock.origin_ns + 500) // 1000) / 1000.0,
            _GAP: ((start - last_end + 500) // 1000) / 1000.0,
            _STEP: step_us / 1000.0,
            _INPUT_WAIT: input_us / 1000.0,
            _H2D: h2d_us / 1000.0,
            _FORWARD: forward_us / 1000.0,
            _BACKWARD: backward_us / 1000.0,
            _OPTIMIZER: optimizer_us / 1000.0,
            _RESIDUAL: residual_us / 1000.0,
        }
    )


class _Origin:
    """What :func:`usual_record` reads of a clock, for a reader."""

    __slots__ = ("origin_ns", "overlaps")

    def __init__(self, origin_ns: int) -> None:
        self.origin_ns = origin_ns
        self.overlaps = 0


def row_records(line: dict[str, Any]) -> list[StepRecord]:
    """A rows line's step records, as the flusher would have written them one a line: the
    record of :func:`usual_record`, RSS where the row read it, ``traceml_us`` as
    ``Session.cost_field`` makes it (the cost since the row before, in tenths of a us), the
    flusher's write time added to the first row's as ``Recorder._count_write_time`` adds it.
    Raises (KeyError, TypeError, ValueError) on a line that is not one traceml wrote."""
    clock = _Origin(int(line[schema.ROWS_ORIGIN_NS]))
    index = int(line[schema.ROWS_FIRST_STEP])
    last_end = int(line[schema.ROWS_LAST_END_NS])
    reported = int(line[schema.ROWS_COST_NS])
    write_ns = int(line[schema.ROWS_WRITE_NS])
    records = []
    for row in line[schema.ROWS]:
        if len(row) != ROW_LENGTH:
            raise ValueError(f"a row of {len(row)} values")
        f0, f1, h0, h1, w0, w1, b0, b1, stepped, end, global_step, epoch, rss, cost = row
        record = usual_record(
            clock,
            index,
            global_step,
            epoch,
            f0,
            end,
            last_end,
            f1 - f0,
            h1 - h0,
            w1 - w0,
            b1 - b0,
            stepped - b1,
        )
        if rss is not None:
            record[_RSS] = rss
        field = ((cost - reported + 50) // 100) / 10
        if write_ns:
            field = round(field + write_ns / 1000.0, 1)
            write_ns = 0
        record[_COST] = field
        records.append(record)
        index += 1
        last_end, reported = end, cost
    return records


def usable_rows(
    steps: list[Any], shape: tuple[str, ...], phases: Callable[[Any], Any]
) -> list[tuple[Any, ...]]:
    """The writer's side (``step_events``): the rows of ``steps``' leading ones that may go as
    rows, each a step's door events (``(door, *fields)`` tuples) named as in ``shape``, the
    fields of ``phases(step)`` (its clock events) making the row. A row's timestamps must be
    in order and its global step and epoch known. No bytecode a step: C iterators only."""
    kinds = list(map(_IS_TUPLE, steps))
    if False in kinds:
        steps = steps[: kinds.index(False)]
    same = list(map(shape.__eq__, map(tuple, map(map, repeat(_NAME), steps))))
    if False in same:
        steps = steps[: same.index(False)]
    rows = list(map(tuple, map(_joined, map(map, repeat(_FIELDS), map(phases, steps)))))
    times = list(map(_TIMES, rows))
    ordered = map(eq, times, map(tuple, map(sorted, times)))
    known = map(not_, map(contains, map(_STEPS, rows), repeat(None)))
    usable = list(map(and_, ordered, known))
    if False in usable:
        del rows[usable.index(False) :]
    return rows


class RowLayout:
    """Where a usual step's values lie once its door events are laid end to end (the
    ``(door, *fields)`` tuples of a step named as in ``shape``, of these ``lengths``, the
    clock's events from ``first`` on): what :func:`rows_at_once` reads a chunk of steps by."""

    __slots__ = ("lengths", "names", "row", "shape", "steps", "times", "width")

    def __init__(self, shape: tuple[str, ...], lengths: list[int], first: int) -> None:
        self.shape, self.lengths, self.width = shape, lengths, sum(lengths)
        self.names: list[int] = []  # each door's name
        self.row: list[int] = []  # a row's values, in order: the clock events' fields
        at = 0
        for index, length in enumerate(lengths):
            self.names.append(at)
            if index >= first:
                self.row += range(at + 1, at + length)
            at += length
        self.times = [0] * self.width  # compress's mask: a row's ten timestamps
        for at in _TIMES(self.row):
            self.times[at] = 1
        self.steps = _STEPS(self.row)  # the global step, the epoch


def rows_at_once(steps: list[Any], layout: RowLayout) -> list[tuple[Any, ...]] | None:
    """The rows of all of ``steps`` where each is laid out as ``layout`` says, their global
    steps and epochs are known and their timestamps run in order, across the steps too (the
    usual chunk); None otherwise, and :func:`usable_rows` finds where the line stops. What it
    accepts, :func:`usable_rows` accepts too, with the same rows; it checks the whole chunk
    at once, column by column (slices of one flat list), so a step costs no object but its
    row (~25% less time than :func:`usable_rows` in a micro-benchmark)."""
    count, width = len(steps), layout.width
    if False in map(_IS_TUPLE, steps):
        return None
    events = list(_joined(steps))
    if list(map(len, events)) != layout.lengths * count:
        return None
    flat = list(_joined(events))
    for at, name in zip(layout.names, layout.shape, strict=True):
        if flat[at::width] != [name] * count:
            return None
    times = list(compress(flat, layout.times * count))
    if sorted(times) != times:
        return None
    if None in flat[layout.steps[0] :: width] or None in flat[layout.steps[1] :: width]:
        return None
    return list(zip(*[flat[at::width] for at in layout.row], strict=True))
