"""Attribution on real Lightning: a known delay injected into one phase shows up in that phase
(within 10% or 5 ms, whichever is larger) and not in the others. Input Wait and Forward are
in test_lightning_capture.py; these are Optimizer, H2D and Backward."""

from __future__ import annotations

import pytest

from traceml import schema

from procs import PYTHON, TINY, rank_records, run, steps_of, traced_env

DELAY_MS = 40.0
TOLERANCE_MS = max(0.10 * DELAY_MS, 5.0)
# What the tiny model costs per phase without any delay, at most (ms, 1 CPU thread).
UNDELAYED_MS = 20.0


def median(values):
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


@pytest.mark.parametrize(
    ("knob", "phase"),
    [
        ("TINY_OPTIMIZER_SLEEP_MS", schema.OPTIMIZER),
        ("TINY_TRANSFER_SLEEP_MS", schema.H2D),
        ("TINY_BACKWARD_SLEEP_MS", schema.BACKWARD),
    ],
)
def test_an_injected_delay_lands_in_its_phase(tmp_path, knob, phase):
    env = traced_env(
        tmp_path / "logs",
        "a",
        TINY_BATCHES=14,
        TINY_VALIDATE=0,
        **{knob: DELAY_MS},
    )
    result = run([PYTHON, TINY], env, tmp_path)
    assert result.returncode == 0, result.stderr
    steady = steps_of(rank_records(tmp_path / "logs" / "a"))[2:]
    assert len(steady) == 12
    measured = median(s[phase] for s in steady)
    assert DELAY_MS - 0.5 <= measured <= DELAY_MS + TOLERANCE_MS, (phase, measured)
    for other in schema.PHASES:
        if other != phase:
            assert median(s[other] for s in steady) < UNDELAYED_MS, (other, phase)
