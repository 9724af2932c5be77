"""The verdict rules at their edges: each test here pins a rule that a mutation of it passed
the whole unit suite without (a helper's mutation sweep of the analysis side, stop 64): the
threshold's own boundary, the branch no test took, the order no test read. The comment above
each names the mutation it kills."""

from __future__ import annotations

import pytest

from traceml import schema
from traceml.analysis import job_series
from traceml.analysis.compare import CompareOptions, compare, load_summary
from traceml.analysis.compare_estimate import difference
from traceml.analysis.diagnose import diagnose
from traceml.analysis.diagnose_base import CRITICAL, WARN, severity_for
from traceml.analysis.reduce import reduce_run
from traceml.compare_command import gate_exit_code
from traceml.finalize import summarise

from rankfiles import footer, header, step, synthetic_run, write_rank, write_run

BASE = dict(input=30, forward=30, backward=30, optimizer=5, residual=5)


def make_summary(path, **kwargs):
    synthetic_run(path, **kwargs)
    summary, _ = summarise(path)
    return path / schema.SUMMARY_JSON, summary


def device_rank(path, device: tuple[float, float, float], **host: float) -> None:
    """Rank 0 of 40 steps: ``host`` phases (ms) and the device's (forward, backward, step)."""
    records = [header()]
    for index in range(40):
        record = step(index, index * 101.0, **host)
        record[schema.GPU_FORWARD], record[schema.GPU_BACKWARD], record[schema.GPU_STEP] = device
        records.append(record)
    records.append(footer(40))
    write_rank(path, 0, records)


def kinds(summary):
    return {v[schema.VERDICT_KIND]: v for v in diagnose(summary)}


# M01: severity_for '>=' -> '>' (thresholds are documented as "at or above")
def test_a_share_exactly_at_a_threshold_takes_that_severity():
    assert severity_for(0.25, 0.25, 0.5) == WARN
    assert severity_for(0.5, 0.25, 0.5) == CRITICAL


# M04: straggler_min_ms check dropped
def test_a_sub_millisecond_excess_is_no_straggler(tmp_path):
    # 1 ms steps; rank 1's forward 0.25 ms longer: ratio ~1.28, but only 0.25 ms per step.
    tiny = dict(
        input=0.05, forward=0.30, backward=0.40, optimizer=0.10, residual=0.05, comm_backward=0.06
    )
    found = 0
    for seed in range(10):
        synthetic_run(
            tmp_path / f"r{seed}",
            ranks=2,
            steps=40,
            seed=seed,
            noise=0.02,
            synchronised=True,
            per_rank={1: {**tiny, "forward": 0.55}},
            **tiny,
        )
        found += "STRAGGLER" in kinds(reduce_run(tmp_path / f"r{seed}"))
    assert found == 0
    # Control: the same shape at 100x the scale is a straggler.
    big = {k: v * 100 for k, v in tiny.items()}
    synthetic_run(
        tmp_path / "big",
        ranks=2,
        steps=40,
        seed=0,
        noise=0.02,
        synchronised=True,
        per_rank={1: {**big, "forward": 55.0}},
        **big,
    )
    assert "STRAGGLER" in kinds(reduce_run(tmp_path / "big"))


# M08: Residual not exempted while the device is busy computing
def test_residual_is_no_bottleneck_while_the_device_computes(tmp_path):
    device_rank(tmp_path, (40.0, 40.0, 80.0), input=5.0, forward=20.0, backward=15.0, residual=60.0)
    found = kinds(reduce_run(tmp_path))
    assert "COMPUTE_BOUND" in found
    assert "RESIDUAL_HEAVY" not in found


# M09: noise floor halved (abs(change) <= floor / 2)
def test_four_percent_is_inside_a_five_percent_floor(tmp_path):
    a, _ = make_summary(tmp_path / "a", steps=5000, seed=1, noise=0.02, **BASE)
    b, _ = make_summary(
        tmp_path / "b", steps=5000, seed=2, noise=0.02, **{k: v * 1.04 for k, v in BASE.items()}
    )
    given = CompareOptions(noise_floor_pct=5.0, noise_floor_source="given")
    result = compare(load_summary(a), load_summary(b), given)
    assert result["step"]["hidden_rule"] == "noise_floor"
    assert gate_exit_code(result, 3.0) != 1


# M11: between-run variance no longer floored by the within-run error
def test_three_runs_that_happen_to_agree_keep_their_within_run_error():
    def run(mean):  # within-run error 5% of the mean
        return job_series.RunEstimate(mean, mean * 0.05, 20.0, 200, 70.0, 0.1, 0.0, False)

    diff = difference([run(100.0)] * 3, [run(103.0)] * 3)
    assert diff.between_runs
    assert diff.low < 0 < diff.high  # +3% against 5% within-run errors: not a change


# M12: MIXED needs twice the memory change on the faster side
@pytest.mark.parametrize("factor", [1.15, 0.85])
def test_a_fifteen_percent_memory_change_makes_a_speed_change_mixed(tmp_path, factor):
    a, sa = make_summary(tmp_path / "a", steps=200, seed=1, **BASE)
    # factor > 1: B faster with more memory; factor < 1: B slower with less memory.
    b, _ = make_summary(
        tmp_path / "b", steps=200, seed=2, **{**BASE, "input": 10 if factor > 1 else 50}
    )
    data = load_summary(b)
    data["overall"]["rss_peak_bytes"] = sa["overall"]["rss_peak_bytes"] * factor
    assert compare(load_summary(a), data)["verdict"] == "MIXED"


