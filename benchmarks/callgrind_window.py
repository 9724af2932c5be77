"""Count the instructions a window of the training loop executes, under callgrind.

This VM's wall and CPU clocks drift by +-30% from one run to the next (a plain stress batch
took 1.0-1.8 ms within minutes on an idle guest), which buries a 30 us budget on a ~1 ms step.
Instructions retired do not drift: the same run gives the same count. ``--clock
instructions`` in ``overhead.py`` runs each variant under ``valgrind --tool=callgrind
--instr-atstart=no`` and counts only Lightning's loop body between batch ``CG_WARM`` and
``CG_WARM + CG_BATCHES`` (every thread: the flusher and the sampler count too).

The window is opened and closed by callgrind's client requests, which are machine-code
markers; Python reaches them through a three-function C library built here once (needs gcc
and valgrind's headers). Under callgrind a batch takes ~50x longer in wall time, so traceml's
time-based work (the flusher's 250 ms, the sampler's 1 s, RSS every 10 ms) would happen ~50x
as often per batch: ``scale_intervals`` stretches those intervals by the same factor before
traceml starts, so the count per batch is the native one.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import tempfile
from pathlib import Path

_SOURCE = r"""
#include <valgrind/callgrind.h>
void cg_open(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void cg_close(void) { CALLGRIND_DUMP_STATS_AT("window"); CALLGRIND_STOP_INSTRUMENTATION; }
int cg_running(void) { return RUNNING_ON_VALGRIND; }
"""


def build_library(folder: Path) -> Path:
    """Compile the client-request library into ``folder`` (once per benchmark run)."""
    source = folder / "cg_window.c"
    library = folder / "cg_window.so"
    source.write_text(_SOURCE)
    subprocess.run(
        ["gcc", "-O1", "-shared", "-fPIC", "-o", str(library), str(source)],
        check=True,
        capture_output=True,
    )
    return library


def valgrind_prefix(out_dir: Path, cache_sim: bool = False) -> list[str]:
    return [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        *(["--cache-sim=yes"] if cache_sim else []),
        f"--callgrind-out-file={out_dir}/cg.%p",
    ]


def estimated_cycles(events: dict[str, int]) -> int:
    """Callgrind's (and KCachegrind's) cycle estimate: an instruction a cycle, an L1 miss 10
    more, a last-level miss 100 more. A cold-cache door shows here, not in ``Ir`` alone."""
    l1 = events["I1mr"] + events["D1mr"] + events["D1mw"]
    last_level = events["ILmr"] + events["DLmr"] + events["DLmw"]
    return events["Ir"] + 10 * l1 + 100 * last_level


def window_events(out_dir: Path) -> dict[str, int]:
    """Every event count (``Ir``, and the cache simulation's misses when it ran) of the one
    window dump under ``out_dir``."""
    found_events = []
    for path in out_dir.glob("cg.*"):
        text = path.read_text(errors="replace")
        if "Client Request: window" not in text:
            continue
        names = re.search(r"^events: (.+)$", text, re.MULTILINE)
        totals = re.search(r"^(?:summary|totals): ([\d ]+)$", text, re.MULTILINE)
        if names and totals:
            counts = [int(value) for value in totals.group(1).split()]
            found_events.append(dict(zip(names.group(1).split(), counts, strict=False)))
    if len(found_events) != 1:
        raise RuntimeError(f"expected one window dump in {out_dir}, found {len(found_events)}")
    return found_events[0]


def out_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="traceml-cg-"))


class Window:
    """Inside the measured process (the loop timer): open at batch ``warm``, close after
    ``warm + batches``; nothing when the process is not under valgrind."""

    def __init__(self, library: str, warm: int, batches: int) -> None:
        self.lib = ctypes.CDLL(library)
        self.active = bool(self.lib.cg_running())
        self.open_at, self.close_after = warm, warm + batches
        self.seen = 0
        self.sinks: list = []

    def before(self) -> None:
        if self.active and self.seen == self.open_at:
            self.sinks = _rank_sinks()
            _flush(self.sinks)  # records of the batches before the window: built outside it
            self.lib.cg_open()

    def after(self) -> None:
        self.seen += 1
        if self.active and self.seen == self.close_after:
            _flush(self.sinks)  # the window's records: built (and counted) inside it
            self.lib.cg_close()


def _rank_sinks() -> list:
    """traceml's rank-file sinks in this process (none in a plain run)."""
    import gc

    return [item for item in gc.get_objects() if type(item).__name__ == "RankSink"]


def _flush(sinks: list) -> None:
    """Build and write every queued step record now. The flusher builds them every 250 ms
    (stretched by ``scale_intervals``), which need not fall inside the window: without this,
    the records' cost was counted for some windows and not for others (+109k to +187k
    instructions per batch for the same code)."""
    for sink in sinks:
        sink.flush()


def scale_intervals(factor: float) -> None:
    """Stretch traceml's time-based intervals by ``factor`` (see the module docstring)."""
    import importlib

    sink = importlib.import_module("traceml.capture.sink")
    init = sink.RankSink.__init__
    init.__kwdefaults__ = {
        **init.__kwdefaults__,
        "flush_interval_s": sink.FLUSH_INTERVAL_S * factor,
    }
    telemetry = importlib.import_module("traceml.capture.telemetry")
    for function in (telemetry.sampler_for, telemetry.TelemetrySampler.__init__):
        defaults = list(function.__defaults__ or ())
        kw = dict(function.__kwdefaults__ or {})
        if "interval_s" in kw:
            kw["interval_s"] = telemetry.SAMPLE_INTERVAL_S * factor
            function.__kwdefaults__ = kw
        elif defaults:
            defaults[-1] = telemetry.SAMPLE_INTERVAL_S * factor
            function.__defaults__ = tuple(defaults)
    # Read by name where the step's end reads RSS (Session.rss_due; in stop 40's code the
    # event replay's step end read its own copy).
    for name in ("traceml.capture.session", "traceml.capture.step_events", "traceml.capture.rss"):
        try:
            module = importlib.import_module(name)
        except ImportError:  # an older checkout, before the event log
            continue
        if hasattr(module, "RSS_EVERY_NS"):
            module.RSS_EVERY_NS = int(module.RSS_EVERY_NS * factor)


def from_environment() -> Window | None:
    library = os.environ.get("CG_LIBRARY")
    if not library:
        return None
    return Window(library, int(os.environ["CG_WARM"]), int(os.environ["CG_BATCHES"]))
