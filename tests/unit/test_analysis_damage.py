"""Rule 2 and 3 on the analysis side: damaged or partly unmeasured records give numbers that
add up and verdicts the data supports (each case found by a review, each failing before its
fix): shares over the same steps, own time on one basis, the measured-step minimum, the input
breakdown's fields, one rank's damaged header, gradient accumulation in the input advice,
the device's compute share without its waits, negative telemetry, one damaged step number,
out-of-order records' span, and a note repeated by one rank."""

from __future__ import annotations

import pytest

from traceml import schema
from traceml.analysis.diagnose import diagnose
from traceml.analysis.notes import dedupe_rank_notes
from traceml.analysis.reduce import reduce_run

from rankfiles import footer, header, step, write_rank


def _ranks(tmp_path, ranks, steps=30, damage=None, extra=None, **phases):
    """``ranks`` rank files of ``steps`` steps of ``phases`` (ms); ``damage(rank, i, record)``
    edits a step record; ``extra(rank)`` gives records to add before the footer."""
    for rank in range(ranks):
        records, t = [header(rank, ranks)], 0.0
        for index in range(steps):
            record = step(index, t, **phases)
            if damage is not None:
                damage(rank, index, record)
            records.append(record)
            t += 200.0
        records.extend(extra(rank) if extra else [])
        records.append(footer(steps))
        write_rank(tmp_path, rank, records)
    summary = reduce_run(tmp_path)
    return summary, {v["kind"]: v for v in diagnose(summary)}


def test_phase_shares_are_of_the_same_steps_as_the_step_time(tmp_path):
    def half_unmeasured(_rank, index, record):
        if index % 2:
            record[schema.STEP] = -1.0  # damaged: cleaned to null

    summary, _ = _ranks(
        tmp_path, 1, steps=22, damage=half_unmeasured, input=50.0, forward=30.0, backward=20.0
    )
    shares = summary[schema.SUMMARY_OVERALL][schema.SHARES]
    assert sum(shares[p] or 0.0 for p in schema.PHASES) == pytest.approx(1.0)
    assert shares[schema.INPUT_WAIT] == pytest.approx(0.5)


def test_a_rank_with_an_unmeasured_backward_is_no_straggler(tmp_path):
    def unmeasured_backward(rank, _index, record):
        if rank == 1:
            record[schema.BACKWARD] = -1.0

    summary, verdicts = _ranks(
        tmp_path, 2, damage=unmeasured_backward, input=5.0, forward=35.0, backward=60.0
    )
    assert "STRAGGLER" not in verdicts
    ranks = summary[schema.SUMMARY_RANKS]
    assert ranks[1][schema.PHASE_STATS][schema.OWN_MS] is None  # unknown, not the whole step


def test_ranks_with_and_without_comm_timing_are_not_compared_by_own_time(tmp_path):
    def comm_on_rank_0(rank, _index, record):
        if rank == 0:  # 30 of Backward's 50 ms waiting on the other rank, measured
            for phase in schema.PHASES:
                record[schema.COMM_OF_PHASE[phase]] = 30.0 if phase == schema.BACKWARD else 0.0
            record.update({schema.COMM: 30.0, schema.COMM_COUNT: 1, schema.COMM_BYTES: 1024})

    _summary, verdicts = _ranks(
        tmp_path, 2, damage=comm_on_rank_0, input=5.0, forward=40.0, backward=50.0, optimizer=5.0
    )
    # Identical ranks: 70 ms (step minus comm) against 50 ms (step minus Backward) is no
    # straggler, only two measures.
    assert "STRAGGLER" not in verdicts


def test_a_verdict_needs_measured_steps_not_records(tmp_path):
    def damaged(_rank, index, record):
        if 2 <= index < 12:
            for fieldname in schema.TIMED_FIELDS:
                record[fieldname] = -1.0

    _summary, verdicts = _ranks(
        tmp_path, 1, steps=14, damage=damaged, input=60.0, forward=20.0, backward=20.0
    )
    assert "INSUFFICIENT_DATA" in verdicts
    assert "INPUT_BOUND" not in verdicts


@pytest.mark.parametrize(
    "bad", [{schema.EPOCH: [0]}, {"num_workers": "2"}, {"cpu_count": "8"}, {"epoch": {}}]
)
def test_damaged_input_records_do_not_crash_the_report(tmp_path, bad):
    def inputs(rank):
        worker = {
            "worker": 0,
            "batches": 30,
            "samples": 240,
            "getitem_ms": 2700.0,
            "collate_ms": 300.0,
            "busy_ms": 3000.0,
            "span_ms": 3100.0,
        }
        return [
            {
                "kind": "input",
                "epoch": 0,
                "num_workers": 1,
                "cpu_count": 8,
                "producers": [worker],
                **bad,
            }
        ]

    summary, verdicts = _ranks(tmp_path, 1, extra=inputs, input=120.0, forward=40.0)
    assert summary[schema.SUMMARY_INPUT_PIPELINE] is not None
    assert "INPUT_BOUND" in verdicts


def test_one_ranks_damaged_header_leaves_a_partial_report(tmp_path):
    _ranks(tmp_path, 2, input=5.0, forward=40.0, backward=50.0)
    path = tmp_path / "ranks" / "rank_1.jsonl"
    path.write_bytes(path.read_bytes().replace(b'"schema":"traceml.rank', b'"schema":"x', 1))
    summary = reduce_run(tmp_path)
    assert [e[schema.SUMMARY_STEPS_RECORDED] for e in summary[schema.SUMMARY_RANKS]] == [30, 30]
    assert any("rank 1: its header's schema" in note for note in summary["notes"])


