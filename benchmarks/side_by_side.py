"""Two runs at once, each pinned to a core of its own, their loops released together.

Why: on this 2-core VM the host's load comes in spells of seconds to minutes that slow every
batch by 10-60%; runs one after the other (A B A B) each meet a different spell, and a 30 us
difference on a 600 us batch drowns (pairs' differences spread by 25-30 us). Two runs that
time their loops over the same seconds meet the same spell. Each run is pinned to its own core
(``taskset``: the run and its threads), the cores swapped every pair, so that a core slower
than the other weighs on both variants alike; each waits before its first batch until both
are ready (``LOOP_BARRIER``, ``tests/integration/scripts/loop_timer.py``), so that start-up
(traceml's is longer) overlaps no loop. The caller alternates the launch order too
(``later_first``): with one order, an A/A (both plain) read the run started second +9.5 us a
batch slower (median of 8 pairs); with both orders, -0.1 (12 pairs). What it cannot remove:
the two runs share the caches beyond L2 and the memory bus, as two ranks of one machine do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from _common import PYTHON, values


def usable() -> str | None:
    """Why runs cannot go side by side here, or None."""
    if shutil.which("taskset") is None:
        return "no taskset on this machine"
    if len(os.sched_getaffinity(0)) < 2:
        return "fewer than 2 cores"
    return None


def run_together(
    script: Path,
    envs: list[dict[str, str]],
    cwd: Path,
    flip: bool,
    later_first: bool = False,
    timeout_s: float = 900.0,
) -> list[dict[str, float]]:
    """``envs``' runs of ``script`` at once, the first on core 0 and the second on core 1
    (swapped with ``flip``), started in ``envs``' order (reversed with ``later_first``); each
    run's LOOP_TIMER values, in ``envs``' order."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    if flip:
        cores.reverse()
    launch = list(zip(range(len(envs)), envs, cores, strict=True))
    if later_first:
        launch.reverse()
    barrier = Path(tempfile.mkdtemp(prefix="barrier-", dir=cwd))
    started: dict[int, subprocess.Popen] = {}
    try:
        for index, env, core in launch:
            started[index] = subprocess.Popen(
                ["taskset", "-c", str(core), PYTHON, str(script)],
                env={**env, "LOOP_BARRIER": str(barrier)},
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        processes = [started[index] for index in range(len(envs))]
        deadline = time.monotonic() + timeout_s
        while len(list(barrier.glob("ready-*"))) < len(envs):
            if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
                break  # a run that ended early says why below
            time.sleep(0.005)
        (barrier / "go").touch()
        timers = []
        for process in processes:
            out, err = process.communicate(timeout=timeout_s)
            if process.returncode != 0:
                raise RuntimeError(f"{script.name} exited {process.returncode}:\n{err[-3000:]}")
            timers.append(values(out, "LOOP_TIMER"))
        return timers
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
        shutil.rmtree(barrier, ignore_errors=True)
