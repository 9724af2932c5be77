"""The phase clock: exact step records from hand-picked timestamps (no torch)."""

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from traceml import schema
from traceml.capture.closed_step import ClosedStep, Group
from traceml.capture.step_clock import StepClock

MS = 1_000_000  # ns


def run_microbatch(clock: StepClock, t0: int, stepped: bool = True, **context):
    """fetch 0-10, h2d 11-13, forward 14-24, backward 26-40, optimizer 41-45, end 47 (ms)."""
    clock.fetched(t0, t0 + 10 * MS)
    clock.transferred(t0 + 11 * MS, t0 + 13 * MS)
    clock.forward_started(t0 + 14 * MS)
    clock.forward_ended(t0 + 24 * MS)
    clock.backward_started(t0 + 26 * MS)
    clock.backward_ended(t0 + 40 * MS)
    if stepped:
        clock.optimizer_started(t0 + 41 * MS)
    return clock.batch_ended(t0 + 47 * MS, **context)


def test_one_step_adds_up_exactly():
    clock = StepClock(origin_ns=0)
    record = run_microbatch(clock, 100 * MS, global_step=1, epoch=0)
    assert record[schema.STEP] == 47.0
    assert record[schema.INPUT_WAIT] == 10.0
    assert record[schema.H2D] == 2.0
    assert record[schema.FORWARD] == 10.0
    assert record[schema.BACKWARD] == 14.0
    assert record[schema.OPTIMIZER] == 6.0
    # 47 - (10 + 2 + 10 + 14 + 6): the gaps between phases (loss, zero_grad, hooks).
    assert record[schema.RESIDUAL] == 5.0
    assert record[schema.T_START_MS] == 100.0
    assert record[schema.GAP_MS] is None
    assert record[schema.GLOBAL_STEP] == 1
    assert record[schema.MICROBATCHES] == 1


def test_gap_between_steps_is_reported_not_counted():
    clock = StepClock(origin_ns=0)
    run_microbatch(clock, 0)
    second = run_microbatch(clock, 60 * MS)  # previous ended at 47 ms
    assert second[schema.GAP_MS] == 13.0
    assert second[schema.STEP] == 47.0
    assert second[schema.STEP_INDEX] == 1


def test_gradient_accumulation_groups_microbatches():
    clock = StepClock(origin_ns=0)
    assert run_microbatch(clock, 0, stepped=False) is None
    record = run_microbatch(clock, 50 * MS, stepped=True)
    assert record[schema.MICROBATCHES] == 2
    assert record[schema.STEP] == 97.0  # 0 .. 97 ms, including the 3 ms between microbatches
    assert record[schema.INPUT_WAIT] == 20.0
    assert record[schema.FORWARD] == 20.0
    assert record[schema.BACKWARD] == 28.0
    assert record[schema.OPTIMIZER] == 6.0
    phases = sum(record[p] for p in schema.PHASES)
    assert phases == record[schema.STEP]


def test_epoch_end_flushes_a_short_group_without_optimizer_step():
    clock = StepClock(origin_ns=0)
    assert run_microbatch(clock, 0, stepped=False) is None
    record = clock.epoch_ended(60 * MS)  # a validation ran from 47 to 60 ms
    assert record[schema.MICROBATCHES] == 1
    assert record[schema.OPTIMIZER] is None
    assert record[schema.OPTIMIZER_STEPPED] is False
    assert record[schema.STEP] == 47.0  # its microbatch's end: the validation is the next gap


def test_unmeasured_phase_is_null_and_its_time_goes_to_residual():
    clock = StepClock(origin_ns=0)
    clock.fetched(0, 5 * MS)
    clock.backward_started(10 * MS)
    clock.backward_ended(20 * MS)
    clock.optimizer_started(20 * MS)
    record = clock.batch_ended(30 * MS)
    assert record[schema.FORWARD] is None
    assert record[schema.H2D] is None
    assert record[schema.RESIDUAL] == 5.0  # 30 - 5 (input) - 10 (backward) - 10 (optimizer)


