"""Words that are true (issue 25): the report's step counts per rank, the memory imbalance line
only when there is imbalance, compare's diagnosis line when a run has too few steps, and
compare on a directory that holds no summary."""

from __future__ import annotations

from pathlib import Path

from traceml import schema
from traceml.analysis.compare import compare, load_summary
from traceml.analysis.diagnose import diagnose
from traceml.analysis.reduce import reduce_run
from traceml.cli import main
from traceml.finalize import summarise
from traceml.present.compare_text import render_comparison
from traceml.present.report import render_text

from rankfiles import footer, header, step, synthetic_run, write_rank

GIB = 2**30


def test_two_rank_header_counts_steps_per_rank(tmp_path):
    synthetic_run(tmp_path / "two", steps=24, ranks=2)
    _summary, text = summarise(tmp_path / "two")
    assert "22 of 24 steps per rank analysed" in text.splitlines()[0]
    synthetic_run(tmp_path / "one", steps=24)
    _summary, text = summarise(tmp_path / "one")
    assert "1 rank, cpu; 22 of 24 steps analysed)" in text.splitlines()[0]


def memory_run(run_dir: Path, rss_by_rank: tuple[int, ...]) -> dict:
    for rank, rss in enumerate(rss_by_rank):
        records = [header(rank, len(rss_by_rank))]
        for index in range(20):
            record = step(index, index * 10.0, forward=5.0, backward=5.0)
            record[schema.RSS] = rss
            records.append(record)
        write_rank(run_dir, rank, [*records, footer(20)])
    summary = reduce_run(run_dir)
    summary[schema.SUMMARY_VERDICTS] = diagnose(summary)
    return summary


def test_memory_imbalance_line_only_when_ranks_are_imbalanced(tmp_path):
    balanced = render_text(memory_run(tmp_path / "balanced", (2 * GIB, 2 * GIB)))
    assert "Memory imbalance" not in balanced
    imbalanced = render_text(memory_run(tmp_path / "imbalanced", (1 * GIB, 3 * GIB)))
    assert "Memory imbalance: rank 1 holds 1.50x the ranks' median" in imbalanced


def test_diagnosis_moving_to_insufficient_data_says_the_run_cannot_tell(tmp_path):
    base = dict(input=5, forward=20, backward=20, optimizer=50, residual=5)
    synthetic_run(tmp_path / "a", steps=200, seed=1, **base)
    synthetic_run(tmp_path / "b", steps=8, seed=2, **base)
    summarise(tmp_path / "a")
    summarise(tmp_path / "b")
    result = compare(load_summary(tmp_path / "a"), load_summary(tmp_path / "b"))
    assert result["diagnosis"]["b"] == schema.VERDICT_INSUFFICIENT_DATA
    text = render_comparison(result)
    line = next(x for x in text.splitlines() if x.startswith("Diagnosis: "))
    assert "is gone" not in line
    assert "B has too few steps for a diagnosis" in line


def test_compare_on_a_directory_without_a_summary_says_so(tmp_path, capsys):
    synthetic_run(tmp_path / "good", steps=40)
    summarise(tmp_path / "good")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["compare", str(empty), str(tmp_path / "good")]) == 2
    err = capsys.readouterr().err
    assert "no such file" not in err
    assert f"{empty} has no final_summary.json" in err
    unreported = tmp_path / "unreported"
    synthetic_run(unreported, steps=40)  # rank files, no summary yet
    assert main(["compare", str(unreported), str(tmp_path / "good")]) == 2
    assert f"traceml report {unreported}" in capsys.readouterr().err


def test_a_real_change_in_a_small_phase_is_shown_not_hidden(tmp_path):
    # Issue 25's flagship example: Input Wait fell ~80% (its interval far from zero) but was
    # about 1% of the step: "real, but 1.0% of step", and named on the Phases line.
    base = dict(forward=50, backward=40, optimizer=5, residual=4)
    synthetic_run(tmp_path / "a", steps=200, seed=1, noise=0.02, input=1.0, **base)
    synthetic_run(tmp_path / "b", steps=200, seed=2, noise=0.02, input=0.2, **base)
    summarise(tmp_path / "a")
    summarise(tmp_path / "b")
    result = compare(load_summary(tmp_path / "a"), load_summary(tmp_path / "b"))
    entry = result["fields"][schema.INPUT_WAIT]
    assert entry["hidden_rule"] == "material" and entry["ci_change_pct"][1] < -50
    text = render_comparison(result)
    row = next(x for x in text.splitlines() if x.startswith("  Input Wait"))
    assert row.endswith("real, but 1.0% of step"), row
    assert "hidden" not in row
    phases = next(x for x in text.splitlines() if x.startswith("Phases that moved: "))
    assert "real but under 2% of step: Input Wait -8" in phases, phases


def test_control_characters_from_a_file_are_shown_escaped_not_sent_to_the_terminal(tmp_path):
    # A run name or event message is whatever a rank file says: an escape sequence in it
    # reached the reader's terminal raw (report and compare).
    from traceml.present.printable import printable

    assert printable("run\x1b[2Jx\r\x9b\tok\n") == "run\\x1b[2Jx\\x0d\\x9b\tok\n"
    # Bidirectional overrides reorder what is shown: "a\u202ecba" reads as "aabc" (review).
    assert printable("a\u202ecba\u2066\u200f") == "a\\u202ecba\\u2066\\u200f"
    evil = "evil\x1b]0;pwned\x07"
    records = [header(0, run=evil), *(step(i, forward=5, backward=5) for i in range(30))]
    write_rank(tmp_path / "a", 0, [*records, footer(30)])
    _, text = summarise(tmp_path / "a")
    assert "\x1b" not in text and "\\x1b]0;pwned\\x07" in text
    result = compare(load_summary(tmp_path / "a"), load_summary(tmp_path / "a"))
    assert "\x1b" not in render_comparison(result)
