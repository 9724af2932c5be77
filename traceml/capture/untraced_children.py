"""A training in a child process that traceml leaves untraced says so, once, at its first step.

traceml never traces a process it cannot tell from a DataLoader worker: a child forked from a
traced process (the capture stands down in it), and a child that multiprocessing starts with
the ``spawn`` or ``forkserver`` method (its command line is multiprocessing's: a "helper" to
the bootstrap, which registers nothing else there). A training in either would otherwise run
untraced without a word. In both, one global optimizer step pre-hook waits for a first step
(a DataLoader worker never steps an optimizer) and removes itself at it (``optimizer_hooks``:
a no-op in its place while a later hook of the user's follows it), warning where no traceml
session owns the process.
"""

from __future__ import annotations

from typing import Any

from traceml.capture.optimizer_hooks import remove_hook

FORKED_TRAINING = (
    "not tracing a training in a process forked by this one (multiprocessing.Process, a "
    "pool): traceml cannot tell it from a DataLoader worker; run it as a script, under "
    "torchrun or `traceml run`"
)
STARTED_TRAINING = (
    "not tracing a training in a process started by multiprocessing with the spawn or "
    "forkserver method (multiprocessing.Process, a pool): traceml cannot tell it from a "
    "DataLoader worker; run it as a script, under torchrun or `traceml run`"
)


def name_forked_training() -> None:
    """In a forked child of a traced process (where the capture stood down, as a DataLoader
    worker must): an optimizer step outside any DataLoader worker is a training the child
    runs untraced; no fit claims it either (claim.forked_child)."""
    from traceml.capture import claim

    claim.forked_child()
    _name_first_step(forked=True)


def on_helper_torch_optim(_module: Any) -> None:
    """Post-import hook for ``torch.optim.optimizer`` in a multiprocessing helper
    (``bootstrap.process_role``): a training started there by spawn or forkserver."""
    _name_first_step(forked=False)


def _name_first_step(forked: bool) -> None:
    try:
        from torch.optim import optimizer as optim_module

        handle: Any = None

        def stepped(*_: Any) -> None:
            try:  # inside the user's optimizer.step(): nothing may escape
                remove_hook(handle, iterating=True)  # (torch iterates the hooks' dict now)
                if _untraced(forked):
                    from traceml import console

                    console.warn(FORKED_TRAINING if forked else STARTED_TRAINING)
            except Exception:
                pass

        handle = optim_module.register_optimizer_step_pre_hook(stepped)
    except Exception:
        pass  # a warning that cannot be set up must not touch the child


def _untraced(forked: bool) -> bool:
    """Whether this process's training goes untraced: not a DataLoader worker, no traceml
    session owns it, and no warning named its launch already."""
    from torch.utils.data import get_worker_info

    from traceml.capture import bootstrap, claim

    if get_worker_info() is not None or claim.owner() is not None:
        return False
    if forked:
        from traceml.capture.frameworks.torch_spawn import children_named

        # (tracing stays on in the child of a process that traces, and a launcher the
        # parent named has said so)
        return bootstrap.active_settings() is not None and not children_named
    if bootstrap.active_settings() is not None:  # traceml.init() in the child: it traces
        return False
    import multiprocessing

    # torch.multiprocessing's ranks (spawn, Lightning's ddp_spawn) run its _wrap: the parent
    # named the ones it does not trace, and Lightning's carry traceml's callback.
    target = getattr(multiprocessing.current_process(), "_target", None)
    return getattr(target, "__module__", None) != "torch.multiprocessing.spawn"