def test_iterator_creation_starts_the_step_and_counts_as_input_wait():
    clock = StepClock(origin_ns=0)
    clock.iterator_created(0, 30 * MS)  # workers starting at an epoch's beginning
    clock.fetched(32 * MS, 40 * MS)
    clock.optimizer_started(41 * MS)
    record = clock.batch_ended(45 * MS)
    assert record[schema.STEP] == 45.0
    assert record[schema.INPUT_WAIT] == 38.0
    assert record[schema.OPTIMIZER] == 4.0
    assert record[schema.RESIDUAL] == 3.0  # 30..32 and 40..41 ms: nothing named


def test_nested_forward_counts_the_outer_call_once():
    clock = StepClock(origin_ns=0)
    clock.fetched(0, 0)
    clock.forward_started(1 * MS)
    clock.forward_started(2 * MS)
    clock.forward_ended(3 * MS)
    clock.forward_ended(5 * MS)
    clock.optimizer_started(6 * MS)
    record = clock.batch_ended(6 * MS)
    assert record[schema.FORWARD] == 4.0


def test_a_forward_timed_by_one_door_is_the_same_as_by_two():
    """forward_timed / backward_timed (start, end): the one-door timing (the callers count
    nested calls and keep recomputations inside backward out of Forward)."""
    records = []
    for one_door in (False, True):
        clock = StepClock(origin_ns=0)
        clock.fetched(0, 0)
        if one_door:
            clock.forward_timed(1 * MS, 5 * MS)
        else:
            clock.forward_started(1 * MS)
            clock.forward_ended(5 * MS)
        if one_door:  # the wrapper keeps a recomputation inside backward out of Forward
            clock.backward_timed(6 * MS, 9 * MS)
        else:
            clock.backward_started(6 * MS)
            clock.forward_started(7 * MS)  # a recomputation inside backward: Backward
            clock.forward_ended(8 * MS)
            clock.backward_ended(9 * MS)
        clock.optimizer_started(10 * MS)
        if one_door:  # a closure re-run by the optimizer (LBFGS): not Optimizer
            clock.forward_timed(11 * MS, 13 * MS)
            clock.backward_timed(13 * MS, 14 * MS)
        else:
            clock.forward_started(11 * MS)
            clock.forward_ended(13 * MS)
            clock.backward_started(13 * MS)
            clock.backward_ended(14 * MS)
        records.append(clock.batch_ended(15 * MS))
    assert records[0] == records[1]
    assert records[1][schema.FORWARD] == 6.0
    assert records[1][schema.BACKWARD] == 4.0
    assert records[1][schema.OPTIMIZER] == 2.0


def test_forward_started_and_ended_say_when_they_open_and_close_forward():
    """What the session records the device's Forward by: only the outermost call, and never
    a recomputation inside backward."""
    clock = StepClock(origin_ns=0)
    clock.fetched(0, 0)
    assert clock.forward_started(1 * MS) is True
    assert clock.forward_started(2 * MS) is False  # nested
    assert clock.forward_ended(3 * MS) is False
    assert clock.forward_ended(4 * MS) is True
    clock.backward_started(5 * MS)
    assert clock.forward_started(6 * MS) is False  # a recomputation: Backward
    assert clock.forward_ended(7 * MS) is False


def test_forward_during_backward_is_not_forward():
    clock = StepClock(origin_ns=0)
    clock.fetched(0, 0)
    clock.backward_started(1 * MS)
    clock.forward_started(2 * MS)  # e.g. activation checkpointing recomputes
    clock.forward_ended(3 * MS)
    clock.backward_ended(5 * MS)
    clock.optimizer_started(5 * MS)
    record = clock.batch_ended(5 * MS)
    assert record[schema.FORWARD] is None
    assert record[schema.BACKWARD] == 4.0


def test_boundaries_outside_a_microbatch_are_ignored():
    clock = StepClock(origin_ns=0)
    clock.transferred(0, MS)  # a validation batch transfer
    clock.forward_started(0)
    clock.forward_ended(MS)
    assert clock.batch_ended(2 * MS) is None
    assert clock.steps_emitted == 0


