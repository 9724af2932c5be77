"""Scenario tests: synthetic runs whose bottleneck is known, and the verdict traceml gives."""

import pytest

from traceml.analysis.diagnose import diagnose
from traceml.analysis.reduce import reduce_run

from rankfiles import synthetic_run


def verdicts_for(tmp_path, **kwargs):
    synthetic_run(tmp_path, **kwargs)
    summary = reduce_run(tmp_path)
    return diagnose(summary)


def test_input_wait_60_percent_is_input_bound_critical(tmp_path):
    verdicts = verdicts_for(tmp_path, input=60, forward=15, backward=20, optimizer=3, residual=2)
    top = verdicts[0]
    assert (top["kind"], top["severity"]) == ("INPUT_BOUND", "critical")
    assert "Input Wait took 60% of step time" in top["why"]
    assert "num_workers (now 0)" in top["next"]
    assert top["evidence"]["share"] == pytest.approx(0.6, abs=0.02)


def test_an_input_bound_run_on_the_cpu_is_not_told_to_feed_a_gpu(tmp_path):
    # A CPU run read "Feed the GPU faster: ... set pin_memory=True" (helper review).
    synthetic_run(tmp_path, input=60, forward=15, backward=20, optimizer=3, residual=2)
    summary = reduce_run(tmp_path)
    for device, gpu_words in (("cpu", False), ("cuda", True)):
        summary["setup"]["device"] = device
        top = diagnose(summary)[0]
        assert top["kind"] == "INPUT_BOUND" and "num_workers (now 0)" in top["next"]
        assert ("GPU" in top["next"]) is gpu_words and ("pin_memory" in top["next"]) is gpu_words


def test_forward_backward_90_percent_is_compute_bound(tmp_path):
    verdicts = verdicts_for(tmp_path, input=2, forward=30, backward=60, optimizer=5, residual=3)
    assert verdicts[0]["kind"] == "COMPUTE_BOUND"
    assert verdicts[0]["severity"] == "info"
    assert "Forward + Backward took 90%" in verdicts[0]["why"]
    assert all(v["severity"] == "info" for v in verdicts)


def test_one_rank_slower_in_input_is_a_straggler(tmp_path):
    base = dict(input=10, forward=30, backward=40, optimizer=10, residual=10)
    verdicts = verdicts_for(
        tmp_path, ranks=4, per_rank={2: {"input": 50}}, noise=0.02, **base
    )  # rank 2: 140 ms vs 100 ms
    straggler = next(v for v in verdicts if v["kind"] == "STRAGGLER")
    assert straggler["evidence"]["rank"] == 2
    assert straggler["evidence"]["cause_phase"] == "input_wait_ms"
    assert "Rank 2 is slow" in straggler["why"] and "Input Wait" in straggler["why"]
    assert straggler["severity"] in ("warn", "critical")


def test_ddp_style_straggler_hidden_in_backward_wait(tmp_path):
    # Under DDP the fast ranks wait for rank 1 in the all-reduce: equal step times, but
    # their Backward holds the wait. The own-time basis still finds rank 1.
    base = dict(input=5, forward=30, optimizer=10, residual=5)
    verdicts = verdicts_for(
        tmp_path,
        ranks=2,
        noise=0.01,
        per_rank={0: {"backward": 70}, 1: {"input": 45, "backward": 30}},
        **base,
    )
    straggler = next(v for v in verdicts if v["kind"] == "STRAGGLER")
    assert straggler["evidence"]["rank"] == 1
    assert straggler["evidence"]["basis"] == "own_ms"
    assert straggler["evidence"]["cause_phase"] == "input_wait_ms"


def test_three_steps_is_insufficient_data(tmp_path):
    verdicts = verdicts_for(tmp_path, steps=3, input=60, forward=40)
    assert [v["kind"] for v in verdicts] == ["INSUFFICIENT_DATA"]
    assert "Input Wait is the largest phase" in verdicts[0]["why"]


def test_an_even_mix_raises_no_alarm(tmp_path):
    verdicts = verdicts_for(
        tmp_path, input=18, h2d=15, forward=20, backward=20, optimizer=15, residual=12
    )
    assert [v["kind"] for v in verdicts] == ["NO_CLEAR_BOTTLENECK"]
    assert verdicts[0]["severity"] == "info"


@pytest.mark.parametrize(
    ("phases", "kind"),
    [
        (dict(input=5, h2d=45, forward=25, backward=25), "H2D_BOUND"),
        (dict(input=5, forward=20, backward=25, optimizer=50), "OPTIMIZER_HEAVY"),
        (dict(input=5, forward=20, backward=25, residual=50), "RESIDUAL_HEAVY"),
    ],
)
def test_other_bottlenecks(tmp_path, phases, kind):
    verdicts = verdicts_for(tmp_path, **phases)
    assert verdicts[0]["kind"] == kind
    assert verdicts[0]["severity"] in ("warn", "critical")


def test_memory_pressure_on_cuda(tmp_path):
    synthetic_run(tmp_path, forward=40, backward=60)
    summary = reduce_run(tmp_path)
    summary["setup"]["total_memory_bytes"] = 80 * 2**30
    summary["overall"]["mem_peak_reserved_bytes"] = 78 * 2**30
    kinds = {v["kind"]: v for v in diagnose(summary)}
    assert kinds["MEMORY_PRESSURE"]["severity"] == "critical"
    assert "98% of capacity" in kinds["MEMORY_PRESSURE"]["why"]


def test_thresholds_can_be_overridden(tmp_path):
    synthetic_run(tmp_path, input=20, forward=40, backward=40)
    summary = reduce_run(tmp_path)
    assert "INPUT_BOUND" not in [v["kind"] for v in diagnose(summary)]
    overridden = diagnose(summary, {"input_warn": 0.15})
    assert overridden[0]["kind"] == "INPUT_BOUND"


def test_no_steps(tmp_path):
    from rankfiles import footer, header, write_rank

    write_rank(tmp_path, 0, [header(), footer(0)])
    (only,) = diagnose(reduce_run(tmp_path))
    assert only["kind"] == "INSUFFICIENT_DATA"


@pytest.mark.parametrize(
    ("integration", "said", "not_said"),
    [
        ("torch", "your loop's own work", "RF-DETR"),  # a hand-written loop: no training_step
        ("hf_trainer", "compute_loss", "RF-DETR"),
        ("lightning", "training_step's own work", "RF-DETR"),
        ("rfdetr", "Hungarian matching", "compute_loss"),
    ],
)
def test_residual_advice_speaks_of_the_loop_it_measured(tmp_path, integration, said, not_said):
    synthetic_run(tmp_path, input=5, forward=20, backward=25, residual=50)
    summary = reduce_run(tmp_path)
    summary["setup"]["integration"] = integration
    [residual] = [v for v in diagnose(summary) if v["kind"] == "RESIDUAL_HEAVY"]
    assert said in residual["next"] and not_said not in residual["next"]