def test_gradient_accumulation_reaches_the_input_advice(tmp_path):
    def accumulate(_rank, _index, record):
        record[schema.MICROBATCHES] = 4

    summary, _ = _ranks(tmp_path, 1, damage=accumulate, input=120.0, forward=80.0)
    phases = summary[schema.SUMMARY_OVERALL][schema.PHASE_STATS]
    assert phases[schema.MICROBATCHES]["mean"] == 4


def test_the_devices_compute_share_leaves_out_its_waits(tmp_path):
    def cuda(_rank, _index, record):
        record.update(
            {
                schema.GPU_FORWARD: 20.0,
                schema.GPU_BACKWARD: 75.0,
                schema.GPU_STEP: 100.0,
                schema.GPU_COMM: 60.0,
                **{schema.GPU_COMM_OF_PHASE[p]: 0.0 for p in schema.GPU_COMM_OF_PHASE},
                schema.GPU_COMM_OF_PHASE[schema.BACKWARD]: 60.0,
            }
        )

    _summary, verdicts = _ranks(
        tmp_path, 2, damage=cuda, input=1.0, forward=20.0, backward=10.0, residual=65.0
    )
    assert "COMM_BOUND" in verdicts
    assert "COMPUTE_BOUND" not in verdicts  # 35% of device time is compute, not 95%


def test_a_negative_telemetry_reading_is_no_memory_pressure(tmp_path):
    def samples(_rank):
        return [
            {
                "kind": "sample",
                "t_ms": 200.0 * i,
                "at_step": i,
                "host_mem_available_bytes": -1 if i == 15 else 48 * 2**30,
                "host_mem_total_bytes": 64 * 2**30,
            }
            for i in range(5, 30, 5)
        ]

    _summary, verdicts = _ranks(tmp_path, 1, extra=samples, forward=40.0, backward=50.0)
    assert "HOST_MEMORY_PRESSURE" not in verdicts


def test_one_damaged_global_step_keeps_the_ranks_aligned(tmp_path):
    def damaged(rank, index, record):
        if rank == 1 and index == 30:
            record[schema.GLOBAL_STEP] = "31"

    def alternating(rank, index, record):
        record[schema.FORWARD] = 50.0 if index % 2 else 150.0
        record[schema.STEP] = record[schema.FORWARD] + 50.0
        damaged(rank, index, record)

    summary, _ = _ranks(tmp_path, 2, steps=40, damage=alternating, forward=50.0, backward=50.0)
    series = summary[schema.SUMMARY_JOB_SERIES]["fields"][schema.STEP]
    assert series["mean"] == pytest.approx(150.0)


def test_the_span_of_out_of_order_records_is_earliest_to_latest(tmp_path):
    records, t = [header(0, 1)], 0.0
    for index in range(30):
        records.append(step(index, t, forward=50.0, backward=50.0))
        t += 200.0
    records.append(dict(records[5]))  # an early step written again at the end
    write_rank(tmp_path, 0, [*records, footer(30)])
    summary = reduce_run(tmp_path)
    assert summary[schema.SUMMARY_OVERALL][schema.WALL_MS] == pytest.approx(29 * 200.0 + 100.0)


def test_a_note_repeated_by_one_rank_is_not_every_ranks():
    assert dedupe_rank_notes(["rank 0: X"] * 3, 3) == ["rank 0: X"] * 3
    assert dedupe_rank_notes(["rank 0: X", "rank 1: X", "rank 2: X"], 3) == ["all 3 ranks: X"]


def test_a_steps_unmeasured_input_wait_leaves_its_device_own_time_unknown(tmp_path):
    def cuda(rank, index, record):
        record.update(
            {
                schema.GPU_FORWARD: 20.0,
                schema.GPU_BACKWARD: 75.0,
                schema.GPU_STEP: 100.0,
                schema.GPU_COMM: 0.0,
                **{schema.GPU_COMM_OF_PHASE[p]: 0.0 for p in schema.GPU_COMM_OF_PHASE},
            }
        )
        if (rank == 0 and index % 2) or rank == 1:
            record[schema.INPUT_WAIT] = None  # rank 0: some fetches unseen; rank 1: none seen

    summary, _ = _ranks(tmp_path, 2, damage=cuda, input=50.0, forward=20.0, backward=75.0)
    own = {
        entry["rank"]: entry[schema.PHASE_STATS][schema.GPU_OWN_MS]
        for entry in summary[schema.SUMMARY_RANKS]
    }
    assert own[0]["min"] == 150.0  # device time plus a measured wait only: no step at 100
    assert own[0]["count"] == 14
    assert own[1]["max"] == 100.0  # batches from a list: the device time alone


def test_residual_heavy_says_when_forward_went_unmeasured(tmp_path):
    # A LightningModule whose training_step calls a submodule traceml does not time: the
    # model's time is in Residual, and the advice ("log less often") pointed elsewhere.
    def no_forward(_rank, _index, record):
        record[schema.FORWARD] = None

    _summary, verdicts = _ranks(
        tmp_path, 1, damage=no_forward, input=1.0, forward=0.0, backward=5.0, residual=80.0
    )
    advice = verdicts["RESIDUAL_HEAVY"][schema.VERDICT_NEXT]
    assert advice.startswith("Forward was not measured, so the model's forward is in Residual")
    _summary, verdicts = _ranks(tmp_path / "b", 1, input=1.0, forward=5.0, residual=80.0)
    assert "Forward was not measured" not in verdicts["RESIDUAL_HEAVY"][schema.VERDICT_NEXT]
