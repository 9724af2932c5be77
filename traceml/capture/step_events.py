"""One-door timing's door events: logged by the training thread, replayed into the clock later.

Why: on a fast loop each door was a guarded call into the step clock (the guard's frame, the
clock's method, the step's close, the record's queueing: ~1,000 bytecodes a step on the
training thread, each door on a cache that the millisecond of torch before it had just
evicted). Now a door is one tuple and one ``deque.append`` (a C call, no frame of traceml's):
the phase's name and its timestamps, read by the wrapper around the user's call. The sink's
flusher replays the events into the same :class:`~traceml.capture.step_clock.StepClock`, in the
same order, with the same timestamps, ~100 steps in a row on a warm cache; it closes the steps,
builds their records and writes them. The numbers are those the clock made when it ran inline.
The usual steps that follow each other go as one rows line instead (:meth:`EventReplay._rows`,
rank schema 3.0): their events' integers, whose records the reader makes with the clock's
arithmetic (``traceml.step_rows``).

What that changes, stated:

* A failure in the clock's work (a traceml bug) or an injected fault surfaces on the flusher.
  The replay stops there (the clock's state is no longer trusted) and the next step's end on
  the training thread, where instruments can be taken away, turns tracing off with one warning
  naming the door. Steps replayed before it are kept.
* The step limit (``TRACEML_TRACE_MAX_STEPS``) is reached on the flusher; the doors come off at
  the next step's end, and steps past the limit are dropped, as before.
* Whoever needs the clock current (an epoch's end, an exception, the end of training) settles
  first: :meth:`Session.settle` flushes the queue, which replays every event logged so far.
* The crash bound is the sink's: a SIGKILL loses the events of the last flush interval.

Only for one-door timing (a single process without CUDA events or collectives to place): where
a phase's start needs a door (a CUDA event, a collective's phase), the doors call the session.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain, repeat, starmap
from operator import attrgetter, itemgetter
from typing import Any

from traceml import schema
from traceml.capture import guard
from traceml.capture.clock import clock_ns
from traceml.capture.lifecycle import TRACING
from traceml.capture.sink import MAX_QUEUED
from traceml.step_record import STEP_KEYS
from traceml.step_rows import RowLayout, rows_at_once, usable_rows

_RSS_KEY = STEP_KEYS[schema.RSS]
_COST_KEY = STEP_KEYS[schema.TRACEML_COST_US]
_OWN_COST = attrgetter("own_cost_ns")
_NAME = itemgetter(0)  # an event's door
_FIELDS = itemgetter(slice(1, None))  # an event's fields
_joined = chain.from_iterable
_NOT_A_ROW = object()  # EventReplay._rows: the step in hand is not one (nothing done)
_FIRST_CHUNK, _MAX_CHUNK = 8, 256  # EventReplay._rows' chunks of steps


class EventReplay:
    """A step's door events: logged on the training thread (:attr:`log`), handed to the sink as
    one tuple at the step's end, replayed on the flusher (the sink's ``on_event``: a step's
    events in, None or the step's records out; never raises, the flusher's loop must go on
    writing what came before)."""

    def __init__(
        self,
        session: Any,
        doors: dict[str, Callable[..., Any]],
        end_door: str,
        sink: Any,
        usual: tuple[str, ...] | None = None,
    ) -> None:
        """``doors``: event name -> the clock's method, called with the event's fields;
        ``end_door``: the step-end event's name (:meth:`Session.batch_ended`'s event);
        ``sink``: the rank file's (its queue, its ``halted`` flag); ``usual``: the names of
        the usual microbatch's five events (fetch, transfer, forward, backward, optimizer
        step), which the clock replays in one call, its record at once
        (``StepClock.usual_record``)."""
        self.session = session
        self.doors = {**doors, end_door: self._step_end}
        self.end_door = end_door
        # The usual step's six names in order; None: every step event by event.
        self._usual_names = None if usual is None else (*usual, end_door)
        # Doors that count on their own and never touch the clock (the DataLoader's batch).
        self.side_doors: set[str] = set()
        self._side_counts: dict[str, Callable[..., Any]] = {}  # their counts of many events
        self.sink = sink
        # The open step's events, in order; the doors' log is this list's append.
        self.pending: list[tuple[Any, ...]] = []
        self.log = self.pending.append
        queue = sink.replay_with(self)
        self._queue, self._queued = queue.append, queue.__len__
        # (door, exception) of the first failure: the replay stops, the session turns off.
        self.failure: tuple[str, BaseException] | None = None
        self._acting = False
        self._carried_rss: Any = None  # read at a microbatch's end that closed no step

    # -- the training thread -----------------------------------------------------------------

    def step_ended(self, global_step: Any, epoch: Any) -> None:
        """A microbatch's end (:meth:`Session.batch_ended`, or the Lightning callback's hook
        where :meth:`step_end_door` is not used): its event carries what must be read
        now (the clock, RSS at most every ``RSS_EVERY_NS``, traceml's cost so far), and the
        step's events go to the sink, whose flusher closes the step."""
        session = self.session
        if session.life.state is not TRACING:
            return
        now = clock_ns()
        rss = session.rss_due(now) if now >= session.rss_next_ns else None
        cost = session.cost_ns()
        pending = self.pending
        pending.append((self.end_door, now, global_step, epoch, rss, cost))
        events = tuple(pending)
        pending.clear()  # before queueing: an interrupt between the two loses, never doubles
        self._queue(events)
        sink = self.sink
        if sink.halted or self._queued() >= MAX_QUEUED:
            self.act()

    def step_end_door(self, steps: Any, epochs: Any) -> Callable[..., None]:
        """:meth:`step_ended` as the one frame that a wrapper calls just before Lightning's
        ``on_train_batch_end`` (``ended(*ignored)``), the global step and the epoch read at
        the call from ``steps.completed`` and ``epochs.completed`` (Lightning's progress
        trackers). Not a guarded entry point, which would be three frames more a step and a
        clock read more: its failure turns tracing off as the guard's would, naming the step's
        end door. An injected fault there is raised by the replay, as for the other doors."""
        session, end_door, owners = self.session, self.end_door, self.session.cost_owners
        pending, queue, queued, sink = self.pending, self._queue, self._queued, self.sink

        def ended(*_: Any) -> None:
            try:
                if session.life.state is not TRACING:
                    return
                now = clock_ns()
                rss = session.rss_due(now) if now >= session.rss_next_ns else None
                cost = sum(map(_OWN_COST, owners))  # Session.cost_ns, without its frame
                pending.append((end_door, now, steps.completed, epochs.completed, rss, cost))
                events = tuple(pending)
                pending.clear()  # as in step_ended
                queue(events)
                if sink.halted or queued() >= MAX_QUEUED:
                    self.act()
                session.own_cost_ns += clock_ns() - now  # as the guard counts a door's time
            except Exception as exc:
                guard.failed(session, end_door, exc)

        return ended

    def settle(self) -> None:
        """Every event logged so far replayed, its steps written (:meth:`Session.settle`:
        an epoch's end, an exception, the end of training), and what that found acted on."""
        if self.pending:
            events = tuple(self.pending)
            self.pending.clear()
            self._queue(events)
        self.session.recorder.flush()
        if self.sink.halted and self.session.life.state is TRACING:
            self.act()

    def act(self) -> None:
        """At a step's end, once the sink is ``halted`` (or its queue grew past its bound):
        turn tracing off after a failure, stop at the step limit, or write the queue now when
        the flusher falls behind. Once at a time: turning tracing off settles again."""
        if self._acting:
            return
        self._acting = True
        try:
            session = self.session
            if self.failure is not None:
                session._entry_failed(*self.failure)
                return
            recorder = session.recorder
            written = recorder.flush() and recorder.bad_record is None
            if not written or recorder.limit_reached:
                session._after_write(recorder, written)
        finally:
            self._acting = False

    # -- the flusher -------------------------------------------------------------------------

    def add_side_door(
        self, name: str, count: Callable[..., Any], count_many: Callable[..., Any] | None = None
    ) -> None:
        """A door whose events ``count`` takes (never the clock: the usual step's one call
        may replay it before the clock's events); ``count_many``, if given, takes a list of
        them at once (a rows line's, in order)."""
        self.doors[name] = count
        self.side_doors.add(name)
        if count_many is not None:
            self._side_counts[name] = count_many

    def __call__(self, events: tuple[tuple[Any, ...], ...], queue: Any = None) -> Any:
        """``events``: one step's; ``queue``: the sink's, whose next steps, if usual, are
        written with this one as one rows line (:meth:`_rows`)."""
        if self.failure is not None:
            return None
        inject = guard._inject  # TRACEML_FAULT_INJECT: a door raises, as a guarded one would
        made = event = None
        try:
            first = len(events) - 6
            # The usual microbatch: its five clock events and the step's end, after side doors'
            # events only, in one clock call that makes the record (inline here, the names
            # compared in C: the flusher runs this ~1,000 times a second on a fast loop).
            if (
                inject is None
                and first >= 0
                and tuple(map(_NAME, events[first:])) == self._usual_names
                and (not first or self.side_doors.issuperset(map(_NAME, events[:first])))
            ):
                event = events[-1]  # a failure there is named after the step's end
                fetch, h2d, forward, backward, stepped, end = events[first:]
                session = self.session
                if session.life.state is not TRACING:
                    return None  # logged before tracing stopped (a limit, a failure)
                if queue is not None and self._rows_ready():
                    line = self._rows(events, queue)
                    if line is not _NOT_A_ROW:  # taken: never replayed again below
                        return line
                _, now, global_step, epoch, rss, cost = end
                record = session.clock.usual_record(
                    fetch, h2d, forward, backward, stepped, now, global_step, epoch
                )
                if record is not None:
                    doors = self.doors
                    for event in events[:first]:  # a failure in one is named after its door
                        doors[event[0]](*event[1:])
                    event = end  # and one in the counts after the step's end
                    return self._written(record, record, rss, cost)  # the fields: its own
            doors = self.doors
            for event in events:  # the step's end (the last one) makes its records
                if inject is not None and event[0] == inject:
                    raise guard.InjectedFault("fault injected into " + inject)
                made = doors[event[0]](*event[1:])
        except Exception as exc:
            self.failure = (event[0] if event else "?", exc)
            self.sink.halted = True  # the training thread turns tracing off
            return None
        return made

    def _rows_ready(self) -> bool:
        """Whether the usual steps from here on may go as rows: the clock between steps as
        they leave it, no RSS carried over, no telemetry samples waiting to be placed."""
        session = self.session
        telemetry, recorder = session.telemetry, session.recorder
        return (
            self._carried_rss is None
            and (telemetry is None or not telemetry.pending)
            and not (recorder.limit_reached or recorder.footer_written)
            and session.clock.usual_ready()
        )

    def _rows(self, events: tuple[tuple[Any, ...], ...], queue: Any) -> Any:
        """``events`` (a usual step's) and the steps queued after it with the same doors, as
        one rows line (``step_rows``): each step's door events' integers, its side doors
        counted (all at once where they can). The line stops at the first step whose doors
        differ, whose timestamps are out of order (phases that overlap, counted by the clock)
        or whose steps are unknown. ``_NOT_A_ROW`` where ``events`` is such a step (nothing
        done: the caller replays it); None where a side door failed (``failure`` set).

        No bytecode a step: the steps go through C iterators a chunk at a time, the first one
        small (a loop whose every step is unusable pays for eight steps a step, not the whole
        queue): the whole chunk checked column by column (``step_rows.rows_at_once``), else
        step by step, to find where the line stops (``usable_rows``). The record arithmetic
        is the reader's."""
        session = self.session
        event = events[-1]  # a failure is named after the step's end, or its side door
        first = len(events) - 6
        try:
            # Only the flusher takes from the queue (under the sink's lock): what it holds now
            # stays there, and steps queued meanwhile go in the next line. At most MAX_QUEUED
            # steps a line (~200 KB).
            steps = [events, *queue]
            shape, phases = tuple(map(_NAME, events)), itemgetter(slice(first, None))
            layout = RowLayout(shape, list(map(len, events)), first)
            rows: list[tuple[Any, ...]] = []
            size = _FIRST_CHUNK
            while len(rows) < len(steps):
                chunk = steps[len(rows) : len(rows) + size]
                made = rows_at_once(chunk, layout)
                if made is None:  # a step in it is not a row, or the chunk's order breaks
                    made = usable_rows(chunk, shape, phases)
                rows += made
                if len(made) < len(chunk):
                    break
                size = min(2 * size, _MAX_CHUNK)
            if rows and (
                session.life.state is not TRACING
                or (session.telemetry is not None and session.telemetry.pending)
            ):
                del rows[1:]  # changed meanwhile: the line stops after the step in hand
            if not rows:
                return _NOT_A_ROW
            list(starmap(queue.popleft, repeat((), len(rows) - 1)))  # C calls, no bytecode
            if first:
                self._count_sides(steps[: len(rows)], first, rows)
        except Exception as exc:
            self.failure = (event[0], exc)
            self.sink.halted = True  # the training thread turns tracing off
            return None
        if not rows:
            return None
        return self._rows_line(rows)

    def _count_sides(self, steps: list[Any], first: int, rows: list[Any]) -> None:
        """The side doors' events of a line's ``steps``, counted: all at once where every
        side door can (a failure keeps the line's rows), else one by one in order (a failure
        keeps the rows of the steps before its own). A failure is named after its door."""
        many = self._side_counts if len(self._side_counts) == len(self.side_doors) else None
        doors, event, done = self.doors, ("?",), 0
        try:
            if many is not None:
                seen = list(_joined(map(itemgetter(slice(0, first)), steps)))
                for name, count in many.items():
                    event = (name,)
                    count(seen if len(many) == 1 else [e for e in seen if e[0] == name])
                return
            for done, step in enumerate(steps):  # noqa: B007 (read by the except below)
                for event in step[:first]:
                    doors[event[0]](*event[1:])
        except Exception as exc:
            if many is None:
                del rows[done:]
            self.failure = (event[0], exc)
            self.sink.halted = True  # the training thread turns tracing off

    def _rows_line(self, rows: list[tuple[Any, ...]]) -> dict[str, Any] | None:
        """The rows line of ``rows`` (the sink encodes it), its steps counted: by the clock
        (their indexes, the last one's end), the session (their cost) and the rank file (the
        step limit: the rows past it are dropped)."""
        session = self.session
        recorder, clock = session.recorder, session.clock
        last = rows[-1]
        first_step, last_end = clock.rows_closed(len(rows), last[9])
        cost_ns = session.costs_reported(last[13])
        count, write_ns = recorder.count_rows(len(rows))  # last: a failure above counts none
        if recorder.limit_reached:
            self.sink.halted = True  # the training thread takes the doors away
        if not count:
            return None
        return {
            schema.KIND: schema.KIND_STEP_ROWS,
            schema.ROWS_ORIGIN_NS: clock.origin_ns,
            schema.ROWS_FIRST_STEP: first_step,
            schema.ROWS_LAST_END_NS: last_end,
            schema.ROWS_COST_NS: cost_ns,
            schema.ROWS_WRITE_NS: write_ns,
            schema.ROWS: rows if count == len(rows) else rows[:count],
        }

    def _step_end(self, now: int, global_step: Any, epoch: Any, rss: Any, cost: int) -> Any:
        """The session's ``_emit`` for a replayed step's end: the step closed, its RSS and cost
        fields (read on the training thread, carried by the event), counted, handed back to
        the sink with the telemetry samples that came in since."""
        session = self.session
        if session.life.state is not TRACING:
            return None  # logged before tracing stopped (a limit, a failure): not written
        closed = session.clock.batch_closed(now, global_step, epoch)
        if closed is None:  # a microbatch that did not step: its RSS goes to the step's record
            if rss is not None:
                self._carried_rss = rss
            return None
        return self._written(closed, closed.extra, rss, cost)

    def _written(self, closed: Any, fields: dict[str, Any], rss: Any, cost: int) -> Any:
        """``closed`` (a closed step or its record) counted, with the session's fields put in
        ``fields`` (the closed step's ``extra``, or the record itself)."""
        session = self.session
        if rss is None:
            rss, self._carried_rss = self._carried_rss, None
        else:
            self._carried_rss = None
        if rss is not None:
            fields[_RSS_KEY] = rss
        fields[_COST_KEY] = session.cost_field(cost)
        recorder = session.recorder
        steps_before = recorder.steps_written
        counted = recorder.count_step(closed)
        if recorder.limit_reached:
            self.sink.halted = True  # the training thread takes the doors away
        if not counted:
            return None
        telemetry = session.telemetry
        if telemetry is not None and telemetry.pending:  # about once a second
            samples = list(telemetry.collect())  # () when it failed (and turned itself off)
            for sample in samples:
                sample[schema.AT_STEP] = steps_before
            samples.append(closed)
            return samples
        return closed
