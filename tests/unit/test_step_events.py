"""One-door timing's event log (traceml.capture.step_events), on a real session and rank file.

The events a step's doors log are replayed into the clock on the sink's flusher; these tests
hold the replay to the clock run inline (the same records, field for field), and check what the
replay changes: a failure found there turns tracing off at the next step's end, the step limit
is reached there, and an epoch's end or an exception settles first. (On real Lightning:
test_attribution.py, test_fault_injection.py, test_rank_file_crash_bound.py.)
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from traceml import console, schema
from traceml.capture import guard, step_events
from traceml.capture import session as session_module
from traceml.capture.lifecycle import DISABLED, DONE
from traceml.capture.session import Session
from traceml.capture.step_clock import StepClock
from traceml.settings import Settings
from traceml.step_record import STEP_KEYS

from rankfiles import lines_as_written

RANK = {
    schema.RANK: 0,
    schema.LOCAL_RANK: 0,
    schema.WORLD_SIZE: 1,
    schema.NODE_RANK: 0,
    schema.LOCAL_WORLD_SIZE: 1,
}
# Read on the training thread at different moments in the two paths: not compared.
VARYING = {STEP_KEYS[schema.RSS], STEP_KEYS[schema.TRACEML_COST_US]}
FETCH, H2D, FORWARD, BACKWARD, STEPPED = "t.fetch", "t.h2d", "t.forward", "t.backward", "t.step"
ITERATOR, SIDE = "t.iterator", "t.side"
USUAL = (FETCH, H2D, FORWARD, BACKWARD, STEPPED)


class Ticks:
    """The session's clock, deterministic: each read a given value (``step`` ns later than
    the read before it when ``step`` is set)."""

    def __init__(self) -> None:
        self.now = 0
        self.step = 0

    def __call__(self) -> int:
        now = self.now
        self.now += self.step
        return now


@pytest.fixture
def ticks(monkeypatch):
    clock = Ticks()
    monkeypatch.setattr(session_module, "clock_ns", clock)
    monkeypatch.setattr(step_events, "clock_ns", clock)  # the replay's step end reads it
    return clock


_STARTED: list[Session] = []


@pytest.fixture(autouse=True)
def _no_flusher_left():
    """A test that ends with its session open (a failure it checks) leaves no flusher thread
    behind for the tests after it (test_sink counts them)."""
    yield
    while _STARTED:
        sink = _STARTED.pop().recorder.sink
        if sink is not None:
            sink.close()


def started(tmp_path, name: str, events: bool, usual=USUAL, side=None, **settings) -> Session:
    session = Session(
        Settings(tmp_path, name, launcher_managed=True, **settings), integration="test"
    )
    _STARTED.append(session)
    assert session.open(dict(RANK))
    session.start(None, {}, origin_ns=0)
    session.clock.optimizer_from_backward = True  # one-door timing, as Lightning sets it
    if events:
        clock = session.clock
        doors = {
            FETCH: clock.fetched,
            H2D: clock.transferred,
            FORWARD: clock.forward_timed,
            BACKWARD: clock.backward_timed,
            STEPPED: clock.optimizer_ended,
            ITERATOR: clock.iterator_created,
        }
        session.log_events(doors, "t.end", usual)
        if side is not None:  # a door that counts on its own (the DataLoader's batch)
            session.replay.add_side_door(SIDE, lambda *fields: side.append(fields))
    return session


class Tracker:
    """One of Lightning's progress trackers, as ``EventReplay.step_end_door`` reads it."""

    def __init__(self) -> None:
        self.completed = 0


def trackers_end(session: Session) -> Any:
    """``ended(global_step, epoch)`` through the replay's end door, as the wrapper before
    Lightning's ``on_train_batch_end`` calls it (the counters set in the trackers first)."""
    steps, epochs = Tracker(), Tracker()
    door = session.replay.step_end_door(steps, epochs)

    def ended(global_step: int, epoch: int) -> None:
        steps.completed, epochs.completed = global_step, epoch
        door("trainer", None)

    return ended


