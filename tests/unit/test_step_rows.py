"""Rows lines (rank schema 3.0, traceml.step_rows): the usual steps of one flush written as
their door events' integers, the records made by the reader.

Held to the records the flusher made one by one (every field, traceml's cost and RSS too),
on a real session and rank file; and the reader's side: a damaged or cut rows line is a bad
line or a cut tail, never a traceback. (On real Lightning: test_attribution.py and
test_lightning_capture.py read rows lines back.)
"""

from __future__ import annotations

import orjson
import pytest
from test_step_events import SIDE, USUAL, Ticks, drive, plan_of, records_in, started

from traceml import schema
from traceml.analysis.rankfile import read_rank_file, read_records
from traceml.capture import session as session_module
from traceml.capture import step_events
from traceml.capture.sink import RankSink
from traceml.step_record import STEP_KEYS
from traceml.step_rows import row_records


@pytest.fixture
def ticks(monkeypatch):
    clock = Ticks()  # as test_step_events' fixture
    monkeypatch.setattr(session_module, "clock_ns", clock)
    monkeypatch.setattr(step_events, "clock_ns", clock)
    return clock


@pytest.fixture
def no_flusher(monkeypatch):
    """No flusher thread: the tests' flushes are the only ones, lines fall where they say."""
    monkeypatch.setattr(RankSink, "_start_flusher", lambda self: None)


def _run(tmp_path, name, ticks, rows: bool, seed: int) -> list[dict]:
    session = started(tmp_path, name, True, USUAL)
    if not rows:
        session.replay._rows_ready = lambda: False
    readings = iter(range(1, 10**6))
    session._rss = lambda: next(readings)
    plan, _ = plan_of(seed, microbatches=90)

    def ended(global_step, epoch):
        session.own_cost_ns += 37_000 + global_step % 4 * 10_000  # traceml's cost, varying
        session.batch_ended(global_step, epoch)

    for part in (plan[:30], plan[30:31], plan[31:70], plan[70:]):
        drive(session, ticks, part, set(), ended)
        session.recorder.flush()
        session.recorder.sink.write_ns += 1_234_567  # as if the flusher had written it
    session.train_ended(0)
    session.close()
    return [r for r in records_in(session) if r[schema.KIND] in (schema.KIND_STEP, "footer")]


@pytest.mark.parametrize("seed", range(4))
def test_rows_write_the_records_the_flusher_made_one_by_one(
    tmp_path, ticks, no_flusher, monkeypatch, seed
):
    one_by_one = _run(tmp_path, f"one{seed}", ticks, False, seed)
    lines = []
    real = step_events.EventReplay._rows_line
    monkeypatch.setattr(
        step_events.EventReplay, "_rows_line", lambda s, r: lines.append(len(r)) or real(s, r)
    )
    as_rows = _run(tmp_path, f"rows{seed}", ticks, True, seed)
    assert len(lines) >= 3 and sum(lines) >= 20  # most steps went as rows
    steps = [r for r in as_rows if r.get(schema.KIND) == schema.KIND_STEP]
    assert sum(STEP_KEYS[schema.RSS] in r for r in steps) >= 5
    assert len({r[STEP_KEYS[schema.TRACEML_COST_US]] for r in steps}) >= 3
    # The same bytes: key order and int against float too, which == on dicts does not see.
    assert [orjson.dumps(r) for r in as_rows[:-1]] == [orjson.dumps(r) for r in one_by_one[:-1]]
    assert as_rows[-1][schema.STEPS] == one_by_one[-1][schema.STEPS] == len(steps)


def _rows_file(tmp_path, ticks) -> tuple:  # with no_flusher
    session = started(tmp_path, "reader", True, USUAL)
    plan = [(i * 10**8, (10, 20, 30, 40, 50, 60), True, i + 1) for i in range(12)]
    drive(session, ticks, plan, set())
    session.train_ended(0)
    session.close()
    path = session.recorder.sink.path
    lines = path.read_bytes().splitlines()
    rows = [i for i, line in enumerate(lines) if b'"kind":"steps"' in line]
    assert len(rows) == 1, "the 11 steps after the first as one rows line"
    return path, lines, rows[0]


def test_the_reader_makes_the_rows_steps_in_order(tmp_path, ticks, no_flusher):
    path, _, _ = _rows_file(tmp_path, ticks)
    data = read_rank_file(path, 0)
    assert data.bad_lines == 0 and not data.truncated_tail
    assert data.columns[schema.GLOBAL_STEP] == list(range(1, 13))
    assert data.columns[schema.STEP_INDEX] == list(range(12))
    steps = [r for r in read_records(path) if r and r[schema.KIND] == schema.KIND_STEP]
    assert [r[schema.FORWARD] for r in steps] == [0.0] * 12  # 30 ns
    assert [r[schema.GAP_MS] for r in steps[1:]] == [100.0] * 11  # 1e8 - 210 ns


