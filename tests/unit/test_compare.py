"""traceml compare over summaries made from synthetic records."""

import json
import re
import shutil

import orjson
import pytest

from traceml import schema
from traceml.analysis.compare import CompareOptions, compare, load_summary
from traceml.cli import main
from traceml.compare_command import gate_exit_code
from traceml.finalize import summarise

from rankfiles import footer, header, synthetic_run, write_rank, write_run


def make_summary(path, **kwargs):
    synthetic_run(path, **kwargs)
    summary, _ = summarise(path)
    return path / schema.SUMMARY_JSON, summary


BASE = dict(input=30, forward=30, backward=30, optimizer=5, residual=5)


def test_input_wait_cut_by_30_percent_is_an_improvement(tmp_path):
    a, _ = make_summary(tmp_path / "a", steps=200, seed=1, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=200, seed=2, **{**BASE, "input": 21})
    result = compare(load_summary(a), load_summary(b))
    assert result["verdict"] == "IMPROVEMENT"
    assert result["fields"]["input_wait_ms"]["status"] == "faster"
    assert result["fields"]["input_wait_ms"]["change_pct"] == pytest.approx(-30, abs=3)
    assert result["phases_that_moved"] == ["Input Wait"]
    assert result["fields"]["forward_ms"]["status"] == "no significant change"


def test_same_distribution_with_noise_is_equivalent(tmp_path):
    a, _ = make_summary(tmp_path / "a", steps=300, seed=1, noise=0.1, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=300, seed=2, noise=0.1, **BASE)
    result = compare(load_summary(a), load_summary(b))
    assert result["verdict"] == "EQUIVALENT"
    assert result["step"]["status"] == "no significant change"
    assert gate_exit_code(result, 5.0) == 0


def test_two_percent_inside_noise_is_not_significant(tmp_path):
    # 40 steps with ~10% step-time noise: a 2% change is well inside it. Over 20 independent
    # pairs the method may flag a few by chance (5% is the nominal rate), not most of them.
    slower = {k: v * 1.02 for k, v in BASE.items()}
    flagged = 0
    for pair in range(20):
        a, _ = make_summary(tmp_path / f"a{pair}", steps=40, seed=100 + pair, noise=0.2, **BASE)
        b, _ = make_summary(tmp_path / f"b{pair}", steps=40, seed=200 + pair, noise=0.2, **slower)
        flagged += compare(load_summary(a), load_summary(b))["step"]["significant"]
    assert flagged <= 3


def test_two_percent_on_5000_steady_steps_is_real_only_below_the_noise_floor(tmp_path):
    a, _ = make_summary(tmp_path / "a", steps=5000, seed=1, noise=0.02, **BASE)
    slower = {k: v * 1.02 for k, v in BASE.items()}
    b, _ = make_summary(tmp_path / "b", steps=5000, seed=2, noise=0.02, **slower)
    # One run a side: run-to-run noise is unknown, so +2% is inside the default 5% floor; the
    # interval is inside the 5% margin, so the runs are equivalent within it.
    result = compare(load_summary(a), load_summary(b))
    assert result["step"]["hidden_rule"] == "noise_floor"
    assert result["step"]["significant"] is False
    assert result["verdict"] == "EQUIVALENT"
    assert result["noise"]["run_to_run"] == "unknown"
    # Whoever knows their machine's run-to-run noise is small can lower the floor.
    result = compare(load_summary(a), load_summary(b), CompareOptions(noise_floor_pct=1.0))
    assert result["step"]["significant"] is True
    assert result["verdict"] == "REGRESSION"
    assert result["step"]["change_pct"] == pytest.approx(2.0, abs=0.2)


def test_ten_percent_slowdown_fails_the_gate(tmp_path, capsys):
    a, _ = make_summary(tmp_path / "a", steps=500, seed=1, **BASE)
    slower = {k: v * 1.10 for k, v in BASE.items()}
    b, _ = make_summary(tmp_path / "b", steps=500, seed=2, **slower)
    gate = ["compare", str(a), str(b), "--fail-on-regression", "5"]
    # One run a side and the default floor: a guess about run-to-run noise, so no answer (3).
    assert main(gate) == 3
    out, err = capsys.readouterr()
    assert "Verdict: REGRESSION" in out and "noise floor 5% (assumed)" in out
    assert "cannot tell it from run-to-run noise" in err and "--noise-floor-from" in err
    # A floor the user gave (or measured) lets it answer.
    assert main([*gate, "--noise-floor", "5"]) == 1
    out, err = capsys.readouterr()
    assert "noise floor 5% (--noise-floor)" in out
    assert "regressed +10." in err or "regressed +9." in err
    assert main(["compare", str(a), str(b), "--fail-on-regression", "15"]) == 0
    assert main(["compare", str(a), str(b)]) == 0  # no gate: 0 whenever it ran


