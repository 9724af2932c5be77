"""Ways for a DataLoader worker to tell the main process its counters, per batch (issue 16).

Times one report of ten 64-bit counters, best of 5 runs of N reports, for: a shared anonymous
memory map (struct.pack_into, what traceml uses), a multiprocessing queue put, and an append
to a per-worker file. Prints microseconds per report.

    .venv/bin/python benchmarks/dataloader_transport.py [reports]
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import struct
import sys
import tempfile
import time

SLOT = struct.Struct("<10q")


def best_of(report, count: int, tries: int = 5) -> float:
    best = float("inf")
    values = tuple(range(10))
    for _ in range(tries):
        start = time.perf_counter()
        for _ in range(count):
            report(values)
        best = min(best, time.perf_counter() - start)
    return best / count * 1e6


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    shared = mmap.mmap(-1, SLOT.size * 256)
    queue = multiprocessing.get_context("fork").Queue()
    fd, path = tempfile.mkstemp()
    try:
        results = {
            "shared map (pack_into)": best_of(lambda v: SLOT.pack_into(shared, 0, *v), count),
            "multiprocessing queue put": best_of(queue.put, count),
            "per-worker file append": best_of(lambda v: os.write(fd, SLOT.pack(*v)), count),
        }
    finally:
        os.close(fd)
        os.unlink(path)
        queue.cancel_join_thread()
    for name, us in results.items():
        print(f"{name:<28}{us:8.2f} us per batch")


if __name__ == "__main__":
    main()
