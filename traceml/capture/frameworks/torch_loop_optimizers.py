"""Which optimizer's step ends a training step in a loop traceml only sees from torch.

The first optimizer that steps. Another one's steps lie inside the steps (a GAN's generator,
whose optimizer alternates with the discriminator's), unless it steps twice in a row with no
step of the first between: then the loop has moved on to it (the second stage of a fine-tuning,
a new optimizer over more parameters, the first one still alive in its lr scheduler), and it
takes over. Before that, the first stage's optimizer kept the title and no stage-2 step ended.
Weak references only: the user's optimizers are freed as untraced.
"""

from __future__ import annotations

import weakref
from typing import Any

STEP, OTHER, CHANGED = "step", "other", "changed"
NOTES = {  # the rank file's note, once each
    OTHER: "several optimizers step in this loop: a step ends at the first one's step; the "
    "others' steps are in Residual or in the gap between steps",
    CHANGED: "another optimizer stepped twice in a row, none of the first one's steps between: "
    "steps end at its step from then on",
}


class StepOptimizer:
    def __init__(self) -> None:
        self._current: Any = None  # weak reference to the optimizer whose step ends a step
        self._rival: Any = None  # another one whose last finished step came after the current's

    def is_current(self, optimizer: Any) -> bool:
        return self._current is not None and self._current() is optimizer

    def judge(self, optimizer: Any, finished: bool, fed: bool = True) -> str:
        """STEP, OTHER or CHANGED (it took over) for ``optimizer``'s step; ``finished``: its
        step is over (the post-hook), which, after a fetch (``fed``: a second stage trains on
        new batches; a GAN's generator stepping twice on one batch does not), makes it a
        rival."""
        current = self._current() if self._current is not None else None
        if current is None or current is optimizer:
            if current is None:
                self._current = weakref.ref(optimizer)
            if finished:
                self._rival = None
            return STEP
        rival = self._rival() if self._rival is not None else None
        if rival is optimizer:  # its second step in a row, none of the current's between
            self._current, self._rival = weakref.ref(optimizer), None
            return CHANGED
        if finished:
            self._rival = weakref.ref(optimizer) if fed else None
        return OTHER
