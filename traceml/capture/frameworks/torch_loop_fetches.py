"""Which DataLoader fetches feed a training forward, and where an epoch turns (any-loop).

The any-loop capture sees every torch DataLoader iterator's ``__next__`` and every outermost
call of a root module; nothing says which loader trains. Fetches are held, per iterator, until
the next training forward:

* a training forward takes every fetch held (loaders zipped in one step add up); the iterators
  it took from are the training iterators from then on, and the loader of the first of them
  (the outer loop's, in ``zip(a, b)`` ``a``'s) is the primary training loader;
* a pass's first batch (``_num_yielded`` back to 1: a new iterator, or a persistent one
  reset) drops what is held from an earlier pass over the same loader (a peek with
  ``next(iter(loader))`` before the loop, the batch a longer loader zipped with a shorter one
  gave for nothing, an epoch broken out of);
* an iterator that runs out drops what it holds, unless it trains or iterates the primary
  training loader (a short epoch fetched ahead whole), and so does one freed before
  a training forward, unless every iterator held is (``next(iter(loader))`` each step): they
  fed none (an evaluation loop's batches, also where its forwards are not seen: a module
  traceml does not hook, an EMA copy, after the first step);
* an evaluation forward sets what is held aside: a training forward right after it, with no
  fetch between, trains on that same batch (a frozen teacher in eval mode, then the student),
  unless the training iterators are known, alive, and none of them made it; any new fetch
  drops it;
* an epoch turns at the first training forward that takes from a new pass over the primary
  training loader (whatever the iterator: a loader with persistent workers keeps one), or,
  after the primary training iterator ran out, from a new pass over any loader (a new
  DataLoader each epoch). A pass that only an evaluation took from (a validation loop over
  the training DataLoader itself, mid-epoch) and another loader re-made inside the epoch (a
  shorter labelled set in a semi-supervised loop) turn nothing.

Loaders are told apart by their index sampler (one per DataLoader, shared by its iterators),
iterators by weak reference, not ``id()``: CPython gives a new iterator the id of a freed one.
Pure bookkeeping, no torch.
"""

from __future__ import annotations

import weakref
from typing import Any

# What a training forward takes: (the iterators' ids, the first fetch's start, the ns all the
# fetches took).
Held = tuple[tuple[int, ...], int, int]
_REF, _START, _NS, _LOADER = range(4)  # a held entry's fields


def _loader_key(iterator: Any) -> int:
    sampler = getattr(iterator, "_index_sampler", None)
    return id(iterator) if sampler is None else id(sampler)


