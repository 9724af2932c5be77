"""The one-run-a-side gate and its measured noise floor (issue 25)."""

import math

import pytest

from traceml.analysis.compare import load_summary
from traceml.analysis.compare_load import CompareInputError
from traceml.analysis.compare_noise import measure_noise_floor
from traceml.analysis.stats import t_quantile
from traceml.cli import main
from traceml.finalize import summarise

from rankfiles import synthetic_run

BASE = dict(input=30, forward=30, backward=30, optimizer=5, residual=5)


def run(path, scale=1.0, seed=0, steps=200):
    synthetic_run(path, steps=steps, seed=seed, **{k: v * scale for k, v in BASE.items()})
    summarise(path)
    return path


def test_floor_is_the_prediction_bound_of_two_identical_runs(tmp_path):
    # Three runs whose means differ by a few %, as whole runs on a busy machine do.
    runs = [run(tmp_path / f"r{i}", scale=s, seed=i) for i, s in enumerate((1.0, 1.03, 0.98))]
    summaries = [load_summary(p) for p in runs]
    floor = measure_noise_floor(summaries)
    logs = [math.log(s["job_series"]["fields"]["step_ms"]["mean"]) for s in summaries]
    mean = sum(logs) / 3
    spread = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    expected = (math.exp(t_quantile(0.95, 2) * math.sqrt(2) * spread) - 1) * 100
    assert floor.pct == pytest.approx(expected, rel=1e-9)
    assert floor.runs == 3 and floor.df == 2
    assert 5.0 < floor.pct < 30.0  # a 2.5% spread on 2 df is a wide floor, honestly


def test_noise_floor_from_alone_prints_it_and_with_a_b_uses_it(tmp_path, capsys):
    same = [str(run(tmp_path / f"r{i}", scale=s, seed=i)) for i, s in enumerate((1.0, 1.01, 0.99))]
    assert main(["compare", "--noise-floor-from", *same]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Noise floor: ") and "from 3 identical runs" in out
    assert "traceml compare A B --noise-floor " in out
    slower = str(run(tmp_path / "slow", scale=1.3, seed=9))
    gate = ["compare", same[0], slower, "--fail-on-regression", "5"]
    assert main(gate) == 3  # the assumed floor: no answer
    capsys.readouterr()
    assert main([*gate, "--noise-floor-from", *same]) == 1  # a measured floor: an answer
    out = capsys.readouterr().out
    assert "(measured, 3 runs)" in out


def test_identical_runs_one_a_side_never_exit_1_without_a_floor(tmp_path, capsys):
    # Whole runs 4% apart (the fast first run): the assumed floor never fails the gate.
    a = str(run(tmp_path / "a", scale=1.0, seed=1))
    b = str(run(tmp_path / "b", scale=1.08, seed=2))
    assert main(["compare", a, b, "--fail-on-regression", "5"]) == 3
    out = capsys.readouterr().out
    assert "caution: one run a side with a default noise floor" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--noise-floor-from", "ONE"], "needs at least 2 runs"),
        (["A", "B", "--noise-floor", "3", "--noise-floor-from", "A", "B"], "not both"),
    ],
)
def test_noise_floor_usage_errors(tmp_path, capsys, extra, message):
    path = str(run(tmp_path / "r", seed=1))
    argv = ["compare", *[path if x in ("ONE", "A", "B") else x for x in extra]]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_floor_needs_runs_of_one_setup(tmp_path):
    one = load_summary(run(tmp_path / "one", seed=1))
    two = load_summary(run(tmp_path / "two", seed=2))
    two["world_size"] = 2
    with pytest.raises(CompareInputError, match="same setup"):
        measure_noise_floor([one, two])


def test_runs_too_different_for_a_floor_say_so_and_suggest_no_command(tmp_path, capsys):
    # Runs 2x and 4x apart give a "floor" of ~1,650%: --noise-floor refuses it (a percentage in
    # [0, 100)), so suggesting it would be a command that fails.
    apart = [str(run(tmp_path / f"r{i}", scale=s, seed=i)) for i, s in enumerate((1.0, 2.0, 4.0))]
    assert main(["compare", "--noise-floor-from", *apart]) == 2
    out, err = capsys.readouterr()
    assert "--noise-floor " not in out
    assert "too different to measure a noise floor" in err and err.count("\n") == 1
    with pytest.raises(CompareInputError, match="too different"):
        measure_noise_floor([load_summary(p) for p in apart])
