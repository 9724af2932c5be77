"""BUDGET_OFF=<door>[,<door>]: switch one of traceml's doors off inside a traced stress run;
LAYOUT_CLASSES=<n>: shift the process's memory layout first (:func:`shift_layout`).

Loaded at interpreter start by a ``sitecustomize`` that ``benchmarks/overhead.py --budget``
writes into a temporary directory on PYTHONPATH (after the traceml bootstrap's ``.pth`` ran,
before Lightning is imported), so the patches are in place before traceml's Lightning side is
imported. Each door is switched off by replacing the function behind it with the cheapest
thing that keeps the rest of the tracing working; what a door costs is then the traced run's
loop time minus the run with that door off, measured side by side.

Doors that cannot be taken away without stopping the step clock (the DataLoader fetch, which
starts every step, and the callback's phase hooks) are what is left: the total minus the
doors below. Prints ``BUDGET_OFF applied=<doors>`` so the benchmark knows each patch took.
"""

from __future__ import annotations

import importlib
import os
from typing import Any


def _guard() -> None:
    """Every entry point called bare: no try/except, no own-cost timing, no depth count."""
    guard = importlib.import_module("traceml.capture.guard")
    registered = guard.ENTRY_POINTS

    def entry_point(name: str, what: str, **_: Any):
        registered[name] = what

        def decorate(function):
            function.traceml_entry_point = name
            return function

        return decorate

    guard.entry_point = entry_point


def _write() -> None:
    """Step records and samples neither encoded nor written (headers and footers still are).
    With one-door timing the steps reach the sink as door events, replayed on the flusher
    (``step_events``): the replay still runs, what it makes is dropped unencoded."""
    sink = importlib.import_module("traceml.capture.sink")
    sink.RankSink.append = lambda self, record: self._fd is not None
    sink.RankSink._encode = lambda self, item, chunks: None
    dumps = sink._dumps  # the flusher encodes the usual step's record itself (sink.flush)

    def steps_unencoded(item: Any, option: int = 0) -> bytes:
        kind = item.get("kind")
        return b"" if kind in ("step", "steps") else dumps(item, option=option)

    sink._dumps = steps_unencoded


def _record() -> None:
    """The step not closed: the step's accumulators just reset, and a record built once at the
    first step handed out again (the flusher encodes it each time, as it would a new one). The
    usual step (``StepClock.usual_record``, the replay's one call) hands out a copy of the first
    record it made; the usual steps' rows are not made (:func:`_rows_unmade`)."""
    step_clock = importlib.import_module("traceml.capture.step_clock")
    original = step_clock.StepClock._close
    original_usual = step_clock.StepClock.usual_record
    usual: dict[str, Any] = {}

    def usual_record(self, *args):
        if (
            self._group is not None
            or self._micro is not None
            or self._pending_iter is not None
            or not self.optimizer_from_backward
        ):
            return None  # not between steps: event by event, as the real call says
        if not usual:
            record = original_usual(self, *args)
            if record is None:
                return None
            usual.update(record)
        return dict(usual)  # the session's fields go into it: one of its own

    step_clock.StepClock.usual_record = usual_record
    made: dict[str, Any] = {}

    class Made:
        __slots__ = ("extra",)

        def __init__(self) -> None:
            self.extra: dict[str, Any] = {}

        def record(self) -> dict[str, Any]:
            return {**made, **self.extra}

    def close(self, end_ns, optimizer_stepped, global_step, epoch):
        if not made:
            made.update(original(self, end_ns, optimizer_stepped, global_step, epoch).record())
        self._group = None
        return Made()

    step_clock.StepClock._close = close
    _rows_unmade()


def _rows_unmade() -> None:
    """The usual steps' rows (rank schema 3.0, ``EventReplay._rows``) not made: the queued
    steps after the one in hand taken off unread, counted, and the first line made handed out
    again (its steps not checked, their side doors not counted)."""
    step_events = importlib.import_module("traceml.capture.step_events")
    original = step_events.EventReplay._rows
    first: dict[str, Any] = {}

    def rows(self, events, queue):
        if not first:
            line = original(self, events, queue)
            if line is not None:
                first.update(line)
            return line
        count = 1
        while queue and type(queue[0]) is tuple:
            queue.popleft()
            count += 1
        self.session.recorder.count_rows(count)
        return dict(first)

    step_events.EventReplay._rows = rows


def _telemetry() -> None:
    """No sampler thread, no RSS reading per step."""
    importlib.import_module("traceml.capture.telemetry").sampler_for = lambda *a, **k: None
    importlib.import_module("traceml.capture.rss").rss_reader = lambda: None


def _input() -> None:
    """The dataset / collate doors (worker-side input timing) not installed."""
    dataloader = importlib.import_module("traceml.capture.instruments.dataloader")
    dataloader.install_input_timing = lambda *a, **k: (None, "switched off by BUDGET_OFF")


def _forward() -> None:
    """No forward wrapper on the model (Forward stays null, its time goes to Residual)."""
    instruments = importlib.import_module("traceml.capture.frameworks.lightning_instruments")
    instruments.forward_module = lambda pl_module: None


