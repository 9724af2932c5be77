"""The job series aligns ranks by step number (issue 20): one abandoned step on one rank must
not shift that rank's whole series against the others."""

import pytest

from traceml import schema
from traceml.analysis import job_series
from traceml.analysis.reduce import reduce_run

from rankfiles import footer, header, step, write_rank

STEPS = 12
SLOW_STEP_MS = 100.0


def _rank_records(rank: int, abandoned: int | None) -> list[dict]:
    """Rank ``rank``'s file: 10 ms steps, one 100 ms step at global step 8 (both ranks); the
    rank that abandoned step number ``abandoned`` has no record for it (its later records keep
    their trainer's global step but their own index moves up by one)."""
    records = [header(rank, 2)]
    index = 0
    for number in range(1, STEPS + 1):
        if number == abandoned:
            continue
        record = step(index, forward=SLOW_STEP_MS if number == 8 else 10.0)
        record[schema.GLOBAL_STEP] = number
        records.append(record)
        index += 1
    records.append(footer(index))
    return records


def test_an_abandoned_step_does_not_shift_a_rank_against_the_others(tmp_path):
    write_rank(tmp_path, 0, _rank_records(0, abandoned=None))
    write_rank(tmp_path, 1, _rank_records(1, abandoned=3))
    summary = reduce_run(tmp_path, thresholds={"warmup_steps": 1})
    series = summary["job_series"]["fields"]
    step_points = series[schema.STEP]["points"]
    forward_points = series[schema.FORWARD]["points"]
    # Global steps 2..12 (step 1 is warm-up): 11 job steps; the slow one is global step 8,
    # slow on both ranks, so the phase mean there is 100 ms, not 55 (which is what positional
    # alignment made of it: rank 1's step 8 sat one position earlier than rank 0's).
    assert len(step_points) == 11
    assert step_points[8 - 2] == SLOW_STEP_MS
    assert forward_points[8 - 2] == SLOW_STEP_MS
    assert sorted(forward_points).count(SLOW_STEP_MS) == 1
    assert all(value == 10.0 for i, value in enumerate(forward_points) if i != 6)


def test_step_numbers_fall_back_to_the_step_index_then_to_position():
    by_global = job_series.rank_series(
        {schema.STEP: [1.0, 2.0], schema.GLOBAL_STEP: [5, 7], schema.STEP_INDEX: [0, 1]}, 0
    )
    assert by_global[job_series.STEP_NUMBERS] == [5, 7]
    # Global steps that repeat (an epoch-end flush) are no alignment: the record index is.
    by_index = job_series.rank_series(
        {schema.STEP: [1.0, 2.0], schema.GLOBAL_STEP: [5, 5], schema.STEP_INDEX: [3, 4]}, 0
    )
    assert by_index[job_series.STEP_NUMBERS] == [3, 4]
    by_position = job_series.rank_series({schema.STEP: [1.0, 2.0, 3.0]}, 1)
    assert by_position[job_series.STEP_NUMBERS] == [1, 2]
    # Absurd numbers (a damaged file) would cost memory: position instead.
    damaged = job_series.rank_series({schema.STEP: [1.0, 2.0], schema.GLOBAL_STEP: [0, 10**15]}, 0)
    assert damaged[job_series.STEP_NUMBERS] == [0, 1]


def test_a_rank_starting_earlier_than_the_first_is_aligned_too():
    accumulator = job_series.JobSeriesAccumulator()
    accumulator.add({schema.STEP: [5.0, 6.0], job_series.STEP_NUMBERS: [10, 11]})
    accumulator.add({schema.STEP: [1.0, 9.0, 2.0], job_series.STEP_NUMBERS: [8, 10, 12]})
    stored = accumulator.result()["fields"][schema.STEP]
    assert stored["points"] == pytest.approx([1.0, 9.0, 6.0, 2.0])  # steps 8, 10, 11, 12
