"""The text report (100 columns, verdict first) and the self-contained HTML page."""

import re

import pytest

from traceml import schema
from traceml.finalize import summarise
from traceml.present.report import render_text
from traceml.present.report_html import render_html

from rankfiles import footer, header, step, synthetic_run, write_rank


def test_text_report_layout(tmp_path):
    synthetic_run(
        tmp_path, ranks=2, input=60, forward=15, backward=20, optimizer=3, residual=2, steps=30
    )
    summary, text = summarise(tmp_path)
    lines = text.splitlines()
    assert all(len(line) <= 100 for line in lines)
    assert lines[0].startswith(
        "traceml: handmade (completed; 2 ranks, cpu; 28 of 30 steps per rank analysed)"
    )
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
    # One timeline per rank (the memory and CPU charts are other SVGs).
    assert len(re.findall(r'<svg[^>]*aria-label="Rank \d+: \d+ bars', page)) == 2
    # Input Wait is a third of the step: INPUT_BOUND (warn, from 25%) heads the page.
    assert '<div class="verdict warn"><h2>INPUT-BOUND (warn)</h2>' in page
    # 300 steps are binned into at most 200 bars per rank.
    assert page.count("<rect") <= 2 * 200 * 6


def _run_with_a_tail(tmp_path, *, tail_s, step_ms=100.0, noisy=False, gap_ms=0.5):
    """One rank, 20 steps ``gap_ms`` apart, then ``tail_s`` of validation/checkpointing before
    the footer; clock origin, start and end times consistent with each other."""
    from datetime import datetime, timedelta, timezone

    from rankfiles import footer, header, step, write_rank

    origin = datetime(2026, 1, 1, tzinfo=timezone.utc)
    records = [header(clock_origin_unix=origin.timestamp(), started_at=origin.isoformat())]
    t = 0.0
    for index in range(20):
        forward = step_ms * (10 if noisy and index % 4 == 0 else 1) / 2
        records.append(step(index, t_ms=t, forward=forward, backward=forward))
        if index:
            records[-1][schema.GAP_MS] = gap_ms
        t += 2 * forward + gap_ms
    ended = origin + timedelta(milliseconds=t + tail_s * 1000)
    records.append(footer(20, ended_at=ended.isoformat(timespec="milliseconds")))
    write_rank(tmp_path, 0, records)
    return summarise(tmp_path, write=False)


def test_time_after_the_last_step_is_counted_outside_steps(tmp_path):
    summary, text = _run_with_a_tail(tmp_path, tail_s=5.0)
    assert summary["overall"][schema.AFTER_LAST_STEP_MS] == pytest.approx(5000.5, abs=1.0)
    line = " ".join(text.split())
    assert "Outside steps (validation, checkpoints, epoch ends): 5.01 s of 7.01 s" in line
    assert "0.01 s between steps, 5.00 s after the last step" in line


def test_after_a_step_limit_the_untraced_steps_are_not_called_validation(tmp_path):
    # --trace-max-steps 5 of 30: the 25 untraced steps read "Outside steps (validation,
    # checkpoints, epoch ends) ... 80% ... after the last step" (helper review).
    summary, _text = _run_with_a_tail(tmp_path, tail_s=5.0)
    summary[schema.SUMMARY_SETUP]["trace_max_steps"] = 20
    line = " ".join(render_text(summary).split())
    assert "Outside steps" not in line
    assert "Between steps (validation, checkpoints, epoch ends): 0.01 s of 2.01 s" in line
    # (the limit may have been the run's length: "if any", review)
    assert "after the last traced step, 5.00 s: the steps run after the step limit, if any" in line
    summary[schema.SUMMARY_SETUP]["trace_max_steps"] = 21  # set, not reached
    assert "Outside steps (validation, checkpoints, epoch ends): 5.01 s" in render_text(summary)


