"""The text report (100 columns, verdict first) and the self-contained HTML page."""

import re

from traceml import schema
from traceml.finalize import summarise
from traceml.report import render_html, render_text

from rankfiles import synthetic_run


def test_text_report_layout(tmp_path):
    synthetic_run(
        tmp_path, ranks=2, input=60, forward=15, backward=20, optimizer=3, residual=2, steps=30
    )
    summary, text = summarise(tmp_path)
    lines = text.splitlines()
    assert all(len(line) <= 100 for line in lines)
    assert lines[0].startswith("traceml: handmade (completed; 2 ranks, cpu; 56 of 60 steps")
    assert lines[2] == "Verdict: INPUT-BOUND (critical)"
    assert lines[3].startswith("  Why:  Input Wait took 60% of step time")
    assert lines[4].startswith("  Next: ")
    assert "Phase breakdown per optimizer step (after warm-up)" in text
    assert "Per rank (median ms per step)" in text
    assert re.search(r"^  1 +0 +28 ", text, re.M)
    assert "Notes" in text and "skipped the first 2 steps" in text
    # The files are written next to the rank files.
    assert (tmp_path / schema.SUMMARY_JSON).is_file()
    assert (tmp_path / schema.SUMMARY_TXT).read_text() == text
    assert summary["verdicts"][0]["kind"] == "INPUT_BOUND"


def test_single_rank_has_no_rank_table(tmp_path):
    synthetic_run(tmp_path, forward=30, backward=60)
    _summary, text = summarise(tmp_path, write=False)
    assert "Per rank" not in text
    assert not (tmp_path / schema.SUMMARY_JSON).exists()


def test_unmeasured_phase_is_shown_as_such(tmp_path):
    synthetic_run(tmp_path, forward=30, backward=60)
    summary, _ = summarise(tmp_path, write=False)
    summary["overall"]["phases"]["h2d_ms"] = None
    text = render_text(summary)
    assert re.search(r"^  H2D +not measured$", text, re.M)


def test_html_is_self_contained(tmp_path):
    synthetic_run(tmp_path, ranks=2, input=30, forward=30, backward=30, steps=300)
    summary, _ = summarise(tmp_path, html=True)
    page = (tmp_path / schema.REPORT_HTML).read_text()
    assert page == render_html(summary)
    assert page.startswith("<!DOCTYPE html>")
    assert "<script" not in page
    assert not re.search(r"(src|href)=\"https?://", page)
    assert page.count("<svg") == 2  # one timeline per rank
    assert "INPUT-BOUND" in page or "NO-CLEAR-BOTTLENECK" in page or "COMPUTE" in page
    # 300 steps are binned into at most 200 bars per rank.
    assert page.count("<rect") <= 2 * 200 * 6
