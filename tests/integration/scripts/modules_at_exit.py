"""Run a training script, then write which traceml modules the process had loaded.

The atexit handler is registered before the script runs, so it runs after every handler the
script or traceml registers (atexit is last in, first out): it sees the process as it ends.
Usage: MODULES_AT_EXIT=out.txt python modules_at_exit.py SCRIPT [ARGS...]
"""

import atexit
import os
import runpy
import sys


def _dump() -> None:
    loaded = sorted(name for name in sys.modules if name.startswith("traceml"))
    with open(os.environ["MODULES_AT_EXIT"], "w") as handle:
        handle.write("\n".join(loaded) + "\n")


atexit.register(_dump)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