def test_abandon_drops_the_open_step():
    clock = StepClock(origin_ns=0)
    clock.fetched(0, MS)
    clock.abandon()
    assert clock.batch_ended(2 * MS) is None
    assert clock.epoch_ended(3 * MS) is None


def test_a_closed_step_counts_its_overlap_when_its_record_is_built():
    # The session's hot path closes steps (batch_closed) and the sink's flusher builds them:
    # an overlap is counted then, once (the session flushes before it reads the count).
    clock = StepClock(origin_ns=0)
    clock.fetched(0, 10 * MS)
    clock.forward_started(5 * MS)  # a forward hook inside the fetch: phases overlap
    clock.forward_ended(12 * MS)
    clock.optimizer_started(12 * MS)
    closed = clock.batch_closed(13 * MS, global_step=1, epoch=0)
    assert clock.overlaps == 0 and clock.steps_emitted == 1
    record = closed.record()
    assert clock.overlaps == 1
    assert record[schema.RESIDUAL] == 0.0 and record[schema.STEP] == 18.0
    assert clock.batch_closed(14 * MS) is None  # no microbatch open


def _one_door_microbatch(clock: StepClock, t0: int, stepped: bool):
    """fetch 0-10, h2d 11-13, forward 14-24, backward 26-40, the optimizer step returns at 45
    when ``stepped``, end 47 (ms); no optimizer hook."""
    clock.fetched(t0, t0 + 10 * MS)
    clock.transferred(t0 + 11 * MS, t0 + 13 * MS)
    clock.forward_timed(t0 + 14 * MS, t0 + 24 * MS)
    clock.backward_timed(t0 + 26 * MS, t0 + 40 * MS)
    if stepped:
        clock.optimizer_ended(t0 + 45 * MS)
    closed = clock.batch_closed(t0 + 47 * MS)
    return None if closed is None else closed.record()


def test_without_an_optimizer_hook_the_window_opens_at_the_backward_end():
    """optimizer_from_backward (Lightning's one-door timing): Optimizer spans the first
    backward's end to the optimizer step's return; a closure re-run inside it (LBFGS) stays
    Forward/Backward; a microbatch whose optimizer did not step waits for the next one."""
    clock = StepClock(origin_ns=0, optimizer_from_backward=True)
    assert _one_door_microbatch(clock, 0, stepped=False) is None
    record = _one_door_microbatch(clock, 50 * MS, stepped=True)
    assert record[schema.MICROBATCHES] == 2
    assert record[schema.OPTIMIZER] == 5.0  # 90 .. 95 ms: the second microbatch's only
    assert record[schema.FORWARD] == 20.0 and record[schema.BACKWARD] == 28.0
    assert sum(record[p] for p in schema.PHASES) == record[schema.STEP] == 97.0

    clock.fetched(100 * MS, 101 * MS)
    clock.forward_timed(101 * MS, 103 * MS)
    clock.backward_timed(103 * MS, 106 * MS)
    clock.forward_timed(107 * MS, 109 * MS)  # the optimizer runs the closure again
    clock.backward_timed(109 * MS, 110 * MS)
    clock.optimizer_ended(111 * MS)
    clock.forward_timed(112 * MS, 113 * MS)  # a batch-end callback runs the model: Forward
    record = clock.batch_closed(115 * MS).record()
    assert record[schema.OPTIMIZER] == 2.0  # 106 .. 111 less the 3 ms re-run
    assert (record[schema.FORWARD], record[schema.BACKWARD]) == (5.0, 4.0)
    assert record[schema.RESIDUAL] == 3.0  # 101..101, 106..107 less nothing, 111..112, 113..115


def test_the_optimizer_window_ends_where_the_optimizer_step_returns():
    """With the optimizer hook too: what runs after the step's return (lr schedulers,
    batch-end callbacks) is Residual, not Optimizer; without optimizer_ended (other loops),
    the window runs to the batch's end, as before."""
    for reported in (True, False):
        clock = StepClock(origin_ns=0)
        clock.fetched(0, 1 * MS)
        clock.backward_timed(2 * MS, 4 * MS)
        clock.optimizer_started(5 * MS)
        if reported:
            clock.optimizer_ended(9 * MS)
        record = clock.batch_closed(20 * MS).record()
        assert record[schema.OPTIMIZER] == (4.0 if reported else 15.0)
        assert record[schema.RESIDUAL] == (13.0 if reported else 2.0)


