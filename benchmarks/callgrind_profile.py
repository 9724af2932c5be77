"""Where traceml's added instructions go, by interpreter (C) function: the stress loop plain
and traced under callgrind (the same window of batches as ``overhead.py --clock
instructions``), each function's own instructions per batch, traced minus plain.

Python 3.11 has no per-Python-function view under callgrind (its frames are all
``_PyEval_EvalFrameDefault``), but the C functions say what kind of work the added cost is:
bytecode, frames, attribute and dict lookups, allocation, class instantiation, or one hot
library call. Also prints how many calls per batch a few call paths gained (class
instantiations, calls of an object with ``__call__``, calls with keyword arguments).

    python benchmarks/callgrind_profile.py          # ~6 minutes on 2 cores
    python benchmarks/callgrind_profile.py --top 60
    python benchmarks/callgrind_profile.py --limit 1   # the traced process door-free after step 1

``--limit`` runs the flusher at its native interval (the limit is reached on the flusher, and
the window must come after it): the flusher and the sampler then wake ~60 times as often per
batch as natively, so their wake-ups (``pthread_cond_signal``, the GIL's) read too high.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import callgrind_window
import overhead
from _common import TINY, clean_env

_LINE = re.compile(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*)$")
_CALLS = re.compile(r">\s+\S*?:(\w+)(?:'\d+)? \(([\d,]+)x\)")
# Callees of _PyObject_MakeTpCall worth counting: a class called (type_call), an instance
# with __call__ (slot_tp_call), a C function called with keywords (cfunction_call).
_TP_CALLEES = ("type_call", "slot_tp_call", "cfunction_call", "_PyStack_AsDict")


def self_costs(dump: Path) -> dict[str, int]:
    """Function -> its own instructions in the window (source path and library dropped)."""
    text = _annotate(dump)
    costs: dict[str, int] = {}
    for line in text.splitlines():
        found = _LINE.match(line)
        if not found or "PROGRAM TOTALS" in line:
            continue
        name = re.sub(r" \[.*\]$", "", found.group(2)).rsplit("/", 1)[-1]
        costs[name] = costs.get(name, 0) + int(found.group(1).replace(",", ""))
    return costs


def tp_calls(dump: Path) -> dict[str, int]:
    """How often _PyObject_MakeTpCall called each of _TP_CALLEES in the window (callgrind's
    calling tree: a block per function, its line marked ``*``, its callees ``>``)."""
    text = _annotate(dump, "--inclusive=yes", "--tree=calling")
    calls: dict[str, int] = {}
    for block in text.split("\n\n"):
        if re.search(r"\*\s+\S*:_PyObject_MakeTpCall \[", block):
            for name, count in _CALLS.findall(block):
                if name in _TP_CALLEES:
                    calls[name] = calls.get(name, 0) + int(count.replace(",", ""))
    return calls


def _annotate(dump: Path, *options: str) -> str:
    return subprocess.run(
        ["callgrind_annotate", "--threshold=100", *options, str(dump)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def window_dump(folder: Path) -> Path:
    for path in folder.glob("cg.*"):
        if "Client Request: window" in path.read_text(errors="replace")[:4000]:
            return path
    raise RuntimeError(f"no window dump in {folder}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=30, help="functions listed")
    parser.add_argument("--limit", type=int, help="trace only the first LIMIT steps")
    args = parser.parse_args()
    overhead.CLOCK["field"] = "instructions"
    batches = overhead.CG["batches"]
    limit = {}
    if args.limit is not None:
        limit = {"TRACEML_TRACE_MAX_STEPS": args.limit}
        overhead.CG["scale"] = 1.0
    with tempfile.TemporaryDirectory(prefix="traceml-cgprofile-") as tmp:
        work = Path(tmp)
        overhead.CG["library"] = str(callgrind_window.build_library(work))
        workload = {**overhead.STRESS, "TINY_BATCHES": 1000}
        dumps: dict[str, Path] = {}
        for name in ("plain", "traced"):
            if name == "plain":
                env = clean_env(LOOP_TIMER="1", RFD_WORKDIR=work / name, **workload)
            else:
                env = overhead.traced_env(work, name, workload, **limit)
            folder = work / f"dumps-{name}"
            folder.mkdir()
            count, _ = overhead.loop_instructions(TINY, env, work, keep=folder)
            print(f"{name}: {count / batches:,.0f} instructions per batch", flush=True)
            dumps[name] = window_dump(folder)
        plain, traced = (self_costs(dumps[n]) for n in ("plain", "traced"))
        added = {f: (traced.get(f, 0) - plain.get(f, 0)) / batches for f in {*plain, *traced}}
        print(f"added: {sum(added.values()):,.0f} instructions per batch; by own cost:")
        for function, value in sorted(added.items(), key=lambda kv: -abs(kv[1]))[: args.top]:
            print(f"  {value:>9,.0f}  {function}")
        calls = [tp_calls(dumps[n]) for n in ("plain", "traced")]
        print("calls per batch added, through _PyObject_MakeTpCall:")
        for callee in _TP_CALLEES:
            gained = (calls[1].get(callee, 0) - calls[0].get(callee, 0)) / batches
            print(f"  {gained:>9.2f}  {callee}")


if __name__ == "__main__":
    main()