def test_three_steps_each_is_inconclusive(tmp_path):
    a, _ = make_summary(tmp_path / "a", steps=3, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=3, **BASE)
    result = compare(load_summary(a), load_summary(b))
    assert result["verdict"] == "INCONCLUSIVE"
    assert any("only 1 analysed job steps" in r for r in result["inconclusive_reasons"])
    assert gate_exit_code(result, 5.0) == 3
    assert main(["compare", str(a), str(b), "--fail-on-regression", "5"]) == 3


def test_faster_but_more_memory_is_mixed(tmp_path):
    a, sa = make_summary(tmp_path / "a", steps=200, seed=1, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=200, seed=2, **{**BASE, "input": 10})
    data = load_summary(b)
    data["overall"]["rss_peak_bytes"] = sa["overall"]["rss_peak_bytes"] * 1.5
    assert compare(load_summary(a), data)["verdict"] == "MIXED"


def test_diagnosis_change_and_setup_differences(tmp_path):
    a, _ = make_summary(tmp_path / "a", steps=100, seed=1, **{**BASE, "input": 90})
    b, _ = make_summary(tmp_path / "b", steps=100, seed=2, **{**BASE, "input": 5})
    data_b = load_summary(b)
    data_b["setup"]["batch_size"] = 4
    data_b["setup"]["num_workers"] = 2
    result = compare(load_summary(a), data_b)
    assert result["diagnosis"]["message"].startswith("INPUT-BOUND -> ")
    assert "the input fix worked" in result["diagnosis"]["message"]
    assert "batch size: 2 -> 4" in result["setup_differences"]
    assert result["changes"] == ["DataLoader workers: 0 -> 2"]
    assert not any("warm-up" in d for d in result["setup_differences"])
    data_b["thresholds"]["warmup_steps"] = 10  # a report made again with another warm-up
    (warmup,) = [d for d in compare(load_summary(a), data_b)["setup_differences"] if "warm" in d]
    assert warmup.startswith("warm-up steps skipped: 2 -> 10"), warmup


def test_different_world_sizes_or_devices_are_inconclusive(tmp_path):
    a, _ = make_summary(tmp_path / "a", steps=50, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=50, ranks=2, **BASE)
    result = compare(load_summary(a), load_summary(b))
    assert result["verdict"] == "INCONCLUSIVE"
    assert "different world sizes (1 vs 2)" in result["inconclusive_reasons"]
    data = load_summary(a)
    data["setup"]["device"] = "cuda"
    result = compare(load_summary(a), data)
    assert any("different devices" in r for r in result["inconclusive_reasons"])


