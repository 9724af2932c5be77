"""traceml compare over summaries made from synthetic records."""

import json

import orjson
import pytest

from traceml import schema
from traceml.cli import main
from traceml.compare import CompareOptions, compare, gate_exit_code, load_summary
from traceml.finalize import summarise

from rankfiles import synthetic_run


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
    assert main(["compare", str(a), str(b), "--fail-on-regression", "5"]) == 1
    out, err = capsys.readouterr()
    assert "Verdict: REGRESSION" in out
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