def _transfer() -> None:
    """The strategy's batch_to_device not wrapped (H2D stays null)."""
    instruments = importlib.import_module("traceml.capture.frameworks.lightning_instruments")
    instruments.Instruments._wrap_transfer = lambda self, strategy: None


DOORS = {
    "guard": _guard,
    "write": _write,
    "record": _record,
    "telemetry": _telemetry,
    "input": _input,
    "forward": _forward,
    "transfer": _transfer,
}


def _door_times() -> None:
    """DOOR_TIMES=1: every entry point made from now on (the Lightning side's, imported
    after this) also keeps its own durations; at exit one line per door with 100+ calls."""
    import atexit
    import sys

    guard = importlib.import_module("traceml.capture.guard")
    times: dict[str, list[int]] = {}
    guard.DOOR_TIMES = times
    timed = "_g_owner.own_cost_ns += _g_clock() - _g_start"
    for body_name in ("_BODY", "_PER_STEP_BODY"):
        body = getattr(guard, body_name, None)
        if body is None:  # an older checkout's guard (one body)
            continue
        line = next((line for line in body.splitlines() if line.strip() == timed), None)
        if line is None:
            raise RuntimeError("the guard's body changed: DOOR_TIMES needs updating")
        indent = line[: len(line) - len(line.lstrip())]
        replacement = (
            f"{indent}_g_d = _g_clock() - _g_start\n"
            f"{indent}_g_owner.own_cost_ns += _g_d\n"
            f"{indent}_g_guard.DOOR_TIMES.setdefault(_g_name, []).append(_g_d)"
        )
        setattr(guard, body_name, body.replace(line, replacement))
    guard._factories.clear()

    def report() -> None:
        for name, values_ in sorted(times.items()):
            if len(values_) >= 100:
                values_.sort()
                median = values_[len(values_) // 2]
                print(f"DOOR_TIME {name} calls={len(values_)} p50_ns={median}", file=sys.stderr)

    atexit.register(report)


def _floor() -> None:
    """DOOR_FLOOR=1 (with DOOR_TIMES): what the doors cost with nothing behind them (written
    for the session-method doors before stop 40's door events, which have no method). The
    session's per-batch methods become one list append of the time (no clock, no record, no
    write: the run records no steps), so each door's own time is the guard, the callback's
    frame, Lightning's arguments and one append: the floor of any clock behind these doors."""
    session = importlib.import_module("traceml.capture.session").Session
    clock_ns = importlib.import_module("traceml.capture.clock").clock_ns
    events: list[tuple[int, int]] = []
    append = events.append
    real_fetched = session.fetched

    def event(code: int):
        def method(self, *_args: Any) -> None:
            append((code, clock_ns()))

        return method

    names = "forward_started forward_ended backward_started backward_ended optimizer_started"
    one_door = ["forward_timed", "backward_timed"]
    for code, name in enumerate([*names.split(), "batch_ended", "transferred", *one_door]):
        setattr(session, name, event(code))

    def transfer_started(self) -> int:
        start = clock_ns()
        append((20, start))
        return start

    def fetched(self, start: int, end: int) -> None:
        if not events:  # the first fetch opens the clock's step, as the session's does
            real_fetched(self, start, end)
        append((21, end))

    session.transfer_started = transfer_started
    session.fetched = fetched


# LAYOUT_CLASSES=<n> (overhead.py --budget --layouts): n classes made and kept at start.
_LAYOUT: list[Any] = []


def shift_layout(count: int) -> None:
    """Make ``count`` small classes, each looked up once (a type version tag each), and keep
    them with a string each: every type and name made after them gets another version tag and
    address. CPython's method cache slot is a hash of the two, so which of the loop's hot
    (type, name) lookups collide moves with them: a plain stress run with 37 such classes ran
    19,399 instructions a batch more than with none, with 400 2,091 more (stop 49). A cost
    measured over several layouts is traceml's; one measured in one layout is partly luck."""
    for index in range(count):
        made = type(f"Layout{index}", (), {"a": index, f"m{index}": lambda self: None})
        _LAYOUT.append((made, made().a, "s" * (index % 50 + 1) + str(index)))  # .a: a tag


def install() -> None:
    if os.environ.get("LAYOUT_CLASSES"):
        shift_layout(int(os.environ["LAYOUT_CLASSES"]))
    if os.environ.get("DOOR_TIMES"):
        _door_times()
    if os.environ.get("DOOR_FLOOR"):
        _floor()
    wanted = [door for door in os.environ.get("BUDGET_OFF", "").split(",") if door]
    applied = []
    for door in wanted:
        try:
            DOORS[door]()
            applied.append(door)
        except Exception as exc:  # a renamed target: the benchmark reports the door as n/a
            print(f"BUDGET_OFF {door} not applied: {type(exc).__name__}: {exc}", flush=True)
    if wanted:
        print(f"BUDGET_OFF applied={','.join(applied) or '-'}", flush=True)
