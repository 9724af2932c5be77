"""Step records on the training's hot path: bytes per line, and the cost of making and
serialising one (issue 24).

Runs the real StepClock (boundary timestamps in, record out) plus the sink's serialisation
(orjson.dumps with a newline, as RankSink.append does) for a CPU single-process step and a
DDP step (comm timing on), alternating two step_clock modules side by side when ``--before``
names an older copy of ``traceml/capture/step_clock.py``. The CUDA DDP size is measured on a
synthetic record: the host fields from the clock plus the device fields CudaStepTimer fills
in (whole microseconds, zero comm phases left out, short keys: rank schema 2.0).

    python benchmarks/step_record.py [--before /tmp/step_clock_old.py] [--steps 200000]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from traceml import schema  # noqa: E402
from traceml.step_record import STEP_KEYS  # noqa: E402

MS = 1_000_000
_NEWLINE = orjson.OPT_APPEND_NEWLINE


def load_clock(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.StepClock


def one_step(clock, t0: int, index: int, comm: bool, timer: list[int] | None = None) -> dict:
    """A step with realistic, irregular nanosecond timestamps (fetch, h2d, fwd, bwd, opt)."""
    j = (index * 7919) % 1000
    clock.fetched(t0, t0 + 250_123 + j)
    clock.transfer_started()
    clock.transferred(t0 + 300_017, t0 + 420_991 + j)
    clock.forward_started(t0 + 500_333)
    clock.forward_ended(t0 + 4_700_457 + j)
    clock.backward_started(t0 + 4_800_001)
    if comm:
        clock.collective(schema.BACKWARD, 2_345_678 + j, nbytes=102_760_448, count=26)
    clock.backward_ended(t0 + 13_900_123 + j)
    clock.optimizer_started(t0 + 14_000_777)
    start = time.perf_counter_ns()
    record = clock.batch_ended(t0 + 15_100_999 + j, global_step=index + 1, epoch=0)
    # What the session adds: RSS (on most steps) and traceml's own cost.
    key = _keys_of(record)
    record[key(schema.RSS)] = 1_234_567_890
    record[key(schema.TRACEML_COST_US)] = round(41.7 + j / 1000, 1)
    line = orjson.dumps(record, option=_NEWLINE)
    if timer is not None:
        timer[0] += time.perf_counter_ns() - start
        timer[1] += len(line)
    return record


def _keys_of(record: dict):
    """How ``record``'s writer spells a field: a short key (rank schema 2.0) or its name."""
    if dict.__contains__(record, schema.STEP):  # an older clock
        return lambda name: name
    return lambda name: STEP_KEYS[name]


def measure(StepClock, steps: int, comm: bool) -> tuple[float, float]:
    """(ns per step to close the record and serialise it, mean bytes per line)."""
    clock = StepClock(origin_ns=10_000 * MS)
    clock.comm_enabled = comm
    timer = [0, 0]
    t = 10_000 * MS + 3_600_000 * MS  # an hour into the run: t_ms has 7 integer digits
    for index in range(steps):
        one_step(clock, t, index, comm, timer)
        t += 15_500_000
    return timer[0] / steps, timer[1] / steps


def cuda_ddp_line(StepClock) -> int:
    clock = StepClock(origin_ns=0)
    clock.comm_enabled = True
    record = one_step(clock, 3_600_000 * MS, 54321, True)
    key = _keys_of(record)
    record.update(
        {
            key(name): value
            for name, value in {
                schema.GPU_H2D: 0.118,
                schema.GPU_FORWARD: 4.102,
                schema.GPU_BACKWARD: 11.871,
                schema.GPU_OPTIMIZER: 1.033,
                schema.GPU_STEP: 15.002,
                schema.MEM_PEAK_ALLOCATED: 42_949_672_960,
                schema.MEM_PEAK_RESERVED: 51_539_607_552,
                schema.GPU_COMM: 2.345,
                schema.GPU_COMM_OF_PHASE[schema.BACKWARD]: 2.345,
            }.items()
        }
    )
    return len(orjson.dumps(record, option=_NEWLINE))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, help="an older step_clock.py to compare with")
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sides = {"now": load_clock(ROOT / "traceml/capture/step_clock.py", "clock_now")}
    if args.before:
        sides = {"before": load_clock(args.before, "clock_before"), **sides}
    for comm, label in ((False, "CPU, one process"), (True, "DDP (comm timing)")):
        times: dict[str, list[float]] = {name: [] for name in sides}
        sizes: dict[str, float] = {}
        for _ in range(args.repeats):  # alternating: noise hits both sides alike
            for name, clock in sides.items():
                ns, size = measure(clock, args.steps, comm)
                times[name].append(ns)
                sizes[name] = size
        for name in sides:
            print(
                f"{label:18s} {name:6s}: {sizes[name]:6.1f} bytes per step line; record+dumps "
                f"median {statistics.median(times[name]) / 1000:.2f} us per step "
                f"(min {min(times[name]) / 1000:.2f})"
            )
    for name, clock in sides.items():
        print(f"CUDA DDP (synthetic device fields) {name:6s}: {cuda_ddp_line(clock)} bytes")


if __name__ == "__main__":
    main()
