"""Which DataLoader fetches feed a training forward, and where an epoch turns (any-loop).

The any-loop capture sees every torch DataLoader iterator's ``__next__`` and every outermost
call of a root module; nothing says which loader trains. Fetches are held, per iterator, until
the next training forward:

* a training forward takes every fetch held (loaders zipped in one step add up); the iterators
  it took from are the training iterators from then on;
* an iterator that runs out drops what it holds, unless it trains, and so does one freed before
  a training forward: they fed none (an evaluation loop's batches, also where its forwards are
  not seen: a module traceml does not hook, an EMA copy, after the first step);
* an evaluation forward sets what is held aside: a training forward right after it, with no
  fetch between, trains on that same batch (a frozen teacher in eval mode, then the student),
  unless the training iterators are known and none of them made it; any new fetch drops it;
* an epoch ends at the first training forward fed by a fetch made after a training iterator
  ran out; the first fetch after it drops what was held before (the batch a longer loader
  zipped with a shorter one gave for nothing). Not "by another iterator": a loader with
  persistent workers keeps one iterator for every epoch.

Iterators are known by weak reference, not ``id()``: CPython gives a new iterator the id of a
freed one (the last epoch's, a validation's). Pure bookkeeping, no torch.
"""

from __future__ import annotations

import weakref
from typing import Any

# What a training forward takes: (the training iterators' ids, the first fetch's start, the
# ns all the fetches took).
Held = tuple[tuple[int, ...], int, int]


class Fetches:
    def __init__(self) -> None:
        # iterator id -> [its weak reference, first start, ns, its dataset's id() or None]
        self._held: dict[int, list[Any]] = {}
        self._evaluated: Held | None = None
        self._evaluated_entries: dict[int, list[Any]] = {}
        self._train: dict[int, Any] = {}  # id -> weak reference, of the training iterators
        # id() of the training iterators' datasets (held by their DataLoader, which outlives
        # its iterators): a new iterator over one of them is the next epoch's training one.
        self._train_data: set[int] = set()
        self._ran_out = False  # a training iterator raised StopIteration
        self._fetched_since = False  # ... and a fetch came after it: the next epoch's

    @property
    def held(self) -> Held | None:
        return _summed(self._held)

    @property
    def train_iterators(self) -> tuple[int, ...]:
        return tuple(self._train)

    def _trains(self, key: int, iterator: Any) -> bool:
        ref = self._train.get(key)
        return ref is not None and ref() is iterator

    def fetched(self, iterator: Any, start: int, end: int) -> None:
        self._evaluated = None  # a new batch: the evaluated one was evaluation only
        held = self._held
        if self._ran_out and not self._fetched_since:
            self._fetched_since = True
            held.clear()  # before the epoch's end: fed nothing
        key = id(iterator)
        entry = held.get(key)
        if entry is not None and entry[0]() is iterator:
            entry[2] += end - start
        else:
            data = getattr(iterator, "_dataset", None)
            data_id = None if data is None else id(data)  # (no truth test: no __len__ call)
            held[key] = [weakref.ref(iterator), start, end - start, data_id]

    def exhausted(self, iterator: Any) -> None:
        key = id(iterator)
        if self._trains(key, iterator):
            self._ran_out = True
            return
        entry = self._held.get(key)
        if entry is not None and entry[3] in self._train_data:
            # A new iterator over the training data that ran out before any forward took
            # from it (an epoch no longer than the fetches made ahead of the first forward:
            # Accelerate's, the HF Trainer's): its batches are the next epoch's.
            self._ran_out = self._fetched_since = True
            return
        self._held.pop(key, None)  # an evaluation loop's last batch
        evaluated = self._evaluated
        if evaluated is not None and key in evaluated[0]:
            self._evaluated = None

    def evaluated(self) -> None:
        """An evaluation forward (no grad, inference mode or eval mode) ran on what is held."""
        if self._held:
            self._evaluated = _summed(self._held)
            self._evaluated_entries = self._held
            self._held = {}

    def for_training(self) -> Held | None:
        """What a training forward would take now (without taking it)."""
        held = self._held
        if held:
            gone = [key for key, entry in held.items() if entry[0]() is None]
            if len(gone) < len(held):  # (all gone: ``next(iter(loader))``, freed at once)
                for key in gone:
                    del held[key]  # a loop broken out of, its iterator freed: it fed nothing
            return _summed(held)
        evaluated = self._evaluated
        if evaluated is not None:
            entries = self._evaluated_entries
            if not self._train or any(self._trains(k, entries[k][0]()) for k in evaluated[0]):
                return evaluated
        return None

    def epoch_turned(self, taken: Held | None) -> bool:
        """Whether the training forward taking ``taken`` starts a new epoch (said once)."""
        if self._fetched_since and taken is not None:
            self._ran_out = self._fetched_since = False
            return True
        return False

    def take(self, taken: Held | None) -> None:
        """A training forward took ``taken`` (``for_training``'s)."""
        if taken is not None:
            entries = self._held
            if not entries and self._evaluated is taken:
                entries = self._evaluated_entries
            self._train = {key: entries[key][0] for key in taken[0] if key in entries}
            self._train_data.update(entries[key][3] for key in taken[0] if key in entries)
            self._train_data.discard(None)
        self._held.clear()
        self._evaluated = None

    def drop(self) -> None:
        """The open step is not a step (the framework starts its loop over)."""
        self._held.clear()
        self._evaluated = None


def _summed(held: dict[int, list[Any]]) -> Held | None:
    if not held:
        return None
    entries = held.values()
    return (
        tuple(held),
        min(entry[1] for entry in entries),
        sum(entry[2] for entry in entries),
    )
