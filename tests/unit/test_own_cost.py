"""traceml's own cost: carried per step, summarised, printed, and flagged by compare."""

from __future__ import annotations

import orjson
import pytest

from traceml import schema
from traceml.cli import main
from traceml.finalize import summarise

from rankfiles import footer, header, step, write_rank


def run_with_cost(run_dir, cost_us: float, steps: int = 30, forward: float = 40.0):
    records = [header()]
    for index in range(steps):
        record = step(index, index * 100.0, forward=forward, backward=50.0)
        record[schema.TRACEML_COST_US] = cost_us
        records.append(record)
    records.append(footer(steps))
    write_rank(run_dir, 0, records)
    return summarise(run_dir)


def test_cost_is_summarised_and_printed(tmp_path):
    summary, text = run_with_cost(tmp_path / "a", cost_us=45.0)
    cost = summary["overall"]["phases"][schema.TRACEML_COST_US]
    assert cost["mean"] == pytest.approx(45.0)
    # 45 us of a 90 ms step.
    assert "traceml's own cost: 45 us per step (0.05% of step time" in text


def test_compare_warns_when_traceml_costs_more_than_one_percent(tmp_path, capsys):
    run_with_cost(tmp_path / "a", cost_us=45.0)
    run_with_cost(tmp_path / "b", cost_us=2700.0)  # 3% of a 90 ms step
    output = tmp_path / "cmp"
    main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--output", str(output)])
    notes = orjson.loads((tmp_path / "cmp.json").read_bytes())["notes"]
    flagged = [note for note in notes if "traceml's own cost" in note]
    assert len(flagged) == 1
    assert "2700 us per step, 3.0% of step time (over 1%)" in flagged[0]
    assert "traceml's own cost" in capsys.readouterr().out


def test_files_without_the_field_have_no_cost_line(tmp_path):
    records = [header(), *[step(i, i * 100.0, forward=40.0) for i in range(12)], footer(12)]
    for record in records:
        record.pop(schema.TRACEML_COST_US, None)
    write_rank(tmp_path, 0, records)
    summary, text = summarise(tmp_path)
    assert summary["overall"]["phases"][schema.TRACEML_COST_US] is None
    assert "own cost" not in text
