"""The states of one traced training, and the only moves between them.

    IDLE ──setup(fit)──> READY ──on_train_start──> TRACING ──end / max steps──> DONE
      │                    │                          │
      │                    └─ a tuner's fit ─> IDLE   └─ any failure ─> DISABLED
      └─ unsupported setup, unwritable rank file ─> UNSUPPORTED / DISABLED

DONE, DISABLED and UNSUPPORTED are final: nothing is recorded after them (DONE may still turn
DISABLED if writing the last records fails). A move the table does not allow is a traceml bug;
it raises, and the entry-point guard turns tracing off with one warning.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    IDLE = "idle"  # attached, nothing decided yet
    READY = "ready"  # rank file open, waiting for the training loop to start
    TRACING = "tracing"  # timing steps
    DONE = "done"  # finished recording (training ended, or trace_max_steps reached)
    DISABLED = "disabled"  # traceml turned itself off after a failure of its own
    UNSUPPORTED = "unsupported"  # a setup traceml would mis-measure: training runs natively


# The members as module constants: ``State.TRACING`` is an attribute lookup through the enum's
# metaclass (~0.2 us on Python 3.11), and the boundaries test the state ~20 times per step.
IDLE, READY, TRACING = State.IDLE, State.READY, State.TRACING
DONE, DISABLED, UNSUPPORTED = State.DONE, State.DISABLED, State.UNSUPPORTED

ALLOWED: dict[State, frozenset[State]] = {
    State.IDLE: frozenset({State.READY, State.UNSUPPORTED, State.DISABLED}),
    State.READY: frozenset({State.TRACING, State.IDLE, State.UNSUPPORTED, State.DISABLED}),
    State.TRACING: frozenset({State.DONE, State.DISABLED}),
    State.DONE: frozenset({State.DISABLED}),
    State.DISABLED: frozenset(),
    State.UNSUPPORTED: frozenset({State.DISABLED}),
}

FINAL = frozenset({State.DONE, State.DISABLED, State.UNSUPPORTED})


class LifecycleError(RuntimeError):
    """A move the table does not allow (a traceml bug, caught by the entry-point guard)."""


class Lifecycle:
    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = State.IDLE

    def move(self, new: State) -> None:
        if new is self.state:
            return
        if new not in ALLOWED[self.state]:
            raise LifecycleError(f"cannot go from {self.state.value} to {new.value}")
        self.state = new

    @property
    def tracing(self) -> bool:
        return self.state is State.TRACING

    @property
    def final(self) -> bool:
        return self.state in FINAL
