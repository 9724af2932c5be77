"""Attribution on real Lightning: a known delay injected into each phase shows up in that phase
(within 10%) and in no other.

One traced training carries a delay in all five phases at once, each of a different size, so
a phase's time leaking into another, or two phases swapped, puts one of them outside its own
10% (5-9 ms here; separate runs with idle neighbours allowed up to 20 ms in a neighbour).
One run instead of five: issue 21 (suite time), each run costs a Lightning import. A phase
delayed while every other is idle: the straggler cases in test_distributed.py.
"""

from __future__ import annotations

import pytest

from traceml import schema

from procs import PYTHON, TINY, rank_records, run, steps_of, traced_env

# (the tiny script's knob, the phase it delays, the delay in ms): 10 ms apart, more than any
# phase's 10%, so a swap cannot pass.
DELAYS = [
    ("TINY_FETCH_SLEEP_MS", schema.INPUT_WAIT, 50.0),
    ("TINY_TRANSFER_SLEEP_MS", schema.H2D, 60.0),
    ("TINY_FORWARD_SLEEP_MS", schema.FORWARD, 70.0),
    ("TINY_BACKWARD_SLEEP_MS", schema.BACKWARD, 80.0),
    ("TINY_OPTIMIZER_SLEEP_MS", schema.OPTIMIZER, 90.0),
]
# What the tiny model costs in the residual (loss, Lightning's loop) without any delay, at
# most (ms, 1 CPU thread).
UNDELAYED_MS = 20.0


def tolerance(delay_ms: float) -> float:
    return 0.10 * delay_ms


def median(values):
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


@pytest.fixture(scope="module")
def steady_steps(tmp_path_factory):
    """The steps after warm-up of one training with every phase delayed."""
    tmp_path = tmp_path_factory.mktemp("attribution")
    knobs = {knob: delay for knob, _, delay in DELAYS}
    env = traced_env(tmp_path / "logs", "a", TINY_BATCHES=14, TINY_VALIDATE=0, **knobs)
    result = run([PYTHON, TINY], env, tmp_path)
    assert result.returncode == 0, result.stderr
    steady = steps_of(rank_records(tmp_path / "logs" / "a"))[2:]
    assert len(steady) == 12
    return steady


@pytest.mark.parametrize(("knob", "phase", "delay_ms"), DELAYS, ids=[p for _, p, _ in DELAYS])
def test_an_injected_delay_lands_in_its_phase(steady_steps, knob, phase, delay_ms):
    measured = median(s[phase] for s in steady_steps)
    assert delay_ms - 0.5 <= measured <= delay_ms + tolerance(delay_ms), (phase, measured)


def test_what_no_phase_explains_stays_small(steady_steps):
    assert median(s[schema.RESIDUAL] for s in steady_steps) < UNDELAYED_MS
    # Every step: its phases' delays (less a little) and never a step shorter than their sum.
    floor = sum(delay for _, _, delay in DELAYS) - 2.5
    assert all(s[schema.STEP] >= floor for s in steady_steps)


def test_a_forward_recomputed_inside_backward_is_backward(tmp_path):
    """Activation checkpointing of the traced model: its forward (60 ms) runs once in Forward
    and once more inside backward, where it is Backward's; counted in both, the phases would
    add up to more than the step."""
    env = traced_env(
        tmp_path / "logs",
        "a",
        TINY_BATCHES=8,
        TINY_VALIDATE=0,
        TINY_CHECKPOINT=1,
        TINY_FORWARD_SLEEP_MS=60,
    )
    result = run([PYTHON, TINY], env, tmp_path)
    assert result.returncode == 0, result.stderr
    steady = steps_of(rank_records(tmp_path / "logs" / "a"))[2:]
    assert len(steady) == 6
    assert 59.5 <= median(s[schema.FORWARD] for s in steady) <= 66.0
    assert 59.5 <= median(s[schema.BACKWARD] for s in steady) <= 60.0 + UNDELAYED_MS
    assert median(s[schema.RESIDUAL] for s in steady) < UNDELAYED_MS
    assert "overlapping" not in result.stderr
