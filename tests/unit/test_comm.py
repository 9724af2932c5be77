"""Waits on other ranks: phase attribution in the clock, the collective and bucket timers with
fakes (no torch), and an NCCL-like two-rank simulation with fake CUDA events."""

from __future__ import annotations

import types

import pytest

from traceml import schema
from traceml.analysis.diagnose import diagnose
from traceml.analysis.reduce import reduce_run
from traceml.capture.cuda_timing import CudaStepTimer
from traceml.capture.instruments.distributed import COLLECTIVES, CommTimer, payload_bytes
from traceml.capture.step_clock import StepClock
from traceml.finalize import summarise

from rankfiles import footer, header, synthetic_run, write_rank, write_run

MS = 1_000_000


class FakeClock:
    def __init__(self) -> None:
        self.t = 0

    def __call__(self) -> int:
        return self.t

    def advance(self, ms: float) -> None:
        self.t += int(ms * MS)


class Tensor:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def open_step(clock: StepClock) -> None:
    clock.fetched(0, 1 * MS)


# ----------------------------------------------------------------------------------------------
# The clock


def test_current_phase_follows_the_hooks_and_waits_stay_inside_their_phase():
    clock = StepClock(origin_ns=0, comm_enabled=True)
    assert clock.current_phase() is None  # between steps: not ours
    clock.fetched(0, 10 * MS)
    assert clock.current_phase() == schema.RESIDUAL
    clock.transfer_started()
    assert clock.current_phase() == schema.H2D
    clock.transferred(10 * MS, 12 * MS)
    assert clock.current_phase() == schema.RESIDUAL
    clock.forward_started(12 * MS)
    assert clock.current_phase() == schema.FORWARD
    clock.forward_ended(40 * MS)
    clock.collective(clock.current_phase(), 5 * MS, nbytes=8)  # the loss's all_reduce
    clock.backward_started(50 * MS)
    assert clock.current_phase() == schema.BACKWARD
    clock.collective(schema.BACKWARD, 30 * MS, nbytes=4000, count=3)
    clock.backward_ended(90 * MS)
    assert clock.current_phase() == schema.RESIDUAL
    clock.optimizer_started(90 * MS)
    assert clock.current_phase() == schema.OPTIMIZER
    record = clock.batch_ended(100 * MS)
    assert clock.current_phase() is None
    assert record[schema.COMM_OF_PHASE[schema.BACKWARD]] == 30.0
    assert record[schema.COMM_OF_PHASE[schema.RESIDUAL]] == 5.0
    assert record[schema.COMM_OF_PHASE[schema.FORWARD]] == 0.0
    assert record[schema.COMM] == 35.0
    assert (record[schema.COMM_COUNT], record[schema.COMM_BYTES]) == (4, 4008)
    # The waits are inside the phases: the phases still add up to the step.
    assert sum(record[p] for p in schema.PHASES) == pytest.approx(record[schema.STEP])
    assert record[schema.RESIDUAL] >= record[schema.COMM_OF_PHASE[schema.RESIDUAL]]


def test_a_wait_longer_than_its_phase_is_cut_to_the_phase():
    clock = StepClock(origin_ns=0, comm_enabled=True)
    open_step(clock)
    clock.backward_started(2 * MS)
    clock.collective(schema.BACKWARD, 50 * MS)  # clock edges: more than the phase lasted
    clock.backward_ended(12 * MS)
    clock.optimizer_started(12 * MS)
    record = clock.batch_ended(13 * MS)
    assert record[schema.BACKWARD] == 10.0
    assert record[schema.COMM_OF_PHASE[schema.BACKWARD]] == 10.0


def test_single_process_comm_fields_are_null_not_zero():
    clock = StepClock(origin_ns=0)
    open_step(clock)
    clock.optimizer_started(2 * MS)
    record = clock.batch_ended(3 * MS)
    assert all(record[f] is None for f in schema.COMM_FIELDS)


# ----------------------------------------------------------------------------------------------
# Collectives