class Fetches:
    def __init__(self) -> None:
        # iterator id -> [its weak reference, first start, ns, its loader's key]
        self._held: dict[int, list[Any]] = {}
        self._evaluated: Held | None = None
        self._evaluated_entries: dict[int, list[Any]] = {}
        self._train: dict[int, Any] = {}  # id -> weak reference, of the training iterators
        self._primary_loader: int | None = None
        self._primary: Any = None  # weak reference to the primary training iterator
        self._primary_takes = 0  # training forwards that took from it
        self._ran_out = False  # the primary training iterator raised StopIteration
        # id -> weak reference, of the iterators whose first batch began a pass that turns the
        # epoch when a training forward takes from it
        self._passes: dict[int, Any] = {}

    @property
    def held(self) -> Held | None:
        return _summed(self._held)

    @property
    def train_iterators(self) -> tuple[int, ...]:
        return tuple(self._train)

    def training_alive(self) -> bool:
        """Whether an iterator that fed training is alive (one run out may still be: a loop
        that fetches ahead trains on its last batch after that, maybe more than once)."""
        return any(ref() is not None for ref in self._train.values())

    def feeds_training(self, iterator: Any) -> bool:
        """Whether ``iterator`` is one whose batches fed a training forward."""
        return self._trains(id(iterator), iterator)

    def _trains(self, key: int, iterator: Any) -> bool:
        ref = self._train.get(key)
        return ref is not None and iterator is not None and ref() is iterator

    def fetched(self, iterator: Any, start: int, end: int) -> None:
        self._evaluated = None  # a new batch: the evaluated one was evaluation only
        held = self._held
        key, loader = id(iterator), _loader_key(iterator)
        if getattr(iterator, "_num_yielded", None) == 1:  # a pass's first batch
            for earlier in [k for k, entry in held.items() if entry[_LOADER] == loader]:
                del held[earlier]
            passes = self._passes
            for gone in [k for k, ref in passes.items() if ref() is None]:
                del passes[gone]  # (before this iterator, which may have a freed one's id)
            if loader == self._primary_loader or self._ran_out:
                passes[key] = weakref.ref(iterator)
            if self._primary is not None and self._primary() is iterator:
                self._primary_takes = 0  # a persistent-workers loader's iterator, reset
        entry = held.get(key)
        if entry is not None and entry[_REF]() is iterator:
            entry[_NS] += end - start
        else:
            held[key] = [weakref.ref(iterator), start, end - start, loader]

    def exhausted(self, iterator: Any, start: int = 0, end: int = 0) -> None:
        """``iterator`` raised StopIteration, from ``start`` to ``end`` (its workers' shutdown):
        a wait for the next training forward, where the loop fetches ahead (Accelerate's
        loader: the last batch is trained on after this); else in the gap, dropped with the
        next pass's first batch."""
        key = id(iterator)
        entry = self._held.get(key)
        if entry is not None and entry[_REF]() is iterator:
            entry[_NS] += end - start
        if self._trains(key, iterator):
            if self._primary is not None and self._primary() is iterator:
                self._ran_out = True
                # Fewer forwards took from it than it yielded: the loop holds a batch it
                # fetched ahead, and trains on it next (else the epoch is over: the gap).
                yielded = getattr(iterator, "_num_yielded", 0)
                if entry is None and self._primary_takes < yielded:
                    self._held[key] = [self._primary, start, end - start, _loader_key(iterator)]
            return
        if entry is not None and entry[_LOADER] == self._primary_loader:
            # A pass over the training loader that ran out before a forward took from it (an
            # epoch no longer than what Accelerate / the HF Trainer fetch ahead): kept.
            return
        self._held.pop(key, None)  # an evaluation loop's last batch
        evaluated = self._evaluated
        if evaluated is not None and key in evaluated[0]:
            self._evaluated = None

    def iterator_of(self, held: Held | None) -> Any:
        """The iterator of ``held``'s first fetch (what :meth:`for_training` returned: the
        primary training loader's, once a forward takes them), or None."""
        if held is None:
            return None
        first = held[0][0]
        entry = self._held.get(first) or self._evaluated_entries.get(first)
        return entry[_REF]() if entry is not None else None

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
            gone = [key for key, entry in held.items() if entry[_REF]() is None]
            if len(gone) < len(held):  # (all gone: ``next(iter(loader))``, freed at once)
                for key in gone:
                    del held[key]  # a loop broken out of, its iterator freed: it fed nothing
            return _summed(held)
        evaluated = self._evaluated
        if evaluated is None:
            return None
        entries = self._evaluated_entries
        alive = [entry[_REF]() for entry in entries.values()]
        train_alive = [ref() for ref in self._train.values() if ref() is not None]
        # (``is None`` tests only: a DataLoader iterator's truth is its __len__, which may raise)
        if not train_alive or all(iterator is None for iterator in alive):
            return evaluated  # nothing known alive to tell them apart
        if any(self._trains(key, it) for key, it in zip(entries, alive, strict=True)):
            return evaluated
        return None

    def epoch_turned(self, taken: Held | None) -> bool:
        """Whether the training forward taking ``taken`` starts a new epoch (said once)."""
        passes = self._passes
        if passes and taken is not None and any(key in passes for key in taken[0]):
            # (a freed iterator's key stays until the next pass begins: ``next(iter(loader))``
            # each step, its iterator gone before the forward, still took from it)
            passes.clear()
            self._ran_out = False
            return True
        return False

    def take(self, taken: Held | None) -> None:
        """A training forward took ``taken`` (``for_training``'s)."""
        if taken is not None:
            entries = self._held
            if not entries and self._evaluated is taken:
                entries = self._evaluated_entries
            self._train = {key: entries[key][_REF] for key in taken[0] if key in entries}
            first = entries.get(taken[0][0])
            if first is not None:
                # (one weak reference per live iterator: CPython hands out the same one)
                same = first[_REF] is self._primary
                self._primary_takes = self._primary_takes + 1 if same else 1
                self._primary, self._primary_loader = first[_REF], first[_LOADER]
        self._held = {}
        self._evaluated = None

    def drop(self) -> None:
        """The open step is not a step (the framework starts its loop over)."""
        self._held = {}
        self._evaluated = None


def _summed(held: dict[int, list[Any]]) -> Held | None:
    if not held:
        return None
    entries = held.values()
    return (
        tuple(held),
        min(entry[_START] for entry in entries),
        sum(entry[_NS] for entry in entries),
    )
