"""benchmarks/overhead_split.py's arithmetic: the doors from one process against itself, the
process's cost across processes, on batch times made here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _split():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # its own imports (side_by_side, _common)
    try:
        path = ROOT / "benchmarks" / "overhead_split.py"
        spec = importlib.util.spec_from_file_location("overhead_split", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


split = _split()


def _run(first_us: float, second_us: float, batches: int = 1000) -> list[int]:
    """Batch times in ns: ``first_us`` in the first half, ``second_us`` after; every fourth
    batch 300 us slower (a disturbed batch, above the 25th percentile)."""
    half = batches // 2
    times = [first_us] * half + [second_us] * (batches - half)
    return [round((t + (300 if i % 4 == 3 else 0)) * 1000) for i, t in enumerate(times)]


def test_doors_are_the_traced_halves_less_the_plain_drift():
    plain = _run(600, 610)  # the machine 10 us a batch slower in the second half
    traced = _run(650, 630)  # doors on, then off
    pair = split.split_pair(plain, traced)
    assert pair["doors"] == 30.0  # (650 - 630) + 10: the drift is not counted as doors
    assert pair["process"] == 20.0  # 630 - 610: the traced process with its doors off
    assert pair["total"] == 50.0  # 650 - 600


def test_the_windows_skip_each_halfs_edges():
    plain = _run(600, 600)
    traced = _run(640, 620)
    # Slow batches at the start and around the limit (warm-up, the doors coming off) are
    # outside both windows: nothing changes.
    for index in (*range(0, 100), *range(490, 510)):
        traced[index] = 5_000_000
    assert split.split_pair(plain, traced) == {"doors": 20.0, "process": 20.0, "total": 40.0}