def fake_dist(now: FakeClock, log: list[str]) -> types.SimpleNamespace:
    dist = types.SimpleNamespace()
    dist.Work = type("Work", (FakeWork,), {})  # one class per test: wait() is wrapped on it

    def all_reduce(tensor, op=None, group=None, async_op=False):
        log.append("all_reduce")
        if async_op:
            return dist.Work(now, log)
        now.advance(7)
        return None

    def barrier(group=None, async_op=False):
        log.append("barrier")
        now.advance(3)

    def all_gather_object(output, obj, group=None):
        log.append("all_gather_object")
        dist.all_reduce(Tensor(8))  # torch's own inner collective: not counted again
        now.advance(1)

    def broadcast(tensor, src, group=None, async_op=False):
        raise RuntimeError("the user's broadcast failed")

    dist.all_reduce = all_reduce
    dist.barrier = barrier
    dist.all_gather_object = all_gather_object
    dist.broadcast = broadcast
    return dist


class FakeWork:
    def __init__(self, now: FakeClock, log: list[str]) -> None:
        self.now, self.log = now, log
        self.note = "original"

    def wait(self, timeout=None):
        self.log.append("wait")
        self.now.advance(11)
        return True


def timed_setup():
    now = FakeClock()
    log: list[str] = []
    failures: list[str] = []
    clock = StepClock(origin_ns=0, comm_enabled=True)
    timer = CommTimer(on_failure=failures.append, now=now)
    timer.clock = clock
    dist = fake_dist(now, log)
    originals = dict(vars(dist))
    timer.install_collectives(dist)
    timer.active = True
    return now, log, failures, clock, timer, dist, originals


def test_collectives_are_timed_in_their_phase_once_each():
    now, log, failures, clock, _timer, dist, _ = timed_setup()
    dist.all_reduce(Tensor(400))  # outside a step: passes through untimed
    open_step(clock)
    clock.forward_started(now())
    dist.barrier()
    clock.forward_ended(now())
    dist.all_reduce(Tensor(400))
    dist.all_gather_object([None, None], {"x": 1})
    clock.optimizer_started(now())
    record = clock.batch_ended(now())
    assert record[schema.COMM_OF_PHASE[schema.FORWARD]] == 3.0
    assert record[schema.COMM_OF_PHASE[schema.RESIDUAL]] == 7.0 + 8.0
    assert record[schema.COMM_COUNT] == 3  # the inner all_reduce is part of all_gather_object
    assert record[schema.COMM_BYTES] == 400  # object collectives carry no tensor payload
    assert log.count("all_reduce") == 3 and not failures


def test_async_collective_is_timed_at_its_wait():
    now, _log, _failures, clock, _timer, dist, _ = timed_setup()
    open_step(clock)
    work = dist.all_reduce(Tensor(64), async_op=True)
    assert type(work) is dist.Work and work.note == "original"  # torch's own object
    clock.backward_started(now())
    assert work.wait() is True
    clock.backward_ended(now())
    clock.optimizer_started(now())
    record = clock.batch_ended(now())
    assert record[schema.COMM_OF_PHASE[schema.BACKWARD]] == 11.0
    assert record[schema.COMM_COUNT] == 1 and record[schema.COMM_BYTES] == 64


def test_the_users_error_passes_through_and_nothing_is_counted():
    now, _log, failures, clock, _timer, dist, _ = timed_setup()
    open_step(clock)
    with pytest.raises(RuntimeError, match="the user's broadcast failed"):
        dist.broadcast(Tensor(4), 0)
    clock.optimizer_started(now())
    record = clock.batch_ended(now())
    assert record[schema.COMM_COUNT] == 0 and not failures