def drive(
    session: Session, ticks: Ticks, plan: list[tuple], epoch_ends: set[int], ended: Any = None
) -> None:
    """Each microbatch of ``plan``: (t0, durations, stepped, global_step). Inline: the clock's
    methods; with events: the log, as the wrappers call them. ``ended(global_step, epoch)``:
    the step's end (default ``session.batch_ended``)."""
    log = session.event_log
    ended = ended or session.batch_ended
    for index, (t0, (fetch, h2d, forward, backward, optimizer, rest), stepped, step) in enumerate(
        plan
    ):
        t = t0
        bounds = []
        for door, duration in (
            (FETCH, fetch),
            (H2D, h2d),
            (FORWARD, forward),
            (BACKWARD, backward),
        ):
            bounds.append((door, t, t + duration))
            t += duration
        if stepped:
            t += optimizer
            bounds.append((STEPPED, t))
        if log is not None and session.replay.side_doors:
            bounds.insert(0, (SIDE, index, t0))  # logged inside the fetch, before its event
        for event in bounds:
            if log is not None:
                log(event)
            else:
                {
                    FETCH: session.clock.fetched,
                    H2D: session.clock.transferred,
                    FORWARD: session.clock.forward_timed,
                    BACKWARD: session.clock.backward_timed,
                    STEPPED: session.clock.optimizer_ended,
                }[event[0]](*event[1:])
        ticks.now = t + rest
        ended(step, 0)
        if index in epoch_ends:
            ticks.now += 7
            session.epoch_ended(step, 0)
            # The next epoch's iterator: its wait is the next step's Input Wait.
            start, end = ticks.now + 1, ticks.now + 5_000
            if log is not None:
                log((ITERATOR, start, end))
            else:
                session.clock.iterator_created(start, end)


def steps_in(session: Session) -> list[dict]:
    records = lines_as_written(session.recorder.sink.path)
    return [
        {k: v for k, v in r.items() if k not in VARYING}
        for r in records
        if r.get(schema.KIND) == schema.KIND_STEP
    ]


def records_in(session: Session) -> list[dict]:
    return lines_as_written(session.recorder.sink.path)


def plan_of(seed: int, microbatches: int = 60) -> tuple[list[tuple], set[int]]:
    rng = random.Random(seed)
    plan, t, step = [], 1_000, 0
    for _ in range(microbatches):
        durations = tuple(rng.randrange(1, 5_000_000) for _ in range(6))
        stepped = rng.random() < 0.7  # gradient accumulation: some microbatches do not step
        step += stepped
        plan.append((t, durations, stepped, step))
        t += sum(durations) + rng.randrange(0, 3_000_000)
    return plan, {i for i in range(microbatches) if rng.random() < 0.1}


@pytest.mark.parametrize("usual", [USUAL, None], ids=["usual_record", "event_by_event"])
@pytest.mark.parametrize("seed", range(6))
def test_the_replayed_events_write_the_records_the_inline_clock_writes(
    tmp_path, ticks, seed, usual, monkeypatch
):
    # usual_record: most single-microbatch steps go as rows (EventReplay._rows, the record
    # made by the reader) or take StepClock.usual_record (one call, the record at once); the
    # others (accumulation, an epoch's first step, side events) go event by event.
    calls, rows = [], []
    real = StepClock.usual_record
    monkeypatch.setattr(StepClock, "usual_record", lambda *a: calls.append(real(*a)) or calls[-1])
    line = step_events.EventReplay._rows_line
    monkeypatch.setattr(
        step_events.EventReplay, "_rows_line", lambda s, r: rows.append(len(r)) or line(s, r)
    )
    plan, epoch_ends = plan_of(seed)
    written, side = [], []
    for events in (False, True):
        session = started(tmp_path, f"r{seed}{'e' if events else 'i'}", events, usual, side)
        drive(session, ticks, plan, epoch_ends)
        session.train_ended(0)
        session.close()
        written.append(steps_in(session))
    inline, replayed = written
    assert len(inline) >= 10
    assert replayed == inline
    assert side == [(index, plan[index][0]) for index in range(len(plan))]  # each once, in order
    taken = len([c for c in calls if c is not None]) + sum(rows)
    assert (taken >= 5 and sum(rows) >= 3) if usual else not (calls or rows)
    assert taken < len(inline)  # and the others event by event


@pytest.mark.parametrize("seed", range(3))
def test_the_end_door_writes_what_the_step_end_writes(tmp_path, ticks, seed):
    # Lightning's one-door step end (EventReplay.step_end_door, the trackers read at the call)
    # against Session.batch_ended with the same numbers: the same records, the same RSS reads.
    plan, epoch_ends = plan_of(seed)
    written = []
    for door in (False, True):
        session = started(tmp_path, f"end{seed}{door}", True, USUAL, [])
        session._rss = iter(range(1, 10**6)).__next__  # each read a new value
        drive(session, ticks, plan, epoch_ends, trackers_end(session) if door else None)
        session.train_ended(0)
        session.close()
        written.append([r for r in records_in(session) if r.get(schema.KIND) == schema.KIND_STEP])
    by_batch_ended, by_end_door = written
    assert len(by_batch_ended) >= 10
    assert by_end_door == by_batch_ended


