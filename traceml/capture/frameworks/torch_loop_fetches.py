"""Which DataLoader fetches feed a training forward, and where an epoch turns (any-loop).

The any-loop capture sees every torch DataLoader iterator's ``__next__`` and every outermost
module call; nothing says which loader trains. A fetch is held until the next forward:

* a training forward takes every fetch held (loaders zipped in one step add up);
* an evaluation forward sets them aside: a training forward right after it, with no fetch
  between, trains on that same batch (a frozen teacher in eval mode, then the student), unless
  the training loaders are known and none of them made it; any new fetch, or the evaluation
  loader running out, drops them (a validation loop's batches are not Input Wait);
* an epoch ends at the first training forward fed by a fetch made after a training loader ran
  out. Not "by another iterator": CPython gives a new iterator the freed one's id, and a loader
  with persistent workers keeps one iterator for every epoch.

Pure bookkeeping over ints, no torch: the capture's guarded entry points call it.
"""

from __future__ import annotations

# (the iterators' ids, the first fetch's start, the ns the fetches took)
Held = tuple[tuple[int, ...], int, int]


class Fetches:
    def __init__(self) -> None:
        self.held: Held | None = None
        self._evaluated: Held | None = None
        self.train_iterators: tuple[int, ...] = ()  # those that fed the last training forward
        self._ran_out = False  # a training iterator raised StopIteration
        self._fetched_since = False  # ... and a fetch came after it: the next epoch's

    def fetched(self, iterator_id: int, start: int, end: int) -> None:
        self._evaluated = None  # a new batch: the evaluated one was evaluation only
        if self._ran_out:
            self._fetched_since = True
        held = self.held
        if held is None:
            self.held = ((iterator_id,), start, end - start)
            return
        ids = held[0]
        if iterator_id not in ids:
            ids = (*ids, iterator_id)
        self.held = (ids, held[1], held[2] + end - start)

    def exhausted(self, iterator_id: int) -> None:
        if iterator_id in self.train_iterators:
            self._ran_out = True
        evaluated = self._evaluated
        if evaluated is not None and iterator_id in evaluated[0]:
            self._evaluated = None  # an evaluation loop's last batch

    def evaluated(self) -> None:
        """An evaluation forward (no grad, inference mode or eval mode) ran on what is held."""
        if self.held is not None:
            self._evaluated, self.held = self.held, None

    def for_training(self) -> Held | None:
        """What a training forward would take now (without taking it)."""
        held = self.held
        if held is None and self._evaluated is not None:
            train = self.train_iterators
            evaluated = self._evaluated
            if not train or any(iterator in train for iterator in evaluated[0]):
                return evaluated
        return held

    def epoch_turned(self, taken: Held | None) -> bool:
        """Whether the training forward taking ``taken`` starts a new epoch (said once)."""
        if self._fetched_since and taken is not None:
            self._ran_out = self._fetched_since = False
            return True
        return False

    def take(self, taken: Held | None) -> None:
        """A training forward took ``taken`` (``for_training``'s)."""
        if taken is not None:
            self.train_iterators = taken[0]
        self.held = self._evaluated = None

    def drop(self) -> None:
        """The open step is not a step (the framework starts its loop over)."""
        self.held = self._evaluated = None
