"""The step callback out of Lightning's per-batch dispatch while the epoch loop runs
(``lightning_dispatch``). Pure list logic on a stand-in loop; on real Lightning:
test_lightning_capture.py (out during the epoch, back for its end, after fit)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from traceml.capture.frameworks.lightning_dispatch import out_of_callbacks_while_epochs_run


class EpochLoop:
    def __init__(self, trainer, during=None):
        self.trainer, self.during, self.seen = trainer, during, None

    def run(self, fetcher):
        self.seen = list(self.trainer.callbacks)
        if self.during is not None:
            self.during(self.trainer)
        return ("ran", fetcher)


class Touchy:
    def __eq__(self, other):  # a user's callback whose comparison must never run
        raise AssertionError("compared")

    __hash__ = object.__hash__


def trainer_with(callbacks, during=None):
    trainer = SimpleNamespace(callbacks=list(callbacks))
    trainer.fit_loop = SimpleNamespace(epoch_loop=EpochLoop(trainer, during))
    return trainer


def test_out_while_the_epoch_loop_runs_and_back_at_its_place():
    ours, first, last = object(), Touchy(), Touchy()
    trainer = trainer_with([first, ours, last])
    undo = out_of_callbacks_while_epochs_run(trainer, ours)
    loop = trainer.fit_loop.epoch_loop
    assert loop.run("fetcher") == ("ran", "fetcher")
    assert [id(c) for c in loop.seen] == [id(first), id(last)]
    assert [id(c) for c in trainer.callbacks] == [id(first), id(ours), id(last)]
    undo()
    assert "run" not in vars(loop)  # the class's method again
    loop.run("again")
    assert any(c is ours for c in loop.seen)


def test_the_users_exception_passes_through_and_the_callback_is_back():
    ours = object()

    def fail(trainer):
        raise KeyboardInterrupt  # not even an Exception: passes through as it is

    trainer = trainer_with([ours], during=fail)
    out_of_callbacks_while_epochs_run(trainer, ours)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit_loop.epoch_loop.run(None)
    assert trainer.callbacks == [ours]


def test_a_list_changed_meanwhile_keeps_the_users_changes():
    ours, theirs, added = object(), object(), object()
    trainer = trainer_with([theirs, ours], during=lambda t: t.callbacks.append(added))
    out_of_callbacks_while_epochs_run(trainer, ours)
    trainer.fit_loop.epoch_loop.run(None)
    assert [id(c) for c in trainer.callbacks] == [id(theirs), id(ours), id(added)]


def test_a_callback_put_back_by_someone_else_is_not_there_twice():
    ours = object()
    trainer = trainer_with([ours], during=lambda t: t.callbacks.append(ours))
    out_of_callbacks_while_epochs_run(trainer, ours)
    trainer.fit_loop.epoch_loop.run(None)
    assert trainer.callbacks == [ours]


def test_nothing_wrapped_where_the_loop_has_its_own_run_or_none():
    ours = object()
    trainer = trainer_with([ours])
    own = trainer.fit_loop.epoch_loop.run = lambda fetcher: trainer.callbacks[:]
    out_of_callbacks_while_epochs_run(trainer, ours)()
    assert trainer.fit_loop.epoch_loop.run is own
    assert own(None) == [ours]
    bare = SimpleNamespace(callbacks=[ours], fit_loop=SimpleNamespace())
    out_of_callbacks_while_epochs_run(bare, ours)()  # a no-op undo
    assert bare.callbacks == [ours]