def test_the_end_door_counts_its_own_time(tmp_path, ticks):
    # As the guard counted the callback's hook: the door's time is traceml's own cost.
    session = started(tmp_path, "end-cost", True)
    plan = [(i * 10**8, (10, 20, 30, 40, 50, 60), True, i + 1) for i in range(5)]
    before = session.own_cost_ns
    ticks.step = 7  # each clock read 7 ns after the one before
    drive(session, ticks, plan, set(), trackers_end(session))
    assert session.own_cost_ns - before == 7 * len(
        plan
    )  # one read at the door's start, one at its end


def test_a_failure_in_the_end_door_turns_tracing_off_and_never_reaches_training(
    tmp_path, ticks, monkeypatch
):
    warnings = []
    monkeypatch.setattr(console, "warn", lambda message, **_: warnings.append(message))
    session = started(tmp_path, "end-fails", True)
    plan = [(i * 10**8, (10, 20, 30, 40, 50, 60), True, i + 1) for i in range(8)]
    ended = trackers_end(session)
    drive(session, ticks, plan[:3], set(), ended)

    class Broken:
        @property
        def completed(self) -> int:
            raise RuntimeError("tracker broke")

    broken = session.replay.step_end_door(Broken(), Tracker())
    drive(session, ticks, plan[3:5], set(), lambda step, epoch: broken("trainer", None))
    assert session.life.state is DISABLED
    assert warnings == [
        "tracing disabled: t.end failed (RuntimeError: tracker broke); training continues untraced"
    ]
    queued = len(session.recorder.sink._queue)
    drive(session, ticks, plan[5:], set(), ended)  # after it: nothing raised, nothing queued
    assert len(session.recorder.sink._queue) == queued
    session.close()
    assert len(steps_in(session)) == 3  # the steps before it, each once


@pytest.mark.parametrize("end", ["batch_ended", "end_door"])
def test_a_failure_found_in_the_replay_turns_tracing_off_at_the_next_step_end(
    tmp_path, ticks, monkeypatch, end
):
    warnings = []
    monkeypatch.setattr(console, "warn", lambda message, **_: warnings.append(message))
    session = started(tmp_path, f"fail-{end}", True)
    ended = trackers_end(session) if end == "end_door" else None
    plan, _ = plan_of(1, microbatches=10)
    drive(session, ticks, plan[:4], set(), ended)
    session.settle()
    kept = len(steps_in(session))
    monkeypatch.setattr(guard, "_inject", FORWARD)
    drive(session, ticks, plan[4:6], set(), ended)
    session.recorder.flush()  # as the flusher would, between two steps
    assert session.life.state is not DISABLED  # found on the flusher: acted on at a step's end
    drive(session, ticks, plan[6:7], set(), ended)
    assert session.life.state is DISABLED
    assert session.event_log is not None and not session._undo  # the doors came off
    session.close()
    assert len(steps_in(session)) == kept
    assert warnings == [
        f"tracing disabled: {FORWARD} failed (InjectedFault: fault injected into {FORWARD}); "
        "training continues untraced"
    ]
    records = records_in(session)
    assert records[-1][schema.STATUS] == schema.STATUS_DISABLED
    assert any(r.get(schema.CODE) == schema.EVENT_DISABLED for r in records)


@pytest.mark.parametrize("end", ["batch_ended", "end_door"])
def test_the_step_limit_is_reached_on_the_flusher_and_the_doors_come_off(tmp_path, ticks, end):
    session = started(tmp_path, f"limit-{end}", True, trace_max_steps=3)
    ended = trackers_end(session) if end == "end_door" else None
    plan = [(i * 10**8, (10, 20, 30, 40, 50, 60), True, i + 1) for i in range(8)]
    drive(session, ticks, plan[:5], set(), ended)
    session.recorder.flush()
    drive(session, ticks, plan[5:6], set(), ended)
    assert session.life.state is DONE
    drive(session, ticks, plan[6:], set(), ended)  # the wrappers are gone in real training
    session.train_ended(0)
    session.close()
    records = records_in(session)
    assert [r[STEP_KEYS[schema.GLOBAL_STEP]] for r in steps_in(session)] == [1, 2, 3]
    assert [r.get(schema.CODE) for r in records].count(schema.EVENT_MAX_STEPS) == 1
    assert records[-1][schema.STEPS] == 3


def test_an_exception_settles_the_finished_steps_and_drops_the_open_one(tmp_path, ticks):
    session = started(tmp_path, "raise", True)
    plan = [(i * 10**8, (10, 20, 30, 40, 50, 60), True, i + 1) for i in range(3)]
    drive(session, ticks, plan, set())
    session.event_log((FETCH, 4 * 10**8, 4 * 10**8 + 5))  # the next step's fetch, then a raise
    session.failed(ValueError("the user's step failed"))
    records = records_in(session)
    assert [r[STEP_KEYS[schema.GLOBAL_STEP]] for r in steps_in(session)] == [1, 2, 3]
    assert records[-1][schema.STATUS] == schema.STATUS_EXCEPTION
    assert records[-1][schema.STEPS] == 3


