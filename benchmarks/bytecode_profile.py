"""Where traceml's added per-step cost goes, by Python function: bytecodes executed per batch
of the stress loop, traced minus plain, counted with ``sys.settrace`` opcode events.

callgrind (``callgrind_profile.py``) counts machine instructions but sees Python 3.11's frames
only as ``_PyEval_EvalFrameDefault``; this counts the bytecodes each Python function runs, so
it names the functions: traceml's doors, and the Lightning code that runs only because
traceml is there (its dispatch of a hook to traceml's callback). Deterministic: the same code
gives the same counts, whatever the machine's load.

The window is batches 200-299 of the training thread, each from Lightning's ``advance`` to
its ``on_advance_end`` (traceml's step ends in a wrapper around ``advance``). The flusher's
interval is stretched so that it never runs inside the window, and the window's step records
are built and encoded on the training thread at its end (counted, as a flush would). Threads
other than the training thread are not counted (telemetry sampling, about once a second), nor
are RSS reads (stretched with the flusher's interval: ~25 bytecodes every 10 ms natively).

    python benchmarks/bytecode_profile.py              # ~1 minute
    python benchmarks/bytecode_profile.py --top 60
    python benchmarks/bytecode_profile.py --limit 1   # the traced process door-free after step 1
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

from _common import PYTHON, TINY, clean_env, run

HERE = Path(__file__).resolve().parent
WARM, BATCHES = 200, 100

# Loaded at interpreter start (a sitecustomize on PYTHONPATH): counts opcodes per code object
# while the window is open, then writes ``calls<TAB>opcodes<TAB>where`` lines per batch.
_SITE = r"""
import atexit, importlib, os, sys

WARM, BATCHES, OUT = int(os.environ["BC_WARM"]), int(os.environ["BC_BATCHES"]), os.environ["BC_OUT"]
counts = {}

def _local(frame, event, arg):
    if event == "opcode":
        counts[frame.f_code][1] += 1
    return _local

def _global(frame, event, arg):
    entry = counts.get(frame.f_code)
    if entry is None:
        entry = counts[frame.f_code] = [0, 0]
    entry[0] += 1
    frame.f_trace_opcodes = True
    return _local

def _sinks():
    import gc
    return [item for item in gc.get_objects() if type(item).__name__ == "RankSink"]

def install(package):
    # A batch: from the class's advance to the loop's on_advance_end, so that traceml's
    # instance-level wrapper around advance (its step's end) is inside the window.
    loop = importlib.import_module(package + ".loops.training_epoch_loop")._TrainingEpochLoop
    original, original_end, seen, sinks = loop.advance, loop.on_advance_end, [0], []

    def advance(self, data_fetcher):
        if seen[0] == WARM and not sinks:
            sinks.extend(_sinks())
            for sink in sinks:
                sink.flush()  # the records of the batches before the window: not counted
            sys.settrace(_global)
        return original(self, data_fetcher)

    def on_advance_end(self, data_fetcher):
        seen[0] += 1
        if seen[0] == WARM + BATCHES:
            for sink in sinks:
                sink.flush()  # the window's records, built and encoded here: counted
            sys.settrace(None)
        return original_end(self, data_fetcher)

    loop.advance, loop.on_advance_end = advance, on_advance_end

def report():
    with open(OUT, "w") as out:
        for code, (calls, ops) in counts.items():
            where = f"{code.co_filename}:{code.co_firstlineno}:{code.co_name}"
            out.write(f"{calls / BATCHES}\t{ops / BATCHES}\t{where}\n")

atexit.register(report)
if os.environ.get("TRACEML"):
    import callgrind_window
    callgrind_window.scale_intervals(1e6)  # the flusher never runs inside the window

import loop_timer  # tiny_lightning calls loop_timer.install(package) with LOOP_TIMER set
_timer_install = loop_timer.install
def _install(package):
    install(package)
loop_timer.install = _install
"""


def counts(path: Path) -> dict[str, tuple[float, float]]:
    """where -> (calls, opcodes) per batch; site-packages and this checkout's paths cut."""
    table: dict[str, tuple[float, float]] = {}
    for line in path.read_text().splitlines():
        calls, ops, where = line.split("\t")
        where = re.sub(r".*site-packages/", "", where).replace(str(HERE.parent) + "/", "")
        where = re.sub(r".*/lib/python3\.\d+/", "", where)
        old = table.get(where, (0.0, 0.0))
        table[where] = (old[0] + float(calls), old[1] + float(ops))
    return table


def profile(traced: bool, work: Path, limit: int | None = None) -> dict[str, tuple[float, float]]:
    out = work / ("traced.tsv" if traced else "plain.tsv")
    site = work / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITE)
    scripts = TINY.parent
    extra = {"TRACEML": "1", "TRACEML_REPORT": "0", "TRACEML_LOGS_DIR": work / "logs"}
    if limit is not None:  # TRACEML_TRACE_MAX_STEPS: the doors come off after that many steps
        extra["TRACEML_TRACE_MAX_STEPS"] = limit
    env = clean_env(
        LOOP_TIMER="1",
        TINY_VALIDATE=0,
        TINY_BATCHES=WARM + BATCHES + 10,
        RFD_WORKDIR=work / ("work-traced" if traced else "work-plain"),
        BC_WARM=WARM,
        BC_BATCHES=BATCHES,
        BC_OUT=out,
        PYTHONPATH=f"{site}:{HERE}:{scripts}",
        **(extra if traced else {}),
    )
    run([PYTHON, TINY], env, work)
    return counts(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument(
        "--limit", type=int, help="trace only the first LIMIT steps (what a door-free process adds)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="traceml-bytecode-") as folder:
        work = Path(folder)
        plain, traced = profile(False, work), profile(True, work, args.limit)
    total = {
        name: sum(ops for _, ops in table.values())
        for name, table in (("plain", plain), ("traced", traced))
    }
    print(
        f"bytecodes per batch: plain {total['plain']:,.0f}, traced {total['traced']:,.0f}, "
        f"added {total['traced'] - total['plain']:,.0f}"
    )
    rows = []
    for where in set(plain) | set(traced):
        calls_p, ops_p = plain.get(where, (0.0, 0.0))
        calls_t, ops_t = traced.get(where, (0.0, 0.0))
        if ops_t - ops_p or calls_t - calls_p:
            rows.append((ops_t - ops_p, calls_t - calls_p, where))
    rows.sort(key=lambda row: -abs(row[0]))
    print(f"{'bytecodes':>10} {'calls':>6}  function (traced minus plain, per batch)")
    for ops, calls, where in rows[: args.top]:
        print(f"{ops:10.1f} {calls:6.2f}  {where}")


if __name__ == "__main__":
    main()
