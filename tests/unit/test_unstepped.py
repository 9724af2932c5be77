"""Windows written with optimizer_stepped false are set aside before any statistic."""

from __future__ import annotations

from pathlib import Path

from traceml import schema
from traceml.analysis import unstepped
from traceml.analysis.notes import rank_notes
from traceml.analysis.rankfile import RankRecords


def records(flags: list, gaps: list, lengths: list) -> RankRecords:
    data = RankRecords(rank=0, path=Path("rank_0.jsonl"))
    data.columns[schema.OPTIMIZER_STEPPED] = list(flags)
    data.columns[schema.GAP_MS] = list(gaps)
    data.columns[schema.STEP] = list(lengths)
    data.columns[schema.GLOBAL_STEP] = list(range(1, len(flags) + 1))
    for column in data.columns.values():
        if not column:
            column.extend([None] * len(flags))
    return data


def test_an_unstepped_window_goes_into_the_next_steps_gap():
    data = records([True, False, True, False], [None, 1.0, 2.0, 3.0], [10.0, 4.0, 10.0, 5.0])
    unstepped.set_aside(data)
    assert data.columns[schema.GLOBAL_STEP] == [1, 3]
    assert data.columns[schema.GAP_MS] == [None, 7.0]  # its own 2 ms, the window's 1 + 4
    assert data.columns[schema.STEP] == [10.0, 10.0]
    assert (data.unstepped, data.unstepped_ms) == (2, 13.0)  # the last: after the last step
    assert schema.OPTIMIZER_STEPPED not in data.columns
    (note,) = [n for n in rank_notes(data)[0] if "without an optimizer step" in n]
    assert note.startswith("rank 0: 2 microbatch window(s)") and "13.0 ms" in note


def test_steps_that_all_stepped_are_left_as_they_are():
    data = records([True, True, None], [None, 1.0, "x"], [10.0, 4.0, 3.0])  # None: a live tail
    columns = {name: list(column) for name, column in data.columns.items()}
    unstepped.set_aside(data)
    del columns[schema.OPTIMIZER_STEPPED]
    assert data.columns == columns and data.unstepped == 0


def test_damaged_times_of_a_window_are_not_carried():
    data = records([False, True], ["x", 1.0], [True, 10.0])
    unstepped.set_aside(data)
    assert data.columns[schema.GAP_MS] == [1.0] and data.unstepped_ms == 0.0


def test_windows_set_aside_are_no_lost_steps():
    # The footer counts every record the rank wrote, windows set aside included: a damaged
    # line elsewhere read "1 of the 3 steps the rank wrote" lost where none was (review).
    data = records([True, False, True], [None, 1.0, 2.0], [10.0, 4.0, 10.0])
    data.bad_lines = 1
    data.footer = {schema.STEPS: 3}
    unstepped.set_aside(data)
    (note,) = [n for n in rank_notes(data)[0] if "unreadable" in n]
    assert note == "rank 0: 1 unreadable lines skipped"