def test_most_of_the_time_between_steps_is_a_caveat_the_verdict_does_not_see(tmp_path):
    # Work after optimizer.step() each step (a review: 30 ms a step, 83% of the time) left the
    # verdict and the steps/s of the steps alone, with no word of it; a final validation
    # (after the last step) is no such work.
    for gap_ms, tail_s, said in ((120.0, 0.0, True), (80.0, 0.0, False), (0.5, 30.0, False)):
        _summary, text = _run_with_a_tail(tmp_path, tail_s=tail_s, gap_ms=gap_ms)
        line = " ".join(text.split())
        caveat = "Caveat: 53% of the time from the first step to the last (2.28 s of 4.28 s)"
        assert (caveat in line) is said, (gap_ms, tail_s)
        if said:  # where a step ends is the integration's (review of this stop's diff)
            setup = _summary[schema.SUMMARY_SETUP]
            for integration, where in (
                ("torch", "A step ends as optimizer.step() returns"),
                ("hf_trainer", "A step ends at the Trainer's on_step_end"),
                ("lightning", "A step ends once the callbacks' on_train_batch_end have run"),
            ):
                setup[schema.INTEGRATION] = integration
                assert where in " ".join(render_text(_summary).split()), integration


def test_without_an_end_time_between_steps_says_what_it_covers(tmp_path):
    synthetic_run(tmp_path, forward=30, backward=60)  # its clock origin predates its start
    summary, text = summarise(tmp_path, write=False)
    assert summary["overall"][schema.AFTER_LAST_STEP_MS] is None
    line = " ".join(text.split())
    assert "from the first step's start to the last step's end" in line
    assert "the time after the last step is unknown" in line


def test_time_after_the_last_step_is_shown_when_no_gap_between_steps_was_measured(tmp_path):
    summary, _text = _run_with_a_tail(tmp_path, tail_s=5.0)
    summary["overall"][schema.BETWEEN_STEPS_MS] = None  # (no gap measured: null, review)
    line = " ".join(render_text(summary).split())
    assert "Outside steps: 5.00 s after the last step (validation, checkpoints); the time" in line


def test_means_add_up_and_medians_need_not(tmp_path):
    _summary, text = _run_with_a_tail(tmp_path, tail_s=1.0)
    assert "The phase means add up to the step mean; medians and p90s are of each phase" in (
        " ".join(text.split())
    )


def test_phases_measured_on_fewer_steps_are_named_not_said_to_add_up(tmp_path):
    # Rank 1 has no H2D (null, its time in Residual): H2D's mean is over rank 0's steps only,
    # and the means add up to 110 ms of a 100 ms step. The report said they added up.
    for rank, h2d, residual in ((0, 20.0, 10.0), (1, None, 30.0)):
        records = [
            step(i, t_ms=i * 100.0, h2d=h2d, forward=30, backward=40, residual=residual)
            for i in range(30)
        ]
        write_rank(tmp_path, rank, [header(rank, world_size=2), *records, footer(30)])
    _summary, text = summarise(tmp_path, write=False)
    line = " ".join(text.split())
    assert "The phase means add up to the step mean" not in line
    assert "Some phases were measured on fewer steps than the step time (H2D on 28 of 56)" in line


def test_very_uneven_steps_get_a_caveat_and_even_ones_do_not(tmp_path):
    _summary, even = _run_with_a_tail(tmp_path / "even", tail_s=1.0)
    assert "Caveat:" not in even
    summary, noisy = _run_with_a_tail(tmp_path / "noisy", tail_s=1.0, noisy=True)
    step = summary["overall"]["phases"][schema.STEP]
    assert step["p90"] / step["median"] >= 2.0
    lines = noisy.splitlines()
    caveat = next(i for i, line in enumerate(lines) if line.startswith("  Caveat: "))
    assert lines[caveat - 1].startswith("  ") and lines[3].startswith("  Why:")
    assert "the verdict describes where they spend their time" in " ".join(noisy.split())


def test_the_terminal_report_opens_with_a_banner(tmp_path):
    from traceml.present.report import for_terminal

    _summary, text = _run_with_a_tail(tmp_path, tail_s=1.0)
    printed = for_terminal(text).splitlines()
    assert printed[0] == "" and len(printed[1]) == 100
    assert printed[1].strip("=") == " traceml report " and printed[2] == text.splitlines()[0]