def test_output_files_and_parent_dirs(tmp_path, capsys):
    a, _ = make_summary(tmp_path / "a", steps=50, seed=1, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=50, seed=2, **BASE)
    out = tmp_path / "comparisons" / "deep" / "a_vs_b"
    assert main(["compare", str(a), str(b), "--output", str(out)]) == 0
    text = (out.parent / "a_vs_b.txt").read_text()
    data = json.loads((out.parent / "a_vs_b.json").read_text())
    assert data["schema"] == schema.COMPARISON_SCHEMA
    assert text == capsys.readouterr().out
    for label in ("Input Wait", "H2D", "Forward", "Backward", "Optimizer", "Residual", "Step"):
        assert label in text
    assert all(len(line) <= 100 for line in text.splitlines() if not line.startswith("Method"))
    # A second run says it overwrites.
    assert main(["compare", str(a), str(b), "--output", str(out)]) == 0
    assert "overwriting" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        (b"{not json", "is not JSON"),
        (b'{"hello": 1}', "is not a traceml summary"),
        (b'{"schema": "traceml.summary/2.0", "overall": {}}', "newer than this traceml reads"),
        (b"[1, 2]", "is not a traceml summary"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    good, _ = make_summary(tmp_path / "a", steps=20, **BASE)
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_bytes(content)
    assert main(["compare", str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1


def test_older_compatible_schema_is_read(tmp_path, monkeypatch):
    path, _ = make_summary(tmp_path / "a", steps=20, **BASE)
    written = schema.SUMMARY_SCHEMA
    monkeypatch.setattr(schema, "SUMMARY_SCHEMA", "traceml.summary/1.4")
    assert load_summary(path)["schema"] == written


def test_a_run_directory_is_accepted_for_its_summary(tmp_path):
    path, _ = make_summary(tmp_path / "a", steps=20, **BASE)
    assert load_summary(path.parent)["run"] == orjson.loads(path.read_bytes())["run"]


# ----------------------------------------------------------------------------------------------
# Issue 17: the failures a new user met, as tests


def busy_run(path, seed, steps=40):
    """Steps that vary up to ~20x (a busy machine): mostly ~400 ms, now and then seconds."""
    import random

    rng = random.Random(seed)
    phases = []
    for _ in range(steps):
        slow = rng.random() < 0.25
        forward = 200.0 * (rng.uniform(4.0, 20.0) if slow else rng.uniform(0.8, 1.2))
        phases.append({"forward": forward, "backward": 180.0, "h2d": 20.0 * rng.uniform(0.5, 3)})
    write_run(path, [phases])
    summary, _ = summarise(path)
    return path / schema.SUMMARY_JSON, summary


def test_busy_machine_pair_is_inconclusive_not_equivalent(tmp_path, capsys):
    a, _ = busy_run(tmp_path / "a", seed=1)
    b, _ = busy_run(tmp_path / "b", seed=2)
    result = compare(load_summary(a), load_summary(b))
    assert result["verdict"] == "INCONCLUSIVE"
    reason = result["inconclusive_reasons"][0]
    assert reason.startswith("runs too noisy: step-time CV ")
    assert result["inconclusive_reasons"][-1].startswith("run-to-run noise is unknown")
    for entry in result["fields"].values():
        interval = entry.get("ci_change_pct")
        if interval:
            assert interval[0] > -100.0  # a ratio interval: a time cannot fall by >100%
    assert main(["compare", str(a), str(b), "--fail-on-regression", "5"]) == 3
    out = capsys.readouterr().out
    assert "Verdict: INCONCLUSIVE" in out and "runs too noisy" in out


@pytest.mark.parametrize(("ranks", "pairs"), [(8, 12), (32, 6)])
def test_same_distribution_at_many_ranks_is_not_a_change(tmp_path, ranks, pairs):
    # The A/A case: 60 steps, 20% independent noise per rank. Pooling every rank's steps
    # flagged 15/40 pairs at 8 ranks and 26/40 at 32. With the noise floor off, only the
    # interval decides, and it must not exclude zero much more often than 5%.
    options = CompareOptions(noise_floor_pct=0.0)
    flagged = 0
    for pair in range(pairs):
        a, _ = make_summary(
            tmp_path / f"a{pair}", steps=60, ranks=ranks, seed=pair, noise=0.2, **BASE
        )
        b, _ = make_summary(
            tmp_path / f"b{pair}", steps=60, ranks=ranks, seed=500 + pair, noise=0.2, **BASE
        )
        result = compare(load_summary(a), load_summary(b), options)
        flagged += result["step"]["significant"]
        assert gate_exit_code(compare(load_summary(a), load_summary(b)), 5.0) != 1
    assert flagged <= 1


def two_level_run(path, seed, first, second, steps=2000):
    """One rank whose steps take ``first`` ms in the first half of the run and ``second`` ms
    in the second (the machine got slower half way: another job, a thermal limit), 3% noise."""
    import random

    rng = random.Random(seed)
    phases = [
        {"forward": (first if index < steps // 2 else second) * (1 + 0.03 * rng.gauss(0, 1))}
        for index in range(steps)
    ]
    write_run(path, [phases])
    summarise(path)
    return path / schema.SUMMARY_JSON


def test_a_change_smaller_than_the_runs_own_drift_is_not_called(tmp_path):
    # Identical code; each run slows by 20% half way; B's run happened to be 10% slower.
    # The interval alone (tight: 2000 steps) would call +10% a regression.
    a = two_level_run(tmp_path / "a", 1, first=400.0, second=480.0)
    b = two_level_run(tmp_path / "b", 2, first=440.0, second=528.0)
    result = compare(load_summary(a), load_summary(b))
    step = result["step"]
    assert step["change_pct"] == pytest.approx(10.0, abs=1.0)
    assert step["ci_change_pct"][0] > 0  # the interval excludes zero...
    assert step["hidden_rule"] == "drift"  # ...but the runs drift by 20% within themselves
    assert result["verdict"] == "INCONCLUSIVE"
    first, second = result["inconclusive_reasons"]
    assert first.startswith("step time +") and "within the runs' own drift (20." in first
    assert second == "run-to-run noise is unknown with one run a side: compare 3 runs a side"
    assert gate_exit_code(result, 5.0) == 3
    # Without the drift, the same +10% is called.
    steady_a = two_level_run(tmp_path / "c", 3, first=440.0, second=440.0)
    steady_b = two_level_run(tmp_path / "d", 4, first=484.0, second=484.0)
    assert compare(load_summary(steady_a), load_summary(steady_b))["verdict"] == "REGRESSION"


def shifted_runs(tmp_path, name, factors, seed):
    paths = []
    for index, factor in enumerate(factors):
        means = {key: value * factor for key, value in BASE.items()}
        path, _ = make_summary(
            tmp_path / f"{name}{index}", steps=60, seed=seed + index, noise=0.1, **means
        )
        paths.append(str(path))
    return paths


def test_three_runs_a_side_catch_30_percent_on_a_machine_whose_runs_differ_by_30(tmp_path, capsys):
    # Identical code, runs up to ~30% apart; B is 30% slower than A.
    side_a = shifted_runs(tmp_path, "a", [0.87, 1.0, 1.13], seed=10)
    side_b = shifted_runs(tmp_path, "b", [1.3 * 1.1, 1.3 * 0.9, 1.3 * 1.02], seed=20)
    code = main(["compare", *side_a, "--vs", *side_b, "--fail-on-regression", "5"])
    out, err = capsys.readouterr()
    assert code == 1, out
    assert "Verdict: REGRESSION" in out
    assert "Run-to-run noise: 3 + 3 runs" in out
    assert "between-run spread of 3 + 3 runs" in out.replace("\n  ", " ")
    assert "regressed +" in err
    # The same single runs (A's middle run vs B's first) would be called at +43%: fine, but
    # the interval from one run a side is far narrower than the truth.
    narrow = compare(load_summary(side_a[1]), load_summary(side_b[0]))["step"]
    wide = compare([load_summary(p) for p in side_a], [load_summary(p) for p in side_b])["step"]
    width = narrow["ci_change_pct"][1] - narrow["ci_change_pct"][0]
    assert wide["ci_change_pct"][1] - wide["ci_change_pct"][0] > 3 * width


def test_two_identical_runs_a_side_pass_or_say_inconclusive(tmp_path, capsys):
    side_a = shifted_runs(tmp_path, "a", [1.0, 1.1], seed=30)
    side_b = shifted_runs(tmp_path, "b", [0.95, 1.08], seed=40)
    code = main(["compare", *side_a, "--vs", *side_b, "--fail-on-regression", "5"])
    out = capsys.readouterr().out
    assert code in (0, 3)
    assert "REGRESSION" not in out


def test_compare_command_line_errors_are_one_line(tmp_path, capsys):
    a, _ = make_summary(tmp_path / "a", steps=20, **BASE)
    assert main(["compare", str(a), str(a), str(a)]) == 2
    err = capsys.readouterr().err
    assert "no --vs" in err and err.count("\n") == 1
    assert main(["compare", str(a), str(a), "--noise-floor", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--noise-floor -1" in err and err.count("\n") == 1
    assert main(["compare", str(a), "--vs", str(a), str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_setup_change_can_be_accepted(tmp_path):
    a, _ = make_summary(tmp_path / "a", steps=100, seed=1, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=100, ranks=2, seed=2, **BASE)
    blocked = compare(load_summary(a), load_summary(b))
    assert blocked["verdict"] == "INCONCLUSIVE"
    assert "world size, device or timing-method changes: INCONCLUSIVE" in blocked["rules"]
    accepted = compare(load_summary(a), load_summary(b), CompareOptions(allow_setup_change=True))
    assert accepted["verdict"] == "EQUIVALENT"
    assert accepted["notes"] == ["setup change accepted (--allow-setup-change): different "
                                 "world sizes (1 vs 2)"]  # fmt: skip


def test_runs_of_one_side_must_share_world_size(tmp_path):
    one, _ = make_summary(tmp_path / "one", steps=50, seed=1, **BASE)
    two, _ = make_summary(tmp_path / "two", steps=50, ranks=2, seed=2, **BASE)
    result = compare([load_summary(one), load_summary(two)], [load_summary(one)] * 2)
    assert "the A runs differ in world sizes (1, 2)" in result["inconclusive_reasons"]


def test_every_hiding_rule_is_on_the_method_line(tmp_path, capsys):
    a, _ = make_summary(tmp_path / "a", steps=200, seed=1, **{**BASE, "h2d": 0.5})
    b, _ = make_summary(tmp_path / "b", steps=200, seed=2, **{**BASE, "h2d": 1.0})
    result = compare(load_summary(a), load_summary(b))
    # H2D doubled, but it is under 2% of the step: shown, not called.
    assert result["fields"]["h2d_ms"]["hidden_rule"] == "material"
    assert result["phases_that_moved"] == []
    main(["compare", str(a), str(b)])
    method = capsys.readouterr().out.split("Method: ")[1].replace("\n  ", " ")
    for rule in (
        "one sample per job step",
        "5% noise floor",
        "first-vs-second-half drift",
        "changes under 1% and phases under 2% of the step are never called",
        "EQUIVALENT only when the whole CI is within +-5%",
        "world size, device or timing-method changes: INCONCLUSIVE",
    ):
        assert rule in method


def test_older_summary_without_a_job_series_still_compares_with_a_note(tmp_path):
    a, _ = make_summary(tmp_path / "a", steps=200, ranks=4, seed=1, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=200, ranks=4, seed=2, **{**BASE, "input": 21})
    old = load_summary(a)
    del old[schema.SUMMARY_JOB_SERIES]
    old[schema.SCHEMA] = "traceml.summary/1.0"
    result = compare(old, load_summary(b))
    assert result["verdict"] == "IMPROVEMENT"
    assert result["step"]["approximate"] is True
    assert result["a"]["job_steps"] == 198  # 4 ranks x 198 pooled steps count as 198
    (note,) = result["notes"]
    assert "intervals are approximate" in note


def test_a_current_summary_of_a_run_with_no_steps_is_not_called_older(tmp_path):
    # Its job series is null, not absent: the run recorded no steps.
    a, _ = make_summary(tmp_path / "a", steps=50, seed=1, **BASE)
    write_rank(tmp_path / "empty", 0, [header(), footer(0)])
    summary, _ = summarise(tmp_path / "empty")
    assert schema.SUMMARY_JOB_SERIES in summary and summary[schema.SUMMARY_JOB_SERIES] is None
    empty = load_summary(tmp_path / "empty" / schema.SUMMARY_JSON)
    notes = compare(load_summary(a), empty)["notes"]
    assert not any("older summary" in note for note in notes)
    assert any("no job step series" in n and "the run recorded no steps" in n for n in notes)


def test_comm_wait_is_a_row_only_when_both_runs_have_it(tmp_path):
    with_comm = {**BASE, "comm_backward": 10.0}
    a, _ = make_summary(tmp_path / "a", steps=100, ranks=2, seed=1, **with_comm)
    b, _ = make_summary(
        tmp_path / "b", steps=100, ranks=2, seed=2, **{**with_comm, "comm_backward": 20.0}
    )
    plain, _ = make_summary(tmp_path / "c", steps=100, ranks=2, seed=3, **BASE)
    result = compare(load_summary(a), load_summary(b))
    assert result["fields"]["comm_ms"]["label"] == "Comm wait"
    assert result["fields"]["comm_ms"]["change_pct"] == pytest.approx(100.0, abs=5)
    assert "comm_ms" not in compare(load_summary(a), load_summary(plain))["fields"]


@pytest.mark.parametrize("limit", ["nan", "-5", "inf"])
def test_a_regression_limit_that_is_no_percentage_is_refused(tmp_path, capsys, limit):
    # NaN compared false with every change: the gate passed a 46% regression with exit 0.
    a, _ = make_summary(tmp_path / "a", steps=20, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=20, seed=2, **BASE)
    assert main(["compare", str(a), str(b), "--fail-on-regression", limit]) == 2
    err = capsys.readouterr().err
    assert f"--fail-on-regression {float(limit):g}" in err and err.count("\n") == 1


def test_one_run_given_twice_is_refused_not_counted_as_two(tmp_path, capsys):
    # Three copies of one run read as "3 runs, spread 0%": a noise floor measured from nothing.
    a, _ = make_summary(tmp_path / "a", steps=40, seed=1, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=40, seed=2, **BASE)
    copy = tmp_path / "copy.json"
    copy.write_bytes(a.read_bytes())
    for argv in (
        ["compare", str(a), str(copy), "--vs", str(b), str(b)],
        ["compare", "--noise-floor-from", str(a), str(a), str(b)],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "is the same run as" in err and err.count("\n") == 1


def test_a_summary_with_a_field_of_the_wrong_type_is_one_line_not_a_traceback(tmp_path, capsys):
    a, summary = make_summary(tmp_path / "a", steps=40, seed=1, **BASE)
    bad = tmp_path / "bad.json"
    summary[schema.SUMMARY_OVERALL]["phases"] = "hand-edited"
    summary[schema.SUMMARY_SETUP] = "hand-edited"
    bad.write_bytes(orjson.dumps(summary))
    assert main(["compare", str(a), str(bad)]) == 2
    err = capsys.readouterr().err
    assert "cannot compare these summaries" in err and err.count("\n") == 1


def test_output_as_a_directory_or_empty(tmp_path, capsys, monkeypatch):
    a, _ = make_summary(tmp_path / "a", steps=40, seed=1, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=40, seed=2, **BASE)
    out = tmp_path / "out"
    out.mkdir()
    assert main(["compare", str(a), str(b), "--output", str(out)]) == 0
    assert (out / "comparison.json").is_file() and (out / "comparison.txt").is_file()
    monkeypatch.chdir(out)
    assert main(["compare", str(a), str(b), "--output", "."]) == 0  # was a ValueError traceback
    assert main(["compare", str(a), str(b), "--output", ""]) == 2
    assert "--output needs a path" in capsys.readouterr().err


def test_output_that_is_an_input_is_refused(tmp_path, capsys):
    # --output A/final_summary.json replaced summary A with the comparison.
    a, _ = make_summary(tmp_path / "a", steps=40, seed=1, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=40, seed=2, **BASE)
    before = a.read_bytes(), b.read_bytes()
    (tmp_path / "link").symlink_to(tmp_path / "b")
    via_b = tmp_path / "b" / ".." / "a" / "final_summary.json"
    for output in (a, a.with_suffix(""), tmp_path / "link" / "final_summary", via_b):
        assert main(["compare", str(tmp_path / "a"), str(b), "--output", str(output)]) == 2, output
        err = capsys.readouterr().err
        assert "would overwrite" in err and "one of the summaries compared" in err, output
        assert err.count("\n") == 1
    assert (a.read_bytes(), b.read_bytes()) == before
    # An output beside the inputs is fine.
    assert main(["compare", str(a), str(b), "--output", str(tmp_path / "a" / "vs_b")]) == 0


def test_a_run_that_did_not_complete_is_named_in_the_comparison(tmp_path, capsys):
    a, _ = make_summary(tmp_path / "a", steps=40, seed=1, **BASE)
    b, summary = make_summary(tmp_path / "b", steps=40, seed=2, **BASE)
    summary[schema.SUMMARY_STATUS] = schema.RUN_FAILED
    b.write_bytes(orjson.dumps(summary))
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out.replace("\n  ", " ")
    assert "not a completed run" in out and "(failed)" in out


def test_several_runs_a_side_show_means_that_agree_with_the_change(tmp_path, capsys):
    # The review's repro: A's runs 50, 50, 110 ms of forward, B's 68-69. The arithmetic mean
    # of A (70) is above B's, the change (a ratio of geometric means) is +5%: the table showed
    # a negative delta next to a positive change. The figures shown are what the change is of.
    side_a = [
        str(make_summary(tmp_path / f"a{i}", steps=40, seed=10 + i, noise=0.01, forward=f,
                         backward=50)[0])
        for i, f in enumerate([50, 50, 110])
    ]  # fmt: skip
    side_b = [
        str(make_summary(tmp_path / f"b{i}", steps=40, seed=20 + i, noise=0.01, forward=f,
                         backward=50)[0])
        for i, f in enumerate([68, 68.5, 69])
    ]  # fmt: skip
    result = compare([load_summary(p) for p in side_a], [load_summary(p) for p in side_b])
    for entry in result["fields"].values():
        if entry.get("change_pct") is None:
            continue
        ratio = entry["b_mean_ms"] / entry["a_mean_ms"]
        assert entry["change_pct"] == pytest.approx((ratio - 1) * 100, rel=1e-9), entry["label"]
        assert (entry["delta_ms"] > 0) == (entry["change_pct"] > 0), entry["label"]
    assert result["fields"]["forward_ms"]["delta_ms"] > 0
    assert main(["compare", *side_a, "--vs", *side_b]) == 0
    assert "Geometric mean of the runs' means per job step (ms)" in capsys.readouterr().out


def test_a_phase_that_drops_to_zero_is_minus_100_percent(tmp_path, capsys):
    a, _ = make_summary(tmp_path / "a", steps=60, seed=1, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=60, seed=2, **{**BASE, "input": 0})
    dropped = compare(load_summary(a), load_summary(b))["fields"]["input_wait_ms"]
    assert dropped["b_mean_ms"] == 0 and dropped["a_mean_ms"] > 0
    assert dropped["change_pct"] == -100.0
    assert dropped["ci_change_pct"] is None and dropped["hidden_by"] == "zero mean in B"
    # From zero there is no ratio: the change stays unknown.
    appeared = compare(load_summary(b), load_summary(a))["fields"]["input_wait_ms"]
    assert appeared["change_pct"] is None and appeared["hidden_by"] == "zero mean in A"
    assert main(["compare", str(a), str(b)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "Input Wait" in line)
    assert "-100.0%" in row and "hidden: zero mean in B" in row


def test_missing_setup_values_are_words_not_none(tmp_path, capsys):
    a, summary_a = make_summary(tmp_path / "a", steps=40, seed=1, **BASE)
    b, summary_b = make_summary(tmp_path / "b", steps=40, seed=2, **BASE)
    del summary_a[schema.RUN]
    summary_a[schema.WORLD_SIZE] = None
    summary_a[schema.SUMMARY_SETUP][schema.WORLD_SIZE] = None
    summary_b[schema.SUMMARY_SETUP]["trace_max_steps"] = 200
    a.write_bytes(orjson.dumps(summary_a))
    b.write_bytes(orjson.dumps(summary_b))
    main(["compare", str(a), str(b)])
    out = capsys.readouterr().out
    assert "None" not in out
    assert "A = run name unknown" in out
    assert "world size: unknown -> 1" in out
    assert "trace-max-steps: not set -> 200" in out
    assert "different world sizes (unknown vs 1)" in out


def test_a_run_reported_again_from_a_copy_is_still_the_same_run(tmp_path, capsys):
    # A review: the copy's summary differs in run_dir and generated_at only, and three
    # "identical runs" made a noise floor of one run (review, stop 59).
    a, _ = make_summary(tmp_path / "a", steps=40, seed=1, **BASE)
    shutil.copytree(tmp_path / "a", tmp_path / "a2")
    summarise(tmp_path / "a2")
    saved = tmp_path / "saved.json"
    saved.write_bytes(a.read_bytes())
    summarise(tmp_path / "a")  # generated again: a new time stamp
    assert main(["compare", "--noise-floor-from", str(saved), str(a), str(tmp_path / "a2")]) == 2
    err = capsys.readouterr().err
    assert "is the same run as" in err and err.count("\n") == 1


def test_a_world_size_of_the_wrong_type_is_refused(tmp_path, capsys):
    # "world_size": "1" gave "different world sizes (1 vs 1)" and "Setup differences: none".
    a, summary = make_summary(tmp_path / "a", steps=40, seed=1, **BASE)
    bad = tmp_path / "bad.json"
    bad.write_bytes(orjson.dumps({**summary, schema.WORLD_SIZE: "1"}))
    assert main(["compare", str(bad), str(a)]) == 2
    err = capsys.readouterr().err
    assert 'world_size is "1", not a whole number' in err and err.count("\n") == 1


def test_an_output_that_cannot_be_written_leaves_neither_file(tmp_path, capsys):
    # The .json was written, then the .txt (a directory) failed: half an output left.
    a, _ = make_summary(tmp_path / "a", steps=40, seed=1, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=40, seed=2, **BASE)
    (tmp_path / "out.txt").mkdir()
    assert main(["compare", str(a), str(b), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "out.txt is a directory" in err and err.count("\n") == 1
    assert not (tmp_path / "out.json").exists()


def test_a_noise_floor_set_of_mixed_setups_is_named_without_sides(tmp_path, capsys):
    runs = [
        make_summary(tmp_path / n, steps=40, seed=s, **BASE)[0] for n, s in (("a", 1), ("b", 2))
    ]
    wide, summary = make_summary(tmp_path / "c", steps=40, seed=3, **BASE)
    summary[schema.WORLD_SIZE] = 2
    wide.write_bytes(orjson.dumps(summary))
    assert main(["compare", "--noise-floor-from", *map(str, runs), str(wide)]) == 2
    err = capsys.readouterr().err
    assert "the runs differ in world sizes (1, 1, 2)" in err, err
    assert "the B runs" not in err


def test_a_summary_from_a_pipe_is_read_and_a_device_is_named(tmp_path, capsys):
    # `compare <(cat a.json) b` and /dev/stdin said "no such file" (review, stop 59).
    import os
    import threading

    a, _ = make_summary(tmp_path / "a", steps=40, seed=1, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=40, seed=2, **BASE)
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    writer = threading.Thread(target=lambda: pipe.write_bytes(a.read_bytes()))
    writer.start()
    assert main(["compare", str(pipe), str(b)]) == 0
    writer.join()
    capsys.readouterr()
    assert main(["compare", os.devnull, str(b)]) == 2
    assert capsys.readouterr().err == f"traceml: error: {os.devnull} is not a regular file\n"


def test_an_output_over_an_input_whose_name_is_not_utf8_is_refused(tmp_path, capsys):
    # The input's path, kept as text with \\xNN escapes, named no file: the guard passed and
    # the comparison replaced the run's own final_summary.json (review of this stop's fix).
    import os

    run_dir = tmp_path / os.fsdecode(b"run\xff")
    a, _ = make_summary(run_dir, steps=40, seed=1, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=40, seed=2, **BASE)
    before = a.read_bytes()
    assert main(["compare", str(run_dir), str(b), "--output", str(run_dir / "final_summary")]) == 2
    err = capsys.readouterr().err
    assert "would overwrite" in err and "run\\xff" in err and err.count("\n") == 1
    assert a.read_bytes() == before


def test_a_run_compared_with_itself_names_its_own_cost_once(tmp_path):
    a, _ = make_summary(tmp_path / "a", steps=50, **BASE)
    data = load_summary(a)
    step_ms = data["overall"]["phases"]["step_ms"]["mean"]
    data["overall"]["phases"]["traceml_us"] = {"mean": step_ms * 1000 * 0.05}  # 5% of a step
    notes = compare(data, data)["notes"]
    assert len([n for n in notes if n.startswith("traceml's own cost")]) == 1, notes


def test_setup_differences_a_loops_counted_accumulation_and_within_a_side(tmp_path):
    # A hand-written loop's setup cannot say its accumulation (null on both sides): a change
    # of it read "Setup differences: none" and the gate failed the PR on it; with several runs
    # a side, only the first A run and the first B run were compared (helper review).
    runs = [make_summary(tmp_path / name, steps=40, seed=i, **BASE)[1] for i, name in
            enumerate(("a1", "a2", "b1", "b2"))]  # fmt: skip
    for run in runs:  # as a hand-written loop's
        run[schema.SUMMARY_SETUP].update(
            {schema.ACCUMULATE_GRAD_BATCHES: None, schema.BATCH_SIZE: None}
        )
    a1, a2, b1, b2 = runs
    b1[schema.SUMMARY_OVERALL][schema.PHASE_STATS][schema.MICROBATCHES]["mean"] = 2.0
    assert compare(a1, b1)["setup_differences"] == ["microbatches per step (counted): 1.0 -> 2.0"]
    b1[schema.SUMMARY_OVERALL][schema.PHASE_STATS][schema.MICROBATCHES]["mean"] = 1.0
    a2[schema.SUMMARY_SETUP][schema.BATCH_SIZE] = 32
    b2[schema.SUMMARY_SETUP][schema.ACCUMULATE_GRAD_BATCHES] = 2
    assert compare([a1, a2], [b1, b2])["setup_differences"] == [
        "within A: batch size: not set -> 32",
        "within B: gradient accumulation: not set -> 2",
    ]


def test_a_run_reported_again_with_another_warm_up_is_still_the_same_run(tmp_path, capsys):
    # Another warm-up skipped moves every statistic of the summary: the copy passed the
    # duplicate check, and made a noise floor of one run twice (helper review).
    a, _ = make_summary(tmp_path / "a", steps=40, seed=1, **BASE)
    b, _ = make_summary(tmp_path / "b", steps=40, seed=2, **BASE)
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    assert main(["report", str(tmp_path / "copy"), "--threshold", "warmup_steps=5"]) == 0
    capsys.readouterr()
    copy = tmp_path / "copy" / schema.SUMMARY_JSON
    assert main(["compare", "--noise-floor-from", str(a), str(copy), str(b)]) == 2
    err = capsys.readouterr().err
    assert "is the same run as" in err and err.count("\n") == 1
    assert main(["compare", str(a), str(copy)]) == 0
    assert "the same run on both sides" in capsys.readouterr().out


def test_a_measured_noise_floor_is_printed_rounded(tmp_path):
    # "within the 11.9148% noise floor" under a header that said 11.9% (helper review).
    _, a = make_summary(tmp_path / "a", steps=40, seed=1, **BASE)
    _, b = make_summary(tmp_path / "b", steps=40, seed=2, **BASE)
    result = compare(a, b, CompareOptions(noise_floor_pct=11.9148))
    assert result["noise"]["noise_floor_pct"] == 11.9148  # the figure itself, unrounded
    words = [t for t in re.findall(r'"([^"]*noise floor[^"]*)"', json.dumps(result))]
    assert words and all("11.9148" not in t for t in words), words
    assert any("11.9% noise floor" in t for t in words)
