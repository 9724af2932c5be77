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
    totals = {"seconds": 0.0, "batches": 0}

    def advance(self, data_fetcher):
        start = time.perf_counter()
        try:
            return original(self, data_fetcher)
        finally:
            totals["seconds"] += time.perf_counter() - start
            totals["batches"] += 1

    loop_class.advance = advance
    atexit.register(
        lambda: print(
            f"LOOP_TIMER seconds={totals['seconds']:.6f} batches={totals['batches']}", flush=True
        )
    )
