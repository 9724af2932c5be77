"""What a training script's process holds at its end that tracing could change unseen: the
objects that have their own ``__dict__`` made, and the threads left. The transparency suite
(tests/integration/test_transparency.py) compares these between an untraced and a traced run.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import sys
import threading

FRAMEWORKS = ("lightning", "torch", "transformers", "accelerate", "__main__")


def dicts_made(prefixes: tuple[str, ...] = FRAMEWORKS) -> dict[str, int] | str:
    """The objects of classes from ``prefixes``' modules that have their own ``__dict__``
    made, by class. On CPython 3.11+ an object keeps its attributes inline until something
    makes one (a read of ``obj.__dict__``, an attribute its class's shared keys lack); from
    then on every attribute load on it takes the slower lookup, for the rest of the process."""
    if sys.version_info < (3, 11):
        return "inline attributes start in 3.11"
    # Objects of an earlier fit that wait in reference cycles are counted only until the
    # collector runs, and when it runs differs between a traced and an untraced process.
    gc.collect()
    made: collections.Counter[str] = collections.Counter()
    for obj in gc.get_objects():
        cls = type(obj)
        module = cls.__dict__.get("__module__")
        if not isinstance(module, str) or not module.startswith(prefixes):
            continue
        if isinstance(obj, type) or not cls.__flags__ & (1 << 4):  # Py_TPFLAGS_MANAGED_DICT
            continue
        referents = gc.get_referents(obj)  # the dict, if made; the values, if not
        if any(referent is obj.__dict__ for referent in referents):  # (this read makes one)
            made[f"{module}.{cls.__qualname__}"] += 1
    return dict(sorted(made.items()))


def threads_left(daemon: bool | None = None) -> list[str]:
    """The threads alive besides the main one (``daemon``: only those of that kind)."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and daemon in (None, t.daemon)
    )


def print_outcome() -> None:
    """The line the transparency suite reads (``TR_OUTCOME {json}``)."""
    outcome = {
        "dicts.made": dicts_made(),
        "threads_left": threads_left(),
        "non_daemon_threads_left": threads_left(daemon=False),
    }
    print("TR_OUTCOME " + json.dumps(outcome, sort_keys=True), flush=True)


def print_outcome_if_asked() -> None:
    """:func:`print_outcome` when the transparency suite runs the script (TR_CASE set); call
    it while the training's objects are alive."""
    if os.environ.get("TR_CASE"):
        print_outcome()