def test_a_failure_in_the_timing_turns_it_off_and_the_call_still_runs_once():
    _now, log, failures, clock, _timer, dist, _ = timed_setup()
    open_step(clock)

    def broken() -> str:
        raise ValueError("bookkeeping bug")

    clock.current_phase = broken
    assert dist.all_reduce(Tensor(4)) is None
    assert log == ["all_reduce"]
    assert (
        len(failures) == 1
        and "distributed.collective_start failed (ValueError: bookkeeping bug)" in (failures[0])
    )
    dist.all_reduce(Tensor(4))  # off now: straight through, no second warning
    assert log == ["all_reduce", "all_reduce"] and len(failures) == 1


def test_uninstall_puts_the_originals_back():
    _now, _log, _failures, _clock, timer, dist, originals = timed_setup()
    assert dist.all_reduce is not originals["all_reduce"]
    assert dist.all_reduce.__name__ == "all_reduce"  # wrapped like the original
    timer.uninstall()
    assert vars(dist) == originals
    assert "wait" not in vars(dist.Work)


def test_payload_bytes():
    assert payload_bytes((Tensor(10),), {}) == 10
    assert payload_bytes(([Tensor(10), Tensor(5)], Tensor(1)), {}) == 15
    assert payload_bytes((), {"tensor": Tensor(3)}) == 3
    assert payload_bytes((None,), {}) == 0
    assert {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier"} <= set(
        COLLECTIVES
    )


# ----------------------------------------------------------------------------------------------
# DDP gradient buckets


class Buffer:
    def numel(self) -> int:
        return 250

    def element_size(self) -> int:
        return 4


class Bucket:
    def buffer(self) -> Buffer:
        return Buffer()


class FakeFuture:
    def __init__(self) -> None:
        self.callbacks = []

    def then(self, callback):
        chained = FakeFuture()
        self.callbacks.append((callback, chained))
        return chained

    def value(self):
        return "bucket tensor"

    def complete(self):
        return [callback(self) for callback, _ in self.callbacks]


def test_bucket_wait_is_hook_time_plus_the_tail_after_the_last_launch():
    now = FakeClock()
    clock = StepClock(origin_ns=0, comm_enabled=True)
    timer = CommTimer(on_failure=lambda reason: None, now=now)
    timer.clock, timer.active = clock, True
    futures = []

    def default_hook(state, bucket):
        now.advance(1)  # launching takes 1 ms of host time
        futures.append(FakeFuture())
        return futures[-1]

    hook = timer.bucket_hook(default_hook)
    assert hook.__name__ == "default_hook"
    open_step(clock)
    timer.backward_started()
    clock.backward_started(now())
    now.t = 10 * MS
    hook(None, Bucket())
    now.t = 20 * MS
    hook(None, Bucket())  # last launch ends at 21 ms
    now.t = 25 * MS
    assert futures[0].complete() == ["bucket tensor"]
    now.t = 60 * MS  # the slow rank arrived: the last bucket completes
    futures[1].complete()
    now.t = 61 * MS
    timer.backward_finished()
    clock.backward_ended(now())
    clock.optimizer_started(now())
    record = clock.batch_ended(now())
    assert record[schema.COMM_OF_PHASE[schema.BACKWARD]] == pytest.approx(2 + 39)
    assert record[schema.COMM_COUNT] == 2 and record[schema.COMM_BYTES] == 2000


def test_bucket_hook_outside_a_step_or_when_off_passes_straight_through():
    clock = StepClock(origin_ns=0, comm_enabled=True)
    timer = CommTimer(on_failure=lambda reason: None)
    timer.clock, timer.active = clock, True
    plain = FakeFuture()
    hook = timer.bucket_hook(lambda state, bucket: plain)
    assert hook(None, Bucket()) is plain  # no step open
    timer.active = False
    open_step(clock)
    assert hook(None, Bucket()) is plain


# ----------------------------------------------------------------------------------------------
# NCCL-like: the host never blocks; only device events show who waited


class Device:
    def __init__(self) -> None:
        self.now = 0.0


class Event:
    def __init__(self, device: Device) -> None:
        self.device, self.time = device, None

    def record(self) -> None:
        self.time = self.device.now

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: Event) -> float:
        return end.time - self.time


