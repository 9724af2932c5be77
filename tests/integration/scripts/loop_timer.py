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
    totals = {"seconds": 0.0, "cpu_seconds": 0.0, "batches": 0}
    cpu = time.process_time

    def advance(self, data_fetcher):
        start, cpu_start = time.perf_counter(), cpu()
        try:
            return original(self, data_fetcher)
        finally:
            totals["cpu_seconds"] += cpu() - cpu_start
            totals["seconds"] += time.perf_counter() - start
            totals["batches"] += 1

    loop_class.advance = advance
    atexit.register(
        lambda: print(
            f"LOOP_TIMER seconds={totals['seconds']:.6f} cpu_seconds={totals['cpu_seconds']:.6f} "
            f"batches={totals['batches']}",
            flush=True,
        )
    )