def test_a_step_with_no_timed_backward_has_no_optimizer_time():
    """Stepped with no backward to open the window: Optimizer is unmeasured (null), its time
    in Residual; and without the mode, a second backward before the optimizer hook (a loop
    with two losses) is Backward, not taken out of the optimizer window."""
    clock = StepClock(origin_ns=0, optimizer_from_backward=True)
    clock.fetched(0, 2 * MS)
    clock.optimizer_ended(9 * MS)
    record = clock.batch_closed(10 * MS).record()
    assert record[schema.OPTIMIZER] is None
    assert record[schema.RESIDUAL] == 8.0

    clock = StepClock(origin_ns=0)
    clock.fetched(0, 0)
    clock.backward_timed(1 * MS, 2 * MS)
    clock.backward_timed(3 * MS, 5 * MS)
    clock.optimizer_started(6 * MS)
    record = clock.batch_closed(10 * MS).record()
    assert (record[schema.BACKWARD], record[schema.OPTIMIZER]) == (3.0, 4.0)


def _general_record(closed) -> dict:
    """ClosedStep.record by its general path only (the usual-step shortcut bypassed)."""
    group = closed
    named = group.input_ns + sum(
        v or 0 for v in (group.h2d_ns, group.forward_ns, group.backward_ns, group.optimizer_ns)
    )
    record = closed._phases(max(closed.end_ns - group.start_ns, named))
    record.update(closed.extra)
    return record


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    # Half of the values on a rounding edge (x500 ns): the shortcut must round as _phases does.
    phases=st.lists(
        st.one_of(st.integers(0, 5_000_000), st.integers(0, 5_000).map(lambda k: k * 1000 + 500)),
        min_size=6,
        max_size=6,
    ),
    measured=st.lists(st.booleans(), min_size=4, max_size=4),
    start=st.integers(0, 10**12),
    gap=st.one_of(st.none(), st.integers(0, 10**9)),
    tail=st.integers(-3_000_000, 3_000_000),
    microbatches=st.sampled_from([1, 1, 2]),
    stepped=st.booleans(),
    context=st.sampled_from([(3, 0), (None, None), (7, None)]),
    rss=st.one_of(st.none(), st.integers(0, 10**10)),
    usual=st.booleans(),
)
def test_the_usual_step_shortcut_writes_the_same_line_as_the_general_path(
    phases, measured, start, gap, tail, microbatches, stepped, context, rss, usual
):
    # ClosedStep._usual builds the common record in one dict display: same keys, same order,
    # same rounding as _phases, including overlaps (a negative tail) and rounding at 500 ns.
    if usual:  # half the cases take the shortcut (every phase measured, one microbatch...)
        measured, gap, microbatches, stepped = [True] * 4, gap or 0, 1, True
        context = (context[0] or 0, context[1] or 0)
    clock = StepClock(origin_ns=start // 3)
    group = Group(start)
    group.microbatches, group.input_ns = microbatches, phases[0]
    for name, value, on in zip(
        ("h2d_ns", "forward_ns", "backward_ns", "optimizer_ns"), phases[1:5], measured, strict=True
    ):
        setattr(group, name, value if on else None)
    named = group.input_ns + sum(v for v, on in zip(phases[1:5], measured, strict=True) if on)
    end = start + named + phases[5] % 1000 + tail
    last_end = None if gap is None else start - gap
    closed: ClosedStep = group  # closed as StepClock._close closes it
    closed.clock, closed.end_ns, closed.last_end_ns = clock, end, last_end
    closed.optimizer_stepped, closed.global_step, closed.epoch = stepped, *context
    closed.index, closed.extra = 4, {}
    if rss is not None:
        closed.extra["rss"] = rss
    closed.extra["own"] = 1.5
    expected = orjson.dumps(_general_record(closed))
    assert orjson.dumps(closed.record()) == expected
    assert clock.overlaps == (1 if end - start < named else 0)
