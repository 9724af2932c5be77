"""What timing a collective costs: traceml's wrapper per torch.distributed call, measured.

(a) The wrapper alone, around a collective that returns at once (so nothing but traceml's own
    work is measured): per-call time wrapped minus plain, inside an open step, sync and
    async (launch + wait), and a DDP bucket hook (launch + completion callback).
(b) Real gloo all_reduce of a 4-byte tensor between 2 processes on this machine, timed vs
    plain, alternating blocks: the ratio, and the per-call difference.

    python benchmarks/collective_cost.py            # ~1 minute
    python benchmarks/collective_cost.py --calls 20000 --blocks 9

Prints measurements, asserts nothing; target: under 5 us per collective.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

from _common import PYTHON, clean_env, run, values

from traceml.capture.instruments.distributed import CommTimer
from traceml.capture.step_clock import StepClock

GLOO_WORKER = """
import os, sys, time, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from traceml.capture.step_clock import StepClock
from traceml.capture.instruments.distributed import CommTimer
dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2,
                        init_method="file://" + {store!r})
calls, blocks = {calls}, {blocks}
tensor = torch.ones(1)
clock = StepClock(origin_ns=0, comm_enabled=True)
clock.fetched(0, 1)
timer = CommTimer(on_failure=print)
timer.clock = clock
plain = dist.all_reduce
timer.install_collectives(dist)
timed = dist.all_reduce
timer.active = True
results = {{"plain": [], "timed": []}}
for block in range(blocks):
    for name, fn in (("plain", plain), ("timed", timed)) if block % 2 else (
        ("timed", timed), ("plain", plain)):
        dist.barrier()
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn(tensor)
        results[name].append((time.perf_counter_ns() - start) / calls / 1000)
if dist.get_rank() == 0:
    p = sorted(results["plain"]); t = sorted(results["timed"])
    print("GLOO plain_us=%.3f timed_us=%.3f" % (p[len(p)//2], t[len(t)//2]))
dist.destroy_process_group()
"""


def wrapper_cost(calls: int, blocks: int) -> dict[str, float]:
    """Per-call cost of the wrappers around instant collectives, median of blocks (us)."""
    clock = StepClock(origin_ns=0, comm_enabled=True)
    clock.fetched(0, 1)
    timer = CommTimer(on_failure=print)
    timer.clock = clock

    class Work:
        def wait(self):
            return True

    class Future:
        def then(self, callback):
            callback(self)
            return self

        def value(self):
            return None

    class Buffer:
        def numel(self):
            return 1

        def element_size(self):
            return 4

    class Bucket:
        def buffer(self):
            return Buffer()

    tensor = types.SimpleNamespace(nbytes=4)
    dist = types.SimpleNamespace(
        all_reduce=lambda tensor, async_op=False: Work() if async_op else None
    )
    plain_sync = dist.all_reduce
    timer.install_collectives(dist)
    timed_sync = dist.all_reduce
    timer.active = True

    def plain_async() -> None:
        plain_sync(tensor, async_op=True).wait()

    def timed_async() -> None:
        timed_sync(tensor, async_op=True).wait()

    def hook(state, bucket):
        return Future()

    timed_hook = timer.bucket_hook(hook)
    bucket = Bucket()

    def plain_bucket() -> None:
        hook(None, bucket)

    def timed_bucket() -> None:
        timed_hook(None, bucket)
        if timer._bucket_count >= 1000:  # what on_after_backward does once per backward
            timer.backward_finished()

    pairs = {
        "sync": (lambda: plain_sync(tensor), lambda: timed_sync(tensor)),
        "async": (plain_async, timed_async),
        "bucket": (plain_bucket, timed_bucket),
    }
    costs: dict[str, float] = {}
    for name, (plain, timed) in pairs.items():
        samples = {"plain": [], "timed": []}
        for block in range(blocks):
            order = (("plain", plain), ("timed", timed))
            for label, fn in order if block % 2 else order[::-1]:
                start = time.perf_counter_ns()
                for _ in range(calls):
                    fn()
                samples[label].append((time.perf_counter_ns() - start) / calls / 1000)
        costs[name] = statistics.median(samples["timed"]) - statistics.median(samples["plain"])
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--gloo-calls", type=int, default=2000)
    args = parser.parse_args()

    costs = wrapper_cost(args.calls, args.blocks)
    for name, cost in costs.items():
        print(f"wrapper cost per {name} collective: {cost:.2f} us")

    with tempfile.TemporaryDirectory(prefix="traceml-gloo-") as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(
            GLOO_WORKER.format(
                root=str(Path(__file__).resolve().parent.parent),
                store=str(Path(tmp) / "store"),
                calls=args.gloo_calls,
                blocks=args.blocks,
            )
        )
        import subprocess

        env = clean_env()
        other = subprocess.Popen([PYTHON, str(script), "1"], env=env, cwd=tmp)
        result = run([PYTHON, script, "0"], env, Path(tmp))
        other.wait(timeout=120)
        gloo = values(result.stdout, "GLOO")
    difference = gloo["timed_us"] - gloo["plain_us"]
    print(
        f"gloo all_reduce (4 bytes, 2 processes): plain {gloo['plain_us']:.1f} us, "
        f"timed {gloo['timed_us']:.1f} us per call "
        f"(ratio {gloo['timed_us'] / gloo['plain_us']:.3f})"
    )
    print(
        f"SUMMARY collective_cost: wrapper {costs['sync']:.2f} us per sync collective, "
        f"{costs['async']:.2f} us per async (launch + wait), {costs['bucket']:.2f} us per DDP "
        f"bucket [target < 5 us]; real gloo all_reduce +{difference:.1f} us per call "
        f"(ratio {gloo['timed_us'] / gloo['plain_us']:.3f}; machine noise included)"
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