def simulate_nccl_rank(
    rank: int, forward_ms: list[float], completions: list[float], starts: list[float]
) -> list[dict]:
    """One rank's steps: forward on the device, then the loss's all_reduce (host returns at
    once; the device stream waits until ``completions[i]``), backward, optimizer."""
    host = FakeClock()
    device = Device()
    clock = StepClock(origin_ns=0, comm_enabled=True)
    gpu = CudaStepTimer(new_event=lambda: Event(device), comm_enabled=True)
    timer = CommTimer(on_failure=lambda reason: pytest.fail(reason), now=host)
    timer.clock, timer.gpu, timer.active = clock, gpu, True
    dist = types.SimpleNamespace()
    index = {"step": 0}

    def all_reduce(tensor, op=None, group=None, async_op=False):
        device.now = completions[index["step"]]  # NCCL: the stream waits for the last rank

    dist.all_reduce = all_reduce
    timer.install_collectives(dist)
    records = []
    for step, forward in enumerate(forward_ms):
        index["step"] = step
        device.now = starts[step]
        host.advance(1)
        clock.fetched(host() - MS, host())
        gpu.step_started()
        clock.forward_started(host())
        gpu.phase_started("forward")
        device.now += forward
        host.advance(0.5)
        gpu.phase_ended("forward")
        clock.forward_ended(host())
        dist.all_reduce(Tensor(4))
        clock.backward_started(host())
        gpu.phase_started("backward")
        device.now += 20.0
        host.advance(0.5)
        gpu.phase_ended("backward")
        clock.backward_ended(host())
        clock.optimizer_started(host())
        gpu.phase_started("optimizer")
        device.now += 5.0
        host.advance(0.5)
        record = clock.batch_ended(host())
        gpu.step_ended(record)
        records.extend(gpu.ready())
    return records


def test_nccl_like_straggler_is_found_from_device_waits(tmp_path):
    steps = 20
    forward = {0: [30.0] * steps, 1: [30.0 + 25.0] * steps}  # rank 1: +25 ms of forward
    starts = [100.0 * i for i in range(steps)]
    completions = [
        start + max(forward[0][i], forward[1][i]) + 2.0 for i, start in enumerate(starts)
    ]
    for rank in (0, 1):
        records = simulate_nccl_rank(rank, forward[rank], completions, starts)
        assert all(r[schema.COMM] == 0.0 for r in records)  # the host never waited
        write_rank(
            tmp_path,
            rank,
            [
                header(rank, 2, timing="host+cuda_events", comm_timing="host+cuda_events"),
                *records,
                footer(len(records)),
            ],
        )
    summary = reduce_run(tmp_path)
    ranks = summary["ranks"]
    assert ranks[0]["phases"][schema.GPU_COMM]["median"] == pytest.approx(27.0)
    assert ranks[1]["phases"][schema.GPU_COMM]["median"] == pytest.approx(2.0)
    verdict = next(v for v in diagnose(summary) if v["kind"] == "STRAGGLER")
    assert verdict["evidence"]["rank"] == 1
    assert verdict["evidence"]["method"] == "device"
    assert verdict["evidence"]["cause_phase"] == schema.FORWARD
    assert verdict["evidence"]["cost_ms_per_step"] == pytest.approx(25.0, abs=0.5)
    assert summary["imbalance"]["slowest_rank"] == 1


# ----------------------------------------------------------------------------------------------
# From waits to verdicts and the report (hand-made rank files, gloo-like: the host waits)


