"""One traced training per process: the first adapter to claim it owns the rank file.

A second training in the same process (a new experiment) would mix two runs into one rank
file, so it runs untraced with one warning. The generic torch-loop capture registers as a
stand-by: when a framework adapter (Lightning) claims the training, the generic capture takes
its hooks away, so nothing is counted twice.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from traceml import console

_lock = threading.Lock()
_owner: weakref.ref | None = None
_done = False  # the owner's training ended: the same owner's next one is a second training
_warned_second = False
_stand_by: list[Callable[[], None]] = []
_forked_child = False  # a child forked from a process that traced nothing (forked_child)


def claim(owner: Any) -> bool:
    """Claim tracing for ``owner`` (a trainer, a loop capture); False when another has it."""
    global _owner, _warned_second
    with _lock:
        if _forked_child and _owner is None:
            return False  # (named at its first step: untraced_children)
        current = _owner() if _owner is not None else None
        # The first owner freed (a script that drops its trainer after the fit) still had the
        # process's one traced training: a later one stays untraced.
        if _done or (_owner is not None and current is not owner):
            if not _warned_second:
                _warned_second = True
                console.warn(
                    "a second training in this process is not traced (one run per process)"
                )
            refused = True
        else:
            refused = False
            _owner = weakref.ref(owner)
            stand_by = list(_stand_by)
    if refused:
        # A loop's training is over once another begins (a fit after a hand-written loop):
        # its hooks would read the other's steps as its own (Lightning's step(closure) as
        # L-BFGS, its optimizer as a second one).
        ended = getattr(current, "another_training", None)  # (a trainer has none)
        if ended is not None:
            ended()
        return False
    for stand_down in stand_by:
        if getattr(stand_down, "__self__", None) is not owner:
            stand_down()
    return True


def finished(owner: Any) -> None:
    """``owner``'s training is over (a Lightning fit returned): a later fit of the same trainer
    is a second training, refused as another's would be, though traceml's callback, which said
    so before, has left the trainer."""
    global _done
    with _lock:
        if _owner is not None and _owner() is owner:
            _done = True


def forked_child() -> None:
    """This process was forked from one that traced nothing (``multiprocessing.Process``, a
    pool): no training here is traced, as traceml cannot tell it from a DataLoader worker; the
    first optimizer step says so. A Lightning fit there was traced into a rank file that no
    report ever read (a multiprocessing child leaves by ``os._exit``: no exit handler)."""
    global _forked_child
    _forked_child = True


def owner() -> Any | None:
    return _owner() if _owner is not None else None


def register_stand_by(stand_down: Callable[[], None]) -> None:
    """``stand_down()`` is called when another adapter claims the training."""
    with _lock:
        _stand_by.append(stand_down)


def unregister_stand_by(stand_down: Callable[[], None]) -> None:
    with _lock:
        if stand_down in _stand_by:
            _stand_by.remove(stand_down)


def reset_for_tests() -> None:
    global _owner, _warned_second, _done, _forked_child
    with _lock:
        _forked_child = False
        _owner = None
        _warned_second = False
        _done = False
