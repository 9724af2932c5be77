"""``torch.multiprocessing.spawn``: the ranks it starts are not traced, and that is said once.

A spawned child's command line is multiprocessing's, which traceml reads as a helper process
(a DataLoader worker under spawn, a resource tracker) and leaves untraced and cheap; it cannot
tell a DDP rank started by ``mp.spawn`` (the PyTorch DDP tutorial's launch) from those. The
parent, which never trains, names it at the call. Lightning's ``ddp_spawn`` starts its ranks
through ``torch.multiprocessing.start_processes`` itself and carries traceml's callback into
them (traced): only ``spawn()``'s own call, a lookup in its module, is wrapped.

Accelerate's ``notebook_launcher`` and ``debug_launcher`` fork their ranks the same way (a
forked child is a DataLoader worker to traceml until it knows better, and it cannot): their
calls that start more than one process are named too.
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
    wrapper = _named(original, MESSAGE, _always)
    _OURS.add(wrapper)
    module.start_processes = wrapper  # type: ignore[union-attr]


FORKED = (
    "not tracing the processes started by accelerate's {name} (traceml cannot tell forked "
    "ranks from DataLoader workers); launch the script with `accelerate launch`, torchrun, or "
    "`traceml run --nproc-per-node N script.py`"
)


def on_accelerate_launchers(module: Any) -> None:
    """Post-import hook for ``accelerate.launchers``: its two launchers say, at a call that
    starts several processes, that those go untraced. ``accelerate``'s own namespace binds
    them from this module after the hook, so ``from accelerate import notebook_launcher``
    gets the same function as the module holds."""
    for name, forks in (("notebook_launcher", _many_processes), ("debug_launcher", _always)):
        original = getattr(module, name, None)
        if callable(original) and original not in _OURS:
            wrapper = _named(original, FORKED.format(name=name), forks)
            _OURS.add(wrapper)
            setattr(module, name, wrapper)


def _many_processes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    count = kwargs.get("num_processes", args[2] if len(args) > 2 else None)
    return isinstance(count, int) and count > 1


def _always(_args: tuple[Any, ...], _kwargs: dict[str, Any]) -> bool:
    return True


def _named(original: Any, message: str, forks: Any) -> Any:
    @functools.wraps(original)
    def launcher(*args: Any, **kwargs: Any) -> Any:
        global children_named
        try:
            if forks(args, kwargs):
                _warn(message)
        except Exception:
            pass  # a warning that cannot be given must not stop the user's launch
        children_named = True  # inherited by the ranks it forks: they say nothing more
        try:
            return original(*args, **kwargs)  # the user's errors reach the user unchanged
        finally:
            children_named = False

    return launcher


children_named = False  # True in a process forked by a launcher that named its ranks


def _warn(message: str = MESSAGE) -> None:
    try:
        from traceml import console
        from traceml.capture import bootstrap

        if bootstrap.active_settings() is not None:
            console.warn(message)
    except Exception:
        pass  # a warning that cannot be given must not stop the user's processes
