"""What the telemetry sampler (traceml/capture/telemetry.py) costs: its CPU, and step time
side by side.

1. One sample: the time of HostProbe.read() (psutil over /proc), with 0 and with 2 child
   processes standing in for DataLoader workers.
2. Its CPU at the real rate: a sampler at SAMPLE_INTERVAL_S (1 s) for --seconds, its thread's
   CPU time (what the rank file's telemetry_cpu_us reports) as a share of one core.
3. Step time side by side: a CPU-bound "training step" (pure Python, ~5 ms) timed in blocks,
   alternating sampler off / on (A B A B ...), medians compared; and the same with the sampler
   at 100 Hz, which exaggerates its effect 100-fold to show what the 1 Hz figure hides in noise.

Prints measurements; asserts nothing. Usage: python benchmarks/telemetry.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from traceml.capture import telemetry


def one_sample_us(probe: telemetry.HostProbe, count: int = 200) -> float:
    probe.read(time.perf_counter())
    start = time.perf_counter()
    for _ in range(count):
        probe.read(time.perf_counter())
    return (time.perf_counter() - start) / count * 1e6


def step(work: int = 60_000) -> None:
    total = 0
    for value in range(work):
        total += value * value
    del total


def block_ms(steps: int = 40) -> float:
    """Median step time (ms) over one block of steps."""
    times = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        step()
        times.append((time.perf_counter_ns() - start) / 1e6)
    return statistics.median(times)


def side_by_side(interval_s: float, blocks: int) -> tuple[float, float, float]:
    """Median step ms without and with a sampler at interval_s; the sampler's CPU share."""
    off, on = [], []
    cpu_ns = span_ns = 0
    for _ in range(blocks):
        off.append(block_ms())
        sampler = telemetry.TelemetrySampler(
            origin_ns=time.perf_counter_ns(), host=telemetry.HostProbe(), interval_s=interval_s
        )
        began = time.perf_counter_ns()
        sampler.start()
        on.append(block_ms())
        sampler.stop()
        cpu_ns += sampler.cpu_ns
        span_ns += time.perf_counter_ns() - began
    return statistics.median(off), statistics.median(on), 100.0 * cpu_ns / span_ns


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--blocks", type=int, default=15)
    args = parser.parse_args()

    probe = telemetry.HostProbe()
    print(f"one sample, no children:   {one_sample_us(probe):8.1f} us")
    children = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)
    ]
    try:
        time.sleep(0.2)
        print(f"one sample, 2 children:    {one_sample_us(telemetry.HostProbe()):8.1f} us")
    finally:
        for child in children:
            child.kill()
            child.wait()

    sampler = telemetry.TelemetrySampler(
        origin_ns=time.perf_counter_ns(), host=telemetry.HostProbe()
    )
    began = time.perf_counter_ns()
    sampler.start()
    time.sleep(args.seconds)
    samples = len(sampler.stop())
    share = 100.0 * sampler.cpu_ns / (time.perf_counter_ns() - began)
    print(
        f"sampler at {telemetry.SAMPLE_INTERVAL_S:g} s for {args.seconds:g} s: {samples} samples, "
        f"{sampler.cpu_ns / 1e3 / max(samples, 1):.0f} us CPU each, {share:.4f}% of one core"
    )

    for interval in (telemetry.SAMPLE_INTERVAL_S, 0.01):
        off, on, cpu = side_by_side(interval, args.blocks)
        print(
            f"step time, sampler every {interval:g} s: off {off:.3f} ms, on {on:.3f} ms "
            f"({(on / off - 1) * 100:+.2f}%); sampler CPU {cpu:.3f}% of one core"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