# M13: drift no longer blocks EQUIVALENT
def test_runs_that_drift_more_than_the_margin_are_not_equivalent(tmp_path):
    from test_compare import two_level_run

    a = two_level_run(tmp_path / "a", 1, 400.0, 480.0)
    b = two_level_run(tmp_path / "b", 2, 400.0, 480.0)
    result = compare(load_summary(a), load_summary(b))
    assert result["verdict"] == "INCONCLUSIVE"
    assert any("drift by up to 20." in r for r in result["inconclusive_reasons"])


# M24: the half-a-core-per-worker rule of HOST_CPU_SATURATED
def test_workers_under_half_a_core_each_are_not_cpu_bound(tmp_path):
    from test_resources import GIB, cpu_rank, write

    # 4 workers at 150% of a core together (37% each): they wait as much as they work.
    found = kinds(write(tmp_path, [cpu_rank(97.0, 32 * GIB, workers_pct=150.0)]))
    assert "INPUT_BOUND" in found and "HOST_CPU_SATURATED" not in found
    found = kinds(write(tmp_path / "b", [cpu_rank(97.0, 32 * GIB, workers_pct=250.0)]))
    assert "HOST_CPU_SATURATED" in found


# M26: the slower side's MIXED rule (slower but >=10% less memory)  -> covered by
# test_a_fifteen_percent_memory_change_makes_a_speed_change_mixed[0.85]


# M27: material-share rule takes min over the two runs instead of max
def test_a_phase_that_grows_from_negligible_to_material_is_called(tmp_path):
    small = {**BASE, "optimizer": 1.0}  # 1% of the step in A
    a, _ = make_summary(tmp_path / "a", steps=300, seed=1, noise=0.05, **small)
    b, _ = make_summary(
        tmp_path / "b", steps=300, seed=2, noise=0.05, **{**small, "optimizer": 10.0}
    )
    entry = compare(load_summary(a), load_summary(b))["fields"][schema.OPTIMIZER]
    assert entry["hidden_rule"] is None and entry["status"] == "slower"


# M29: within a severity, verdicts ordered by weight descending (the headline)
def test_the_headline_is_the_larger_of_two_warnings(tmp_path):
    synthetic_run(
        tmp_path,
        steps=40,
        seed=0,
        noise=0.02,
        input=28,
        forward=15,
        backward=15,
        optimizer=37,
        residual=5,
    )
    verdicts = diagnose(reduce_run(tmp_path))
    assert [v["kind"] for v in verdicts[:2]] == ["OPTIMIZER_HEAVY", "INPUT_BOUND"]
    assert all(v["severity"] == "warn" for v in verdicts[:2])


# M30: INSUFFICIENT_DATA judged on the rank with most steps instead of fewest
def test_a_rank_with_too_few_steps_makes_the_run_insufficient(tmp_path):

    phases = dict(input=5.0, forward=30.0, backward=40.0, optimizer=10.0, residual=5.0)
    write_run(tmp_path, [[dict(phases)] * 40, [dict(phases)] * 6])
    verdicts = diagnose(reduce_run(tmp_path))
    assert verdicts[0]["kind"] == "INSUFFICIENT_DATA"
    assert verdicts[0]["evidence"]["steps_analysed"] == 4


# M31: memory_creep_critical_steps halved
def test_creep_that_runs_out_within_20000_steps_is_critical(tmp_path):
    from test_resources import cuda_rank, write

    # 80 GiB - ~10 GiB at 4 MiB per step: ~17,900 steps left -> critical (<= 20,000).
    creep = kinds(write(tmp_path, [cuda_rank(leak_per_step=4 * 2**20)]))["MEMORY_CREEP"]
    left = creep["evidence"]["projected_exhaustion_step"] - 59
    assert 10_000 < left <= 20_000
    assert creep["severity"] == "critical"


# M33: Welch-Satterthwaite df replaced by df_a + df_b
def test_one_noisy_short_run_keeps_the_interval_on_its_own_degrees_of_freedom():
    def run(se):
        return job_series.RunEstimate(100.0, se, 3.0, 40, 4.0, 0.1, 0.0, False)

    diff = difference([run(5.0)], [run(0.5)])
    assert diff.df == pytest.approx(3.06, abs=0.05)


# M36: exactly min_steps steady steps is enough ("fewer than this": INSUFFICIENT_DATA)
@pytest.mark.parametrize("steps, insufficient", [(12, False), (11, True)])
def test_min_steps_boundary(tmp_path, steps, insufficient):
    synthetic_run(tmp_path, steps=steps, forward=40, backward=60)
    assert (diagnose(reduce_run(tmp_path))[0]["kind"] == "INSUFFICIENT_DATA") is insufficient


# M43: MEMORY_PRESSURE judges reserved memory, not allocated, when both are known
def test_memory_pressure_uses_reserved_over_allocated(tmp_path):
    synthetic_run(tmp_path, forward=40, backward=60)
    summary = reduce_run(tmp_path)
    summary["setup"]["total_memory_bytes"] = 80 * 2**30
    summary["overall"]["mem_peak_reserved_bytes"] = 78 * 2**30
    summary["overall"]["mem_peak_allocated_bytes"] = 60 * 2**30
    kinds = {v["kind"]: v for v in diagnose(summary)}
    assert "98% of capacity" in kinds["MEMORY_PRESSURE"]["why"]


# M35: COMPUTE_BOUND names the clock its number comes from
def test_compute_bound_on_the_host_clock_says_step_time(tmp_path):
    # device share 65%, host 90%
    device_rank(tmp_path, (30.0, 35.0, 100.0), input=5.0, forward=45.0, backward=45.0, residual=5.0)
    compute = kinds(reduce_run(tmp_path))["COMPUTE_BOUND"]
    assert compute["why"].endswith("of step time.")