@pytest.mark.parametrize(
    "damage",
    [
        lambda line: line[: len(line) // 2],  # cut in two
        lambda line: line.replace(b'"first_step"', b'"first"'),  # a key missing
        lambda line: line.replace(b"[[", b"[[1,").replace(b"],[", b"],[1,"),  # rows too long
        lambda line: line.replace(b'"origin_ns":0', b'"origin_ns":"x"'),  # a value of a bad type
    ],
)
def test_a_damaged_rows_line_is_a_bad_line_and_the_rest_is_read(
    tmp_path, ticks, no_flusher, damage
):
    path, lines, at = _rows_file(tmp_path, ticks)
    lines[at] = damage(lines[at])
    path.write_bytes(b"\n".join(lines) + b"\n")
    data = read_rank_file(path, 0)
    assert data.bad_lines == 1 and data.step_count == 1 and data.footer is not None
    assert sum(r is None for r in read_records(path)) == 1


def test_a_rows_line_cut_at_the_end_of_the_file_is_a_cut_tail(tmp_path, ticks, no_flusher):
    path, lines, at = _rows_file(tmp_path, ticks)
    path.write_bytes(b"\n".join(lines[:at]) + b"\n" + lines[at][:-9])  # a SIGKILL mid-write
    data = read_rank_file(path, 0)
    assert data.truncated_tail and data.bad_lines == 0 and data.step_count == 1


def test_a_step_whose_phases_overlap_is_never_a_row(tmp_path, ticks, no_flusher):
    # The transfer inside the forward (the events still in the usual order): the clock
    # counts the overlap and makes that record itself; the steps around it go as rows.
    session = started(tmp_path, "overlap", True, USUAL)
    plan = [(i * 10**8, (10, 20, 30, 40, 50, 60), True, i + 1) for i in range(6)]
    drive(session, ticks, plan[:3], set())
    t = 3 * 10**8
    for event in ((USUAL[0], t, t + 10), (USUAL[1], t + 15, t + 20), (USUAL[2], t + 10, t + 40)):
        session.event_log(event)
    session.event_log((USUAL[3], t + 40, t + 80))
    session.event_log((USUAL[4], t + 130))
    ticks.now = t + 130  # phases of 135 ns in a step of 130
    session.batch_ended(4, 0)
    drive(session, ticks, plan[4:], set())
    session.train_ended(0)
    session.close()
    assert session.clock.overlaps == 1
    lines = [orjson.loads(line) for line in session.recorder.sink.path.read_bytes().splitlines()]
    kinds = [line[schema.KIND] for line in lines if line[schema.KIND].startswith("step")]
    assert kinds == ["step", "steps", "step", "steps"]
    steps = [r for r in read_records(session.recorder.sink.path) if r and r["kind"] == "step"]
    assert [r[schema.GLOBAL_STEP] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert steps[3][schema.RESIDUAL] == 0.0


@pytest.mark.parametrize("at", [1, 2, 8, 9, 10, 25, 28])
def test_a_line_stops_at_an_overlap_wherever_it_falls_in_the_flushers_chunks(
    tmp_path, ticks, no_flusher, at
):
    # The flusher looks at the queue 8, 16, 32... steps at a time: an overlapping step on
    # either side of a chunk's edge ends the line there, the steps after it a line of their own.
    session = started(tmp_path, "overlap", True, USUAL)
    plan = [(i * 10**8, (10, 20, 30, 40, 50, 60), True, i + 1) for i in range(30)]
    drive(session, ticks, plan[:at], set())
    t = at * 10**8
    for event in ((USUAL[0], t, t + 10), (USUAL[1], t + 15, t + 20), (USUAL[2], t + 10, t + 40)):
        session.event_log(event)
    session.event_log((USUAL[3], t + 40, t + 80))
    session.event_log((USUAL[4], t + 130))
    ticks.now = t + 130
    session.batch_ended(at + 1, 0)
    drive(session, ticks, plan[at + 1 :], set())
    session.train_ended(0)
    session.close()
    assert session.clock.overlaps == 1
    lines = [orjson.loads(line) for line in session.recorder.sink.path.read_bytes().splitlines()]
    kinds = [line[schema.KIND] for line in lines if line[schema.KIND].startswith("step")]
    # The session's first step is never a row (no step before it to start from).
    assert kinds == ["step"] + ["steps"] * (at > 1) + ["step", "steps"]
    rows = [len(line[schema.ROWS]) for line in lines if line[schema.KIND] == "steps"]
    assert rows == [at - 1] * (at > 1) + [30 - at - 1]
    steps = [r for r in read_records(session.recorder.sink.path) if r and r["kind"] == "step"]
    assert [r[schema.GLOBAL_STEP] for r in steps] == list(range(1, 31))
    assert steps[at][schema.RESIDUAL] == 0.0


def test_row_records_carry_the_cost_and_the_write_time_as_the_flusher_counts_them():
    line = {
        schema.ROWS_ORIGIN_NS: 0,
        schema.ROWS_FIRST_STEP: 5,
        schema.ROWS_LAST_END_NS: 900,
        schema.ROWS_COST_NS: 10_000,
        schema.ROWS_WRITE_NS: 2_340,
        schema.ROWS: [
            [
                1_000,
                2_000,
                2_000,
                3_000,
                3_000,
                4_000,
                4_000,
                5_000,
                6_000,
                7_000,
                9,
                1,
                None,
                12_550,
            ],
            [
                8_000,
                9_000,
                9_000,
                9_500,
                9_500,
                9_600,
                9_600,
                9_700,
                9_800,
                9_900,
                10,
                1,
                77,
                12_600,
            ],
        ],
    }
    first, second = row_records(line)
    cost, rss = STEP_KEYS[schema.TRACEML_COST_US], STEP_KEYS[schema.RSS]
    assert first[cost] == round(2.6 + 2.34, 1) and rss not in first  # (2,550 + 50) // 100 / 10
    assert second[cost] == 0.1 and second[rss] == 77
    assert first[schema.STEP_INDEX] == 5 and second[schema.STEP_INDEX] == 6
    assert first[schema.GAP_MS] == 0.0 and second[schema.GAP_MS] == 0.001
    assert second[schema.RESIDUAL] == 0.0 and second[schema.STEP] == 0.002


@pytest.mark.parametrize("limit", [3, 4, 6])
def test_at_the_step_limit_rows_count_what_the_one_by_one_path_counts(
    tmp_path, ticks, no_flusher, limit
):
    # The steps past the limit are dropped either way, each step's side door counted once
    # (the DataLoader's batch), the clock's count the same; a step's end after the limit
    # (the wrappers are gone in real training) goes one by one, never as rows.
    outcomes = []
    for rows in (False, True):
        side: list = []
        session = started(tmp_path, f"limit{limit}{rows}", True, USUAL, side, trace_max_steps=limit)
        if not rows:
            session.replay._rows_ready = lambda: False
        session._rss = lambda: 7  # the same reading in both runs
        plan = [(i * 10**8, (10, 20, 30, 40, 50, 60), True, i + 1) for i in range(8)]
        drive(session, ticks, plan[:5], set())
        session.recorder.flush()
        drive(session, ticks, plan[5:6], set())
        emitted = session.clock.steps_emitted
        session.train_ended(0)
        session.close()
        steps = [r for r in records_in(session) if r[schema.KIND] == schema.KIND_STEP]
        outcomes.append((side, emitted, [orjson.dumps(r) for r in steps]))
    assert outcomes[1] == outcomes[0]
    assert len(outcomes[0][2]) == limit if limit < 6 else 6


def test_a_failure_while_counting_a_rows_line_counts_none_of_its_steps(
    tmp_path, ticks, no_flusher, monkeypatch
):
    session = started(tmp_path, "count-fail", True, USUAL)

    def broken(cost):
        raise RuntimeError("cost broke")

    monkeypatch.setattr(session, "costs_reported", broken)
    plan = [(i * 10**8, (10, 20, 30, 40, 50, 60), True, i + 1) for i in range(5)]
    drive(session, ticks, plan, set())
    session.recorder.flush()
    assert session.replay.failure[0] == "t.end"
    assert session.recorder.steps_written == 1  # the first step, one by one; no row counted


def _with_batched_side(session, side: list, broken: bool = False) -> None:
    """The side door (the DataLoader's batch, as ``InputTiming.log_events`` adds it) with a
    count of many events at once, which the rows line calls once."""

    def count_many(events):
        if broken:
            raise RuntimeError("batch count broke")
        side.extend(tuple(event[1:]) for event in events)

    session.replay.add_side_door(SIDE, lambda *fields: side.append(fields), count_many)


def test_a_rows_line_counts_its_side_doors_at_once_as_one_by_one(tmp_path, ticks, no_flusher):
    outcomes = []
    for rows in (False, True):
        side: list = []
        session = started(tmp_path, f"batched{rows}", True, USUAL, [])
        _with_batched_side(session, side)
        if not rows:
            session.replay._rows_ready = lambda: False
        session._rss = lambda: 7
        plan, _ = plan_of(5, microbatches=60)
        drive(session, ticks, plan[:25], set())
        session.recorder.flush()
        drive(session, ticks, plan[25:], set())
        session.train_ended(0)
        session.close()
        steps = [r for r in records_in(session) if r[schema.KIND] == schema.KIND_STEP]
        outcomes.append((side, [orjson.dumps(r) for r in steps]))
    assert outcomes[1] == outcomes[0]
    assert [t0 for _, t0 in outcomes[0][0]] == [t0 for t0, *_ in plan]  # each batch once


def test_a_failure_in_a_side_doors_count_of_many_is_named_after_it(tmp_path, ticks, no_flusher):
    session = started(tmp_path, "batched-broken", True, USUAL, [])
    _with_batched_side(session, [], broken=True)
    plan = [(i * 10**8, (10, 20, 30, 40, 50, 60), True, i + 1) for i in range(5)]
    drive(session, ticks, plan, set())
    session.recorder.flush()
    door, exc = session.replay.failure
    assert door == SIDE and str(exc) == "batch count broke"
    assert session.recorder.sink.halted


def test_the_batch_counts_of_a_line_add_up_as_count_adds_them_one_by_one():
    # InputTiming.count_many (ProcessCounters.add_batches) against InputTiming.count itself,
    # each on the main process's counters (slot 0: read, not published).
    from types import SimpleNamespace

    from traceml.capture.instruments.dataloader import InputTiming
    from traceml.capture.instruments.input_counters import ProcessCounters

    events = [
        ("b", t, t + 7 + i, t + 30 + 2 * i, 4 + i % 3)
        for i, t in enumerate(range(10**6, 10**6 + 900, 100))
    ]
    one = SimpleNamespace(counters=ProcessCounters(1, 0))
    many = SimpleNamespace(counters=ProcessCounters(1, 0))
    for event in events:
        InputTiming.count(one, *event[1:])
    InputTiming.count_many(many, events[:4])
    InputTiming.count_many(many, events[4:])
    fields = [f for f in ProcessCounters.__slots__ if f != "seq"]
    assert [getattr(many.counters, f) for f in fields] == [getattr(one.counters, f) for f in fields]
    assert one.counters.batches == 9 and one.counters.samples == sum(e[4] for e in events)


def _chunk(rnd, count: int) -> list:
    """``count`` usual steps (a side door's event first), timestamps rising across them."""
    now, steps = 10**12, []
    for index in range(count):
        times = []
        for _ in range(10):
            now += rnd.randint(1_000, 90_000)
            times.append(now)
        steps.append(
            (
                ("side", times[0] + 1, times[0] + 2, 8),
                ("fetch", times[0], times[1]),
                ("h2d", times[2], times[3]),
                ("forward", times[4], times[5]),
                ("backward", times[6], times[7]),
                ("stepped", times[8]),
                ("end", times[9], index, 0, None if index % 3 else 7, 1_000 + index),
            )
        )
    return steps


def _damaged(rnd, steps: list) -> list:
    """One step of ``steps`` changed the way a step that is not a row differs."""
    at = rnd.randrange(len(steps))
    step = list(steps[at])
    how = rnd.randrange(7)
    if how == 0:  # phases that overlap
        step[3] = ("forward", step[2][2] - 5, step[3][2])
    elif how == 1:  # a door missing
        del step[2]
    elif how == 2:  # another door in its place
        step[2] = ("other", *step[2][1:])
    elif how == 3:  # an event of another length
        step[5] = (*step[5], 0)
    elif how == 4:  # the global step unknown
        step[6] = (*step[6][:2], None, *step[6][3:])
    elif how == 5:  # not a step's events at all
        steps = [*steps[:at], {"kind": "sample"}, *steps[at + 1 :]]
        return steps
    else:  # in order inside, but it starts before the step before it ended
        shift = step[6][1] - steps[at - 1][6][1] + 1 if at else 0
        step = [
            (e[0], *(v - shift if i < 3 and type(v) is int else v for i, v in enumerate(e[1:])))
            for e in step
        ]
        step[6] = (step[6][0], step[6][1], *steps[at][6][2:])
    return [*steps[:at], tuple(step), *steps[at + 1 :]]


def test_rows_at_once_takes_a_usual_chunk_and_never_takes_what_step_by_step_would_not():
    import random
    from operator import itemgetter

    from traceml.step_rows import RowLayout, rows_at_once, usable_rows

    rnd = random.Random(23)
    shape = ("side", "fetch", "h2d", "forward", "backward", "stepped", "end")
    phases = itemgetter(slice(1, None))
    taken = declined = 0
    for trial in range(400):
        steps = _chunk(rnd, rnd.choice((1, 2, 8, 16, 40)))
        layout = RowLayout(shape, list(map(len, steps[0])), 1)
        if trial % 2:
            steps = _damaged(rnd, steps)
        expected = usable_rows(steps, shape, phases)
        made = rows_at_once(steps, layout)
        if made is None:
            declined += 1
            assert trial % 2, "a chunk of usual steps in order was declined"
            continue
        taken += 1
        assert made == expected and len(made) == len(steps)
        assert all(len(row) == 14 for row in made)
    assert taken > 200 and declined > 150
