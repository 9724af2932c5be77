"""The guard's generated wrappers: the decorated function sees exactly its own call.

The guard writes one wrapper per parameter list (``self, trainer, pl_module``) instead of
``*args, **kwargs``, for speed; these check that arguments, keywords, varargs, defaults, the
owner's cost and failures reach the same places either way.
"""

import threading

import pytest

from traceml.capture import guard
from traceml.capture.guard import ENTRY_POINTS, entry_point


@pytest.fixture
def owner():
    """An owner whose entry points are registered for this test only (the fault-injection
    suite checks that every registered entry point of traceml has a scenario)."""

    class Owner:
        def __init__(self):
            self.own_cost_ns = 0
            self.failures = []

        def _entry_failed(self, name, exc):
            self.failures.append((name, str(exc)))

        @entry_point("test_guard.plain", "positional parameters only")
        def plain(self, trainer, pl_module):
            return (trainer, pl_module)

        @entry_point("test_guard.varargs", "varargs")
        def varargs(self, trainer, *args):
            return (trainer, args)

        @entry_point("test_guard.defaults", "a default: the generic wrapper", default="fallback")
        def defaults(self, value, scale=2):
            return value * scale

        @entry_point("test_guard.start", "a parameter named like the wrapper's own start")
        def start(self, start, end):
            return end - start

        @entry_point("test_guard.raises", "raises", default="default")
        def raises(self, reason):
            raise ValueError(reason)

        @entry_point("test_guard.nested", "calls another entry point")
        def nested(self):
            return self.plain(1, 2)

    try:
        yield Owner()
    finally:
        for name in [n for n in ENTRY_POINTS if n.startswith("test_guard.")]:
            del ENTRY_POINTS[name]


def test_arguments_keywords_and_varargs_arrive_unchanged(owner):
    assert owner.plain(1, 2) == (1, 2)
    assert owner.plain(trainer=3, pl_module=4) == (3, 4)
    assert owner.varargs(1, 2, 3) == (1, (2, 3))
    assert owner.defaults(3) == 6 and owner.defaults(3, scale=5) == 15
    assert owner.start(10, 25) == 15  # no clash with the wrapper's own locals
    plain = type(owner).plain
    assert plain.__name__ == "plain" and plain.__wrapped__ is not None
    assert plain.traceml_entry_point == "test_guard.plain" in ENTRY_POINTS


def test_a_failure_goes_to_the_owner_and_returns_the_default(owner):
    assert owner.raises("boom") == "default"
    assert owner.failures == [("test_guard.raises", "boom")]


def test_cost_is_counted_once_for_nested_calls_and_per_thread(owner):
    owner.nested()
    assert owner.own_cost_ns > 0
    assert guard._inside == set()  # nothing left marked inside after the calls
    seen = []

    def other_thread():
        before = owner.own_cost_ns
        owner.plain(1, 2)
        seen.append(owner.own_cost_ns > before)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert seen == [True] and guard._inside == set()


def test_fault_injection_reaches_generated_wrappers(owner, monkeypatch):
    monkeypatch.setattr(guard, "_inject", "test_guard.plain")
    assert owner.plain(1, 2) is None
    assert owner.failures and owner.failures[0][0] == "test_guard.plain"


def test_a_per_step_door_counts_its_cost_routes_its_failure_and_marks_nothing(owner):
    class Hot:
        def __init__(self):
            self.own_cost_ns = 0
            self.failures = []

        def _entry_failed(self, name, exc):
            self.failures.append((name, str(exc)))

        @entry_point("test_guard.per_step", "a per-step door", per_step=True)
        def step(self, value):
            if value is None:
                raise ValueError("no value")
            assert guard._inside == set()  # no nesting bookkeeping on the hot path
            return value * 2

    hot = Hot()
    assert hot.step(4) == 8
    assert hot.own_cost_ns > 0
    assert hot.step(None) is None
    assert hot.failures == [("test_guard.per_step", "no value")]


def test_a_declared_name_is_registered_once():
    # declare: a door with no guarded callable (a logged event, replayed under this name).
    name = guard.declare("test_guard.declared", "a door that logs an event")
    assert guard.ENTRY_POINTS[name] == "a door that logs an event"
    with pytest.raises(ValueError, match="registered twice"):
        guard.declare(name, "again")