def test_a_limit_the_replay_reaches_at_the_end_of_training_is_noted(tmp_path, ticks):
    # The last steps are replayed by the end's settle, not by the flusher: no step's end
    # follows to act on the limit, so the settle does.
    session = started(tmp_path, "limit_end", True, trace_max_steps=2)
    plan = [(i * 10**8, (10, 20, 30, 40, 50, 60), True, i + 1) for i in range(4)]
    drive(session, ticks, plan, set())
    session.train_ended(0)
    session.close()
    records = records_in(session)
    assert len(steps_in(session)) == 2
    assert [r.get(schema.CODE) for r in records].count(schema.EVENT_MAX_STEPS) == 1
    assert records[-1][schema.STATUS] == schema.STATUS_COMPLETED


def test_an_epoch_end_that_finds_a_failure_writes_nothing_after_it(tmp_path, ticks, monkeypatch):
    monkeypatch.setattr(console, "warn", lambda message, **_: None)
    session = started(tmp_path, "epoch_fail", True)
    plan = [(i * 10**8, (10, 20, 30, 40, 50, 60), i != 2, i + 1) for i in range(4)]
    drive(session, ticks, plan[:2], set())
    session.settle()  # those two replayed and written
    monkeypatch.setattr(guard, "_inject", STEPPED)
    # Accumulation: a microbatch that does not step (replayed: one in the open group), then
    # one whose optimizer step is the fault; it lies in the queue, not yet replayed.
    drive(session, ticks, plan[2:], set())
    session.epoch_ended(3, 0)  # its settle finds it: no step, no input record after it
    assert session.life.state is DISABLED
    session.close()
    kinds = [r.get(schema.KIND) for r in records_in(session)]
    disabled_at = next(
        i for i, r in enumerate(records_in(session)) if r.get(schema.CODE) == schema.EVENT_DISABLED
    )
    assert schema.KIND_STEP not in kinds[disabled_at:]
    assert len(steps_in(session)) == 2


def test_a_microbatch_that_does_not_step_hands_its_rss_reading_to_the_step(tmp_path, ticks):
    session = started(tmp_path, "rss", True)
    readings = iter(range(1, 100))
    session._rss = lambda: next(readings)
    # Accumulation of two: the first microbatch's end is 10 ms after the last reading (read),
    # the stepping one's only 1 ms later (not read): the step carries the first's reading.
    plan = [
        (20 * 10**6, (10, 10, 10, 10, 10, 10), False, 0),
        (20 * 10**6 + 1_000_000, (10, 10, 10, 10, 10, 10), True, 1),
    ]
    drive(session, ticks, plan, set())
    session.train_ended(0)
    session.close()
    (step,) = [r for r in records_in(session) if r.get(schema.KIND) == schema.KIND_STEP]
    assert step[STEP_KEYS[schema.RSS]] == 1 and step[STEP_KEYS[schema.MICROBATCHES]] == 2


@pytest.mark.parametrize("broken", ["side door", "counts"])
def test_a_failure_in_the_usual_steps_replay_is_named_after_the_door_that_failed(
    tmp_path, ticks, monkeypatch, broken
):
    # The usual step's one call replays the side doors' events, then counts the step: a
    # failure in a side door names that door, one in the counts names the step's end.
    class Side(list):
        def append(self, fields):
            if broken == "side door" and len(self) == 3:
                raise RuntimeError("side door broke")
            super().append(fields)

    session = started(tmp_path, f"name-{broken}", True, USUAL, Side())
    real = session.cost_field

    def cost_field(cost):
        if broken == "counts" and session.recorder.steps_written == 3:
            raise RuntimeError("counts broke")
        return real(cost)

    monkeypatch.setattr(session, "cost_field", cost_field)
    reported = session.costs_reported  # the rows line's count (EventReplay._rows_line)

    def costs_reported(cost):
        if broken == "counts":  # once a line, before the rank file counts it
            raise RuntimeError("counts broke")
        return reported(cost)

    monkeypatch.setattr(session, "costs_reported", costs_reported)
    plan = [(i * 10**8, (10, 20, 30, 40, 50, 60), True, i + 1) for i in range(6)]
    drive(session, ticks, plan, set())
    session.recorder.flush()
    door, exc = session.replay.failure
    assert door == (SIDE if broken == "side door" else "t.end")
    assert str(exc) == f"{broken} broke"
