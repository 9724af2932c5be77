"""``torch.multiprocessing.spawn``: the ranks it starts are not traced, and that is said once.

A spawned child's command line is multiprocessing's, which traceml reads as a helper process
(a DataLoader worker under spawn, a resource tracker) and leaves untraced and cheap; it cannot
tell a DDP rank started by ``mp.spawn`` (the PyTorch DDP tutorial's launch) from those. The
parent, which never trains, names it at the call. Lightning's ``ddp_spawn`` starts its ranks
through ``torch.multiprocessing.start_processes`` itself and carries traceml's callback into
them (traced): only ``spawn()``'s own call, a lookup in its module, is wrapped.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

_OURS: set[Any] = set()

MESSAGE = (
    "not tracing the processes started by torch.multiprocessing.spawn (traceml cannot tell "
    "them from DataLoader workers); launch the ranks with torchrun, or `traceml run "
    "--nproc-per-node N script.py`"
)


def name_spawned_ranks() -> None:
    """Wrap ``torch.multiprocessing.spawn``'s call of ``start_processes`` with the warning."""
    module = sys.modules.get("torch.multiprocessing.spawn")
    original = getattr(module, "start_processes", None)
    if original is None or original in _OURS:
        return

    @functools.wraps(original)
    def start_processes(*args: Any, **kwargs: Any) -> Any:
        _warn()
        return original(*args, **kwargs)  # the user's errors reach the user unchanged

    _OURS.add(start_processes)
    module.start_processes = start_processes  # type: ignore[union-attr]


def _warn() -> None:
    try:
        from traceml import console
        from traceml.capture import bootstrap

        if bootstrap.active_settings() is not None:
            console.warn(MESSAGE)
    except Exception:
        pass  # a warning that cannot be given must not stop the user's processes
