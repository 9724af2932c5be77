"""The step callback out of Lightning's per-batch dispatch while the epoch loop runs.

Lightning dispatches each of ~six hooks a batch to every callback in ``trainer.callbacks`` (a
lookup and a test each, ~84 bytecodes a batch for one callback), even one whose hooks are
None. With one-door timing the step callback takes none of the per-batch hooks, so it steps out
of the list while the epoch loop runs and is back at its place when the loop returns or
raises: before the epoch's end, the exception's and teardown's hooks, and before any code
after ``fit`` sees the list. A callback looking at ``trainer.callbacks`` during an epoch does
not see traceml's, as it would not untraced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .lightning_instruments import set_instance_attribute


def out_of_callbacks_while_epochs_run(trainer: Any, callback: Any) -> Callable[[], None]:
    """Wrap the epoch loop's ``run`` (on the instance) so that ``callback`` is out of
    ``trainer.callbacks`` while it runs; the undo (nothing to undo where ``run`` cannot be
    wrapped: the callback then stays in the list)."""
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    original_run = getattr(epoch_loop, "run", None)
    if not callable(original_run) or "run" in getattr(epoch_loop, "__dict__", {"run": 0}):
        return _nothing

    def run(*args: Any, **kwargs: Any) -> Any:
        index = _take_out(trainer, callback)
        try:
            return original_run(*args, **kwargs)  # the user's errors pass through
        finally:
            if index is not None:
                _put_back(trainer, callback, index)

    return set_instance_attribute(epoch_loop, "run", run)


def _take_out(trainer: Any, callback: Any) -> int | None:
    """``callback``'s index in ``trainer.callbacks`` (by identity: no user ``__eq__`` runs),
    taken out of the list; None where it is not there."""
    try:
        callbacks = trainer.callbacks
        index = next((i for i, each in enumerate(callbacks) if each is callback), None)
        if index is not None:
            del callbacks[index]
        return index
    except Exception:  # not a list as Lightning's: it stays, and Lightning dispatches to it
        return None


def _put_back(trainer: Any, callback: Any, index: int) -> None:
    """``callback`` back at ``index`` in ``trainer.callbacks`` as it is now (a callback may
    have changed the list meanwhile), unless it is there already."""
    try:
        callbacks = trainer.callbacks
        if not any(each is callback for each in callbacks):
            callbacks.insert(min(index, len(callbacks)), callback)
    except Exception:  # never over the user's exception, where the loop raised one
        pass


def _nothing() -> None:
    pass
