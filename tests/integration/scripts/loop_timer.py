"""LOOP_TIMER=1: print the time spent in Lightning's per-batch training loop body at exit.

Used by benchmarks/overhead.py to compare plain and traced training on the loop itself
(fetch, transfer, step, batch-end hooks), without validation, checkpoints or imports. The
wrapper is the same in both variants; without LOOP_TIMER nothing is installed.
"""

from __future__ import annotations

import atexit
import importlib
import os
import time


def install(package: str) -> None:
    if not os.environ.get("LOOP_TIMER"):
        return
    loop_class = importlib.import_module(f"{package}.loops.training_epoch_loop")._TrainingEpochLoop
    original = loop_class.advance
    # cpu_seconds: the process's CPU time (every thread) in the loop body; on a shared machine
    # it is far less disturbed by other processes than the wall time.
    # p25_seconds: the batches' 25th-percentile wall time times their count; batches slowed by
    # other processes sit above it, so it barely moves with the machine's load.
    totals = {"seconds": 0.0, "cpu_seconds": 0.0, "batches": 0}
    # Under callgrind (benchmarks/overhead.py --clock instructions): count the instructions of
    # a window of batches; benchmarks/ is on PYTHONPATH then.
    window = None
    if os.environ.get("CG_LIBRARY"):
        import callgrind_window

        callgrind_window.scale_intervals(float(os.environ["CG_SCALE"]))
        window = callgrind_window.from_environment()
    durations: list[float] = []
    cpu = time.process_time
    # A batch is timed from the class's advance to the loop's on_advance_end: traceml ends its
    # step in an instance-level wrapper around advance (lightning_instruments), after the
    # class's advance returns; its door must be inside the window. A batch whose advance
    # raised (the epoch's end: StopIteration) is not counted.
    open_batch: list[tuple[float, float]] = []
    original_end = loop_class.on_advance_end

    barrier = os.environ.get("LOOP_BARRIER")

    def advance(self, data_fetcher):
        if barrier and not totals["batches"] and not open_batch:
            wait_at_barrier(barrier)
        if window is not None:
            window.before()
        open_batch[:] = [(time.perf_counter(), cpu())]
        return original(self, data_fetcher)

    def on_advance_end(self, data_fetcher):
        if open_batch:
            start, cpu_start = open_batch.pop()
            if window is not None:
                window.after()
            totals["cpu_seconds"] += cpu() - cpu_start
            elapsed = time.perf_counter() - start
            totals["seconds"] += elapsed
            totals["batches"] += 1
            durations.append(elapsed)
        return original_end(self, data_fetcher)

    def report() -> None:
        ordered = sorted(durations) or [0.0]
        p25 = ordered[len(ordered) // 4] * len(durations)
        p50 = ordered[len(ordered) // 2] * len(durations)
        print(
            f"LOOP_TIMER seconds={totals['seconds']:.6f} cpu_seconds={totals['cpu_seconds']:.6f} "
            f"p25_seconds={p25:.6f} p50_seconds={p50:.6f} batches={totals['batches']}",
            flush=True,
        )
        # LOOP_TIMER_DURATIONS=<path>: every batch's wall time in ns, one per line, in order
        # (benchmarks/overhead_tail.py: where in the distribution the added time lies).
        dump = os.environ.get("LOOP_TIMER_DURATIONS")
        if dump:
            with open(dump, "w") as out:
                out.write("".join(f"{round(d * 1e9)}\n" for d in durations))

    loop_class.advance = advance
    loop_class.on_advance_end = on_advance_end
    atexit.register(report)


def wait_at_barrier(folder: str, timeout_s: float = 300.0) -> None:
    """LOOP_BARRIER=<folder> (benchmarks/overhead.py --side-by-side): before the first batch, say
    so (``ready-<pid>``) and wait for ``go``, so that runs started together time their loops
    over the same seconds of the machine's load, whatever their start-up took."""
    os.close(os.open(os.path.join(folder, f"ready-{os.getpid()}"), os.O_CREAT | os.O_WRONLY))
    go, deadline = os.path.join(folder, "go"), time.monotonic() + timeout_s
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.001)