def _cuda_run(tmp_path, **counters):
    """One CUDA rank whose memory samples carry ``counters`` (allocator retries, OOMs) or not."""
    gib = 2**30
    first = header(0, 1)
    first[schema.DEVICE] = {"type": "cuda", "name": "X", "total_memory_bytes": 80 * gib}
    records = [first]
    for index in range(40):
        records.append(step(index, index * 101.0, forward=50, backward=50))
        records.append({schema.KIND: schema.KIND_SAMPLE, schema.AT_STEP: index + 1,
                        schema.T_START_MS: index * 101.0, schema.DEVICE_MEM_ALLOCATED: 10 * gib,
                        schema.DEVICE_MEM_RESERVED: 12 * gib, **counters})  # fmt: skip
    records.append(footer(40))
    write_rank(tmp_path, 0, records)
    _summary, text = summarise(tmp_path, write=False)
    return next(line for line in text.splitlines() if "device memory:" in line)


def test_allocator_counters_not_sampled_are_not_shown_as_zero(tmp_path):
    # A sample without the counters (an older torch, a failed read) measured nothing: "0 OOMs"
    # would claim none happened.
    line = _cuda_run(tmp_path / "none")
    assert line.endswith("allocator retries and OOMs not measured"), line
    line = _cuda_run(tmp_path / "zero", **{schema.ALLOC_RETRIES: 0, schema.DEVICE_OOMS: 0})
    assert line.endswith(", 0 allocator retries, 0 OOMs"), line


def test_a_run_of_many_ranks_lists_the_ranks_worth_reading(tmp_path):
    # 256 ranks printed a 563-line report, 4,096 ranks 8,241 lines (helper review).
    synthetic_run(
        tmp_path, ranks=40, steps=30, forward=30, backward=30, per_rank={23: {"forward": 90}}
    )
    crashed = tmp_path / schema.RANKS_DIR / schema.rank_file_name(31)
    crashed.write_bytes(b"".join(crashed.read_bytes().splitlines(keepends=True)[:-1]))  # no footer
    summary, _ = summarise(tmp_path, write=False)
    text = render_text(summary)
    table = text.split("Per rank (median ms per step)\n", 1)[1].split("\n\n", 1)[0].splitlines()
    rows = [line for line in table[1:] if re.match(r"^  \d+ ", line)]
    assert len(rows) == 13  # the 8 slowest, the 4 fastest, the one that did not complete
    assert [int(r.split()[0]) for r in rows] == sorted(int(r.split()[0]) for r in rows)
    assert any(r.split()[0] == "23" and r.endswith("(slowest)") for r in rows), rows
    assert any(r.split()[0] == "31" and "no footer" in r for r in rows), rows
    assert table[-1].startswith("  ... 27 more ranks not listed"), table
    assert len(summary["ranks"]) == 40  # the summary keeps every rank
    page = render_html(summary)  # 22.7 MB at 256 ranks: a timeline for each rank
    assert page.count("<svg") == 2 * 13 and "27 more ranks not listed" in page  # 2 a timeline


def test_few_ranks_are_all_listed():
    from traceml.present.rank_rows import RANK_ROWS, rows_worth_reading

    entries = list(range(RANK_ROWS))
    assert rows_worth_reading(entries, float) == (entries, 0)
    many = list(range(3 * RANK_ROWS))
    shown, left = rows_worth_reading(
        many, lambda e: None if e == 5 else -abs(e - 20), lambda e: e == 5
    )
    assert 5 in shown and 20 in shown and left == len(many) - len(shown)
    assert len(shown) <= RANK_ROWS
    damaged = [{"v": v} for v in ["x", None, True, float("nan"), *range(30)]]
    shown, left = rows_worth_reading(damaged, lambda e: e["v"])  # no TypeError
    assert {e["v"] for e in shown} == {0, 1, 2, 3, *range(22, 30)}