def test_a_rank_slow_in_forward_is_the_straggler_not_the_rank_that_waits(tmp_path):
    # Rank 1's forward is 40 ms longer; rank 0 waits for it in the loss's all_reduce
    # (Residual). Step times are equal, as under DDP.
    base = dict(input=5, forward=30, backward=40, optimizer=10)
    synthetic_run(
        tmp_path,
        ranks=2,
        noise=0.01,
        per_rank={
            0: {**base, "residual": 45, "comm_residual": 40, "comm_backward": 8},
            1: {**base, "forward": 70, "residual": 5, "comm_backward": 8},
        },
    )
    summary, text = summarise(tmp_path, html=True)
    straggler = next(v for v in summary["verdicts"] if v["kind"] == "STRAGGLER")
    assert straggler["evidence"]["rank"] == 1
    assert straggler["evidence"]["method"] == "waits"
    assert straggler["evidence"]["cause_phase"] == schema.FORWARD
    assert straggler["evidence"]["cost_ms_per_step"] == pytest.approx(40, rel=0.1)
    assert "It costs the job about" in straggler["why"]
    # Rank 0's waiting is not its own Residual: no RESIDUAL_HEAVY.
    assert "RESIDUAL_HEAVY" not in [v["kind"] for v in summary["verdicts"]]
    assert summary["imbalance"]["slowest_rank"] == 1
    rank_rows = [line for line in text.splitlines() if line.startswith(("  0 ", "  1 "))]
    assert "(slowest)" in rank_rows[1] and "(slowest)" not in rank_rows[0]
    assert "Comm wait" in text and "Own" in text
    html = (tmp_path / schema.REPORT_HTML).read_text()
    assert "Comm wait (inside)" in html and "median own ms" in html


def test_every_rank_waiting_alike_is_comm_bound_and_balanced_ranks_are_not_stragglers(tmp_path):
    phases = dict(input=5, forward=30, backward=80, optimizer=10, residual=5, comm_backward=45)
    synthetic_run(tmp_path / "slow-network", ranks=4, noise=0.03, **phases)
    verdicts = summarise(tmp_path / "slow-network")[0]["verdicts"]
    kinds = [v["kind"] for v in verdicts]
    assert "COMM_BOUND" in kinds and "STRAGGLER" not in kinds
    comm = next(v for v in verdicts if v["kind"] == "COMM_BOUND")
    assert comm["evidence"]["least_share"] == pytest.approx(45 / 130, rel=0.1)
    assert "Backward" in comm["why"]

    quiet = dict(phases, backward=40, comm_backward=3)
    synthetic_run(tmp_path / "balanced", ranks=4, noise=0.03, **quiet)
    kinds = [v["kind"] for v in summarise(tmp_path / "balanced")[0]["verdicts"]]
    assert "COMM_BOUND" not in kinds and "STRAGGLER" not in kinds


# ----------------------------------------------------------------------------------------------
# Transparency and threads (issue 20)


def test_an_async_collectives_work_is_torchs_own_object():
    _now, log, _failures, clock, _timer, dist, _ = timed_setup()
    open_step(clock)
    work = dist.all_reduce(Tensor(64), async_op=True)
    assert isinstance(work, dist.Work) and type(work) is dist.Work
    assert work.wait() is True and log == ["all_reduce", "wait"]


def test_a_collective_from_another_thread_is_not_charged_to_the_training_step():
    import threading

    now, log, failures, clock, _timer, dist, _ = timed_setup()
    open_step(clock)
    clock.forward_started(now())
    thread = threading.Thread(target=dist.barrier)  # e.g. async checkpointing's sync
    thread.start()
    thread.join(10)
    dist.barrier()  # the training thread's own: counted
    clock.forward_ended(now())
    clock.optimizer_started(now())
    record = clock.batch_ended(now())
    assert log == ["barrier", "barrier"] and not failures
    assert record[schema.COMM_COUNT] == 1
    assert record[schema.COMM_OF_PHASE[schema.FORWARD]] == 3.0


