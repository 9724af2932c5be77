"""One undo stack for everything traceml patches during a traced training."""

from __future__ import annotations

from collections.abc import Callable


def undo_all(stack: list[Callable[[], object]]) -> None:
    """Run and drop every undo in ``stack``, last in first out. One that fails is skipped:
    the others still put their pieces back (teardown must never raise into training)."""
    while stack:
        undo = stack.pop()
        try:
            undo()
        except Exception:
            pass