def test_a_timed_call_on_another_thread_does_not_hide_the_training_threads_collective():
    """The nesting depth is per thread: while another thread is inside a timed bucket hook,
    the training thread's own collective still counts."""
    import threading

    now, _log, failures, clock, timer, dist, _ = timed_setup()
    inside, release = threading.Event(), threading.Event()

    def slow_hook(state, bucket):
        inside.set()
        release.wait(10)
        return FakeFuture()

    hook = timer.bucket_hook(slow_hook)
    open_step(clock)
    clock.backward_started(now())
    thread = threading.Thread(target=hook, args=(None, Bucket()))  # CUDA: autograd's thread
    thread.start()
    assert inside.wait(10)
    dist.barrier()
    release.set()
    thread.join(10)
    clock.backward_ended(now())
    clock.optimizer_started(now())
    record = clock.batch_ended(now())
    assert record[schema.COMM_OF_PHASE[schema.BACKWARD]] == 3.0 and not failures


def test_nccl_async_wait_starts_at_wait_not_at_launch():
    """Compute between the launch and wait() is not waiting: the device interval starts at
    wait(). The collective completes at device time 15; wait() is at 10: 5 ms waited."""
    host, device = FakeClock(), Device()
    clock = StepClock(origin_ns=0, comm_enabled=True)
    gpu = CudaStepTimer(new_event=lambda: Event(device), comm_enabled=True)
    timer = CommTimer(on_failure=lambda reason: pytest.fail(reason), now=host)
    timer.clock, timer.gpu = clock, gpu
    dist = types.SimpleNamespace()

    class Work:
        def wait(self):
            device.now = max(device.now, 15.0)  # the stream waits for the collective
            return True

    dist.Work = Work

    def all_reduce(tensor, async_op=False):
        return Work() if async_op else None

    dist.all_reduce = all_reduce
    timer.install_collectives(dist)
    timer.active = True
    host.advance(1)
    clock.fetched(0, host())
    gpu.step_started()
    clock.forward_started(host())
    gpu.phase_started("forward")
    work = dist.all_reduce(Tensor(4), async_op=True)  # launched at device time 0
    device.now = 10.0  # compute overlapping the collective
    work.wait()
    device.now = 16.0
    gpu.phase_ended("forward")
    clock.forward_ended(host())
    clock.optimizer_started(host())
    record = clock.batch_ended(host())
    gpu.step_ended(record)
    (done,) = list(gpu.ready())
    assert done[schema.GPU_COMM_OF_PHASE[schema.FORWARD]] == 5.0
    timer.uninstall()


DDP_HOOKS = r"""
import os, sys, json
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from traceml.capture.instruments.distributed import CommTimer
from traceml.capture.step_clock import StepClock

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
calls = []

def user_hook(state, bucket):
    calls.append(state)
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut

def train(ddp):
    ddp(torch.ones(1, 2)).sum().backward()

outcome = {}
for case in ("late", "twice"):
    timer = CommTimer(on_failure=lambda reason: print("FAIL", reason))
    timer.clock = StepClock(origin_ns=0, comm_enabled=True)
    timer.wrap_hook_registration()
    ddp = DDP(torch.nn.Linear(2, 1))
    timer.install_collectives(dist)
    timer.attach_buckets(ddp)  # traceml attached first (on_train_start)
    timer.active = True
    ddp.register_comm_hook("user state", user_hook)  # e.g. the user's own on_train_start
    try:
        if case == "twice":
            ddp.register_comm_hook("again", user_hook)
        outcome[case] = "registered"
    except RuntimeError as exc:
        outcome[case] = str(exc).splitlines()[0]
    train(ddp)
    outcome[case + "_hooks"] = [state for _, state in ddp._comm_hooks]
    timer.uninstall()
outcome["calls"] = calls
print(json.dumps(outcome))
"""


def test_a_user_comm_hook_registered_after_traceml_attached_is_the_one_that_runs(tmp_path):
    """DDP allows one communication hook: the user's, registered after traceml attached,
    must be accepted and run (it raised 'can only be called once'); a second registration
    still fails exactly as untraced."""
    import json
    import random
    import subprocess
    import sys

    script = tmp_path / "ddp_hooks.py"
    script.write_text(DDP_HOOKS)
    port = str(random.randint(20000, 40000))
    result = subprocess.run(
        [sys.executable, str(script), port], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["late"] == "registered"
    assert "can only be called once" in outcome["twice"]
    assert outcome["late_hooks"] == ["user state"]
    assert outcome["calls"] == ["user state", "user state"]


def test_longer_own_time_without_longer_waits_for_the_others_is_no_straggler(tmp_path):
    # Rank 1's own time is 1.5x rank 0's, yet both wait 70 ms a step: nobody waits for rank 1
    # (seen on CI: two ranks on two busy cores, own-time medians apart, waits alike).
    base = dict(input=10, forward=75, backward=320, optimizer=160, residual=30, comm_backward=70)
    per_rank = {1: {**base, "optimizer": 400}}
    synthetic_run(tmp_path / "waits-alike", ranks=2, noise=0.02, per_rank=per_rank, **base)
    kinds = [v["kind"] for v in summarise(tmp_path / "waits-alike")[0]["verdicts"]]
    assert "STRAGGLER" not in kinds
    # The same ranks meeting in the all-reduce: rank 0 now waits for rank 1.
    run = tmp_path / "synchronised"
    synthetic_run(run, ranks=2, noise=0.02, per_rank=per_rank, synchronised=True, **base)
    straggler = next(v for v in summarise(run)[0]["verdicts"] if v["kind"] == "STRAGGLER")
    assert straggler["evidence"]["rank"] == 1
    assert straggler["evidence"]["cause_phase"] == schema.OPTIMIZER
    assert straggler["evidence"]["others_wait_ms"] > straggler["evidence"]["rank_wait_ms"] + 200


def test_a_straggler_the_others_wait_for_only_at_periodic_syncs_is_found(tmp_path):
    # The ranks meet every 4th step only (periodic averaging): rank 0 then waits for the
    # 4 x 40 ms rank 1 fell behind. Its median wait is 0; its mean, 40 ms a step, is the cost.
    steps = 40
    base = dict(input=5, forward=30, backward=40, optimizer=10, residual=5)
    fast = [
        {**base, "residual": 5 + (160 if i % 4 == 3 else 0), "comm_residual": 160 * (i % 4 == 3)}
        for i in range(steps)
    ]
    slow = [{**base, "forward": 70, "comm_residual": 0} for _ in range(steps)]
    write_run(tmp_path, [fast, slow])
    summary = summarise(tmp_path)[0]
    assert summary["imbalance"]["fields"]["comm_ms"]["rank_medians_ms"]["0"] == 0
    straggler = next(v for v in summary["verdicts"] if v["kind"] == "STRAGGLER")
    assert straggler["evidence"]["rank"] == 1
    assert straggler["evidence"]["cause_phase"] == schema.FORWARD
    # What decided is what it shows: the mean wait (~40 ms a step over the steps kept after
    # warm-up), not the median (0).
    assert straggler["evidence"]["wait_statistic"] == "mean"
    assert 38.0 < straggler["evidence"]["others_wait_ms"] < 45.0
    assert "ms per step, by the mean over steps of each" in straggler[schema.VERDICT_WHY]


def test_a_summary_from_a_newer_traceml_re_diagnoses_despite_unknown_thresholds(tmp_path):
    """A newer traceml stores thresholds this version does not know: re-diagnosing its
    summary skips them (the user's own overrides stay strict)."""
    base = dict(input=5, forward=30, backward=40, optimizer=10, residual=5, comm_backward=3)
    synthetic_run(tmp_path, ranks=2, noise=0.02, synchronised=True, **base)
    summary = summarise(tmp_path)[0]
    expected = [v[schema.VERDICT_KIND] for v in diagnose(summary)]
    summary[schema.SUMMARY_THRESHOLDS] = {
        **summary[schema.SUMMARY_THRESHOLDS],
        "added_in_a_later_version": 3.0,
    }
    assert [v[schema.VERDICT_KIND] for v in diagnose(summary)] == expected
    with pytest.raises(ValueError, match="unknown threshold"):
        diagnose(summary, {"added_in_a_later_version": 3.0})
