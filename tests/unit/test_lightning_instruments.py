"""The Lightning strategy wrappers' bookkeeping, on stand-ins (pure logic; on real Lightning:
test_attribution.py, test_fault_injection.py, test_transparency.py)."""

from __future__ import annotations

import gc
import sys

import pytest

from traceml.capture.class_doors import door_on_class, set_instance_attribute
from traceml.capture.frameworks.lightning_instruments import (
    FETCH_DOOR,
    ITERATOR_DOOR,
    InBackward,
    Instruments,
)


class Strategy:
    def backward(self, loss):
        if loss == "raise":
            raise ValueError("the user's backward failed")
        return loss


class Observer:
    def __init__(self) -> None:
        self.calls: list = []

    def backward_started(self) -> None:
        self.calls.append("started")

    def backward_ended(self) -> None:
        self.calls.append("ended")

    def __call__(self, event: tuple) -> None:  # one-door timing: the event log's append
        door, start, end = event
        assert door == "lightning.backward_timed" and end >= start
        self.calls.append("timed")


def test_the_undo_gives_back_an_instance_attribute_that_was_there_before():
    strategy = Strategy()
    theirs = strategy.backward
    strategy.backward = theirs  # someone's own instance-level backward
    undo = set_instance_attribute(strategy, "backward", lambda loss: loss)
    undo()
    assert strategy.__dict__["backward"] is theirs
    plain = Strategy()
    set_instance_attribute(plain, "backward", lambda loss: loss)()
    assert "backward" not in vars(plain)


@pytest.mark.parametrize("one_door", [True, False])
def test_a_raising_backward_passes_through_and_leaves_nothing_open(one_door):
    from traceml.capture.frameworks.lightning_instruments import InBackward

    strategy, other, observer = Strategy(), Strategy(), Observer()
    original = vars(Strategy)["backward"]
    instruments = Instruments(observer)
    inside = InBackward()
    if one_door:
        instruments.doors = observer  # as install() sets the session's event log
        instruments._wrap_backward_once(strategy, inside)
    else:
        instruments._wrap_backward(strategy)
    with pytest.raises(ValueError, match="the user's backward failed"):
        strategy.backward("raise")
    assert inside.depth == 0
    assert observer.calls == (["timed"] if one_door else ["started", "ended"])
    assert other.backward("theirs") == "theirs"  # another strategy of that class: untimed
    assert observer.calls == (["timed"] if one_door else ["started", "ended"])
    assert strategy.backward("loss") == "loss"
    assert vars(Strategy)["backward"] is not original  # the door, on the class
    instruments.remove()
    assert "backward" not in vars(strategy) and vars(Strategy)["backward"] is original


class EventLog:
    """One-door timing's event log (its doors' names, in order), as install() gives it."""

    needs_start_doors = staticmethod(lambda: False)

    def __init__(self) -> None:
        self.calls: list = []

    def __call__(self, event) -> None:
        self.calls.append(event[0])


@pytest.mark.parametrize("one_door", [True, False])
def test_the_transfer_and_optimizer_doors_time_only_the_traced_strategy(one_door):
    class Steps:
        def batch_to_device(self, batch):
            return batch

        def optimizer_step(self, value):
            return value + 1

    class Doors(EventLog):  # the event log (one door) or the observer's entry points
        def transferred(self, start) -> None:
            self.calls.append("transferred")

        def optimizer_stepped(self) -> None:
            self.calls.append("stepped")

    originals = dict(vars(Steps))
    strategy, other, doors = Steps(), Steps(), Doors()
    instruments = Instruments(doors)
    instruments.one_door, instruments.doors = one_door, doors
    instruments._wrap_transfer(strategy)
    instruments._wrap_optimizer_step(strategy)
    assert other.batch_to_device("b") == "b" and other.optimizer_step(1) == 2
    assert doors.calls == []  # another strategy of that class goes straight through
    assert strategy.batch_to_device("b") == "b" and strategy.optimizer_step(1) == 2
    if one_door:
        assert doors.calls == ["lightning.batch_transferred", "lightning.optimizer_stepped"]
    else:
        assert doors.calls == ["transferred", "stepped"]
    instruments.remove()
    assert dict(vars(Steps)) == originals  # the class as it was, function for function


class LightningSignatures:
    """Lightning's own Strategy signatures (2.x): the doors with the same parameters."""

    def batch_to_device(self, batch, device=None, dataloader_idx=0):
        return (batch, device, dataloader_idx)

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        return (closure_loss, optimizer, args, kwargs)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        return (optimizer, closure, model, kwargs)


def test_lightnings_own_strategy_methods_get_the_doors_with_their_parameters():
    from lightning.pytorch.strategies import Strategy as LightningStrategy

    from traceml.capture.class_doors import takes

    names = {
        "batch_to_device": (("self", "batch", "device", "dataloader_idx"), (None, 0), 0),
        "backward": (("self", "closure_loss", "optimizer"), None, 3),
        "optimizer_step": (("self", "optimizer", "closure", "model"), (None,), 2),
    }
    for name, (params, defaults, rest) in names.items():
        assert takes(vars(LightningStrategy)[name], params, defaults, rest), name
        assert takes(vars(LightningSignatures)[name], params, defaults, rest), name
        assert not takes(vars(LightningSignatures)[name], params[:-1], defaults, rest), name
    batch_to_device = vars(LightningSignatures)["batch_to_device"]
    assert not takes(batch_to_device, names["batch_to_device"][0], (None, False), 0)

    originals = dict(vars(LightningSignatures))
    strategy, other, doors = LightningSignatures(), LightningSignatures(), EventLog()
    instruments = Instruments(doors)
    instruments.one_door, instruments.doors = True, doors
    instruments._wrap_transfer(strategy)
    instruments._wrap_optimizer_step(strategy)
    instruments._wrap_backward_once(strategy, InBackward())
    assert vars(LightningSignatures)["batch_to_device"].__code__.co_argcount == 4
    for target in (strategy, other):  # every call passes on what it was given, as untraced
        assert target.batch_to_device("b", dataloader_idx=3) == ("b", None, 3)
        assert target.batch_to_device("b", "cpu") == ("b", "cpu", 0)
        assert target.backward("l", "o") == ("l", "o", (), {})
        assert target.backward("l", "o", 1, k=2) == ("l", "o", (1,), {"k": 2})
        assert target.optimizer_step("o", "c") == ("o", "c", None, {})
        assert target.optimizer_step("o", "c", model="m", k=2) == ("o", "c", "m", {"k": 2})
    assert doors.calls == [
        "lightning.batch_transferred",
        "lightning.batch_transferred",
        "lightning.backward_timed",
        "lightning.backward_timed",
        "lightning.optimizer_stepped",
        "lightning.optimizer_stepped",
    ]  # the traced strategy's calls only
    with pytest.raises(TypeError, match=r"batch_to_device\(\) got an unexpected keyword"):
        strategy.batch_to_device("b", nope=1)
    instruments.remove()
    assert dict(vars(LightningSignatures)) == originals


class Fetcher:
    def __init__(self, batches):
        self.batches = list(batches)

    def __iter__(self):
        self.position = 0
        return self

    def __next__(self):
        if self.position == len(self.batches):
            raise StopIteration
        self.position += 1
        return self.batches[self.position - 1]


class FetchObserver:
    """The callback's two fetcher doors, recording what reaches them."""

    def __init__(self) -> None:
        self.calls: list = []

    def fetched(self, start: int, end: int) -> None:
        self.calls.append(("fetched", end >= start))

    def iterator_created(self, start: int, end: int) -> None:
        self.calls.append(("iterator", end >= start))


@pytest.mark.parametrize("one_door", [True, False])
def test_the_fetcher_doors_serve_the_event_log_and_the_guarded_doors(one_door):
    observer, logged = FetchObserver(), []
    instruments = Instruments(observer)
    instruments.one_door = one_door
    instruments.doors = logged.append if one_door else observer
    fetcher, other = Fetcher(["a", "b"]), Fetcher(["c"])
    originals = dict(vars(Fetcher))
    instruments.instrument_fetcher(fetcher)
    assert type(fetcher) is Fetcher  # the door is on the class, the object keeps its type
    assert list(other) == ["c"]  # another fetcher of that class: straight through, untimed
    assert list(fetcher) == ["a", "b"]  # StopIteration passes through, not logged
    if one_door:
        assert [event[0] for event in logged] == [ITERATOR_DOOR, FETCH_DOOR, FETCH_DOOR]
        assert all(len(event) == 3 and event[2] >= event[1] for event in logged)
        assert observer.calls == []
    else:
        assert observer.calls == [("iterator", True), ("fetched", True), ("fetched", True)]
        assert logged == []
    instruments.remove()
    assert dict(vars(Fetcher)) == originals  # the class's own methods back
    assert list(fetcher) == ["a", "b"] and len(logged) + len(observer.calls) == 3


def _has_own_dict(obj) -> bool:
    """Whether ``obj``'s ``__dict__`` has been made (CPython 3.11+ keeps attribute values
    inline until then: gc sees the values among its referents, not a dict). Without reading
    ``obj.__dict__``, which would make it; only for objects with no dict among their values."""
    return any(type(referent) is dict for referent in gc.get_referents(obj))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="attribute values inline since 3.11")
def test_the_doors_leave_the_strategy_and_the_fetcher_without_a_dict_of_their_own():
    # An instance-level door makes the object's __dict__ (a new attribute, a __class__
    # assignment, a read of __dict__), and Lightning's ~80 method loads a batch on these two
    # objects then lose the interpreter's fast path for good (~40,000 instructions a batch).
    class Inline:
        def __init__(self) -> None:
            self.calls = 0

        def backward(self, loss):
            self.calls += 1
            return loss

    strategy, fetcher, logged = Inline(), Fetcher(["a"]), []
    original = vars(Inline)["backward"]
    assert not _has_own_dict(strategy) and not _has_own_dict(fetcher)
    instruments = Instruments(Observer())
    instruments.one_door, instruments.doors = True, logged.append  # as install() sets them
    instruments._wrap_backward_once(strategy, InBackward())
    instruments.instrument_fetcher(fetcher)
    assert strategy.backward("loss") == "loss" and list(fetcher) == ["a"]
    assert [event[0] for event in logged] == [
        "lightning.backward_timed",
        ITERATOR_DOOR,
        FETCH_DOOR,
    ]
    instruments.remove()
    assert vars(Inline)["backward"] is original  # the class as it was
    assert strategy.calls == 1
    assert not _has_own_dict(strategy) and not _has_own_dict(fetcher)
    set_instance_attribute(strategy, "backward", lambda loss: loss)  # the way it was done
    assert _has_own_dict(strategy)  # (what the check above would have seen)


def _recording(seen: list):
    """A door maker whose door notes the arguments of its own object's calls in ``seen``."""

    def make(call, target):
        def door(this, *args, **kwargs):
            if this is target.obj:
                seen.append(args)
            return call(this, *args, **kwargs)

        return door

    return make


def test_a_door_on_the_class_times_only_its_own_object_and_goes_back():
    class Strategy:
        def step(self, value):
            """the user's step"""
            return value * 2

    timed, other = Strategy(), Strategy()
    original, seen = vars(Strategy)["step"], []

    undo = door_on_class(timed, "step", _recording(seen))
    assert timed.step(2) == 4 and other.step(value=3) == 6
    assert seen == [(2,)]
    assert Strategy.step.__name__ == "step" and Strategy.step.__doc__ == "the user's step"
    assert Strategy.step.__wrapped__ is original
    undo()
    assert vars(Strategy)["step"] is original and timed.step(5) == 10
    assert seen == [(2,)]


def test_a_door_left_on_its_class_by_an_undo_out_of_order_times_and_keeps_nothing():
    import weakref

    class Strategy:
        def step(self, value):
            return value

    timed, seen = Strategy(), []

    first = door_on_class(timed, "step", _recording(seen))
    second = door_on_class(timed, "step", _recording(seen))  # stacked on the first
    first()  # out of order: the first door stays under the second
    second()  # puts the first door back on the class
    assert timed.step(1) == 1 and seen == []  # it times nothing
    gone = weakref.ref(timed)
    del timed
    gc.collect()
    assert gone() is None  # and keeps nothing alive


def test_a_door_on_an_inherited_special_method_leaves_the_parents_behind():
    class Sub(Fetcher):
        pass

    fetcher, logged = Sub(["a", "b"]), []
    instruments = Instruments(FetchObserver())
    instruments.one_door, instruments.doors = True, logged.append
    instruments.instrument_fetcher(fetcher)
    assert "__next__" in vars(Sub)
    assert list(fetcher) == ["a", "b"] and len(logged) == 3
    instruments.remove()
    assert "__next__" not in vars(Sub) and "__iter__" not in vars(Sub)
    assert list(fetcher) == ["a", "b"] and len(logged) == 3  # the parent's, untimed


def test_a_door_goes_on_the_instance_where_the_class_cannot_take_it():
    class Strategy:
        def step(self, value):
            return value

    theirs, seen, original = Strategy(), [], vars(Strategy)["step"]
    theirs.step = lambda value: ("theirs", value)  # the user's own instance attribute

    def make(call, target):
        def door(this, *args, **kwargs):
            seen.append(this is target.obj)
            return call(this, *args, **kwargs)

        return door

    undo = door_on_class(theirs, "step", make)
    assert vars(Strategy)["step"] is original  # the class untouched
    assert theirs.step(1) == ("theirs", 1) and seen == [True]
    undo()
    assert theirs.step(2) == ("theirs", 2) and seen == [True]
    assert vars(theirs)["step"](3) == ("theirs", 3)  # their own attribute, back
    with pytest.raises(TypeError, match="cannot be timed on its class"):
        door_on_class(theirs, "step", make, on_instance=False)


def test_the_progress_counters_read_what_global_step_and_current_epoch_read():
    # Real Lightning: the step's end reads Lightning's progress trackers instead of the
    # properties; with gradient accumulation, over two epochs, at the module's batch-end hook
    # (where the step ends), they must agree every batch.
    import lightning.pytorch as pl
    import torch

    from traceml.capture.frameworks.lightning_instruments import progress_counters

    seen: list[tuple] = []

    class Tiny(pl.LightningModule):
        def __init__(self, manual: bool = False) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).sum()
            if not self.automatic_optimization:
                optimizer = self.optimizers()
                optimizer.zero_grad()
                self.manual_backward(loss)
                optimizer.step()
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            counters = progress_counters(self.trainer)
            if not self.automatic_optimization:
                seen.append(counters)
                return
            steps, epochs = counters
            trainer = self.trainer
            seen.append(
                (steps.completed, trainer.global_step, epochs.completed, trainer.current_epoch)
            )

    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(10, 2)), batch_size=2
    )
    options = dict(
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
    )
    pl.Trainer(accumulate_grad_batches=2, **options).fit(Tiny(), data)
    assert len(seen) == 10
    assert all(read[0] == read[1] and read[2] == read[3] for read in seen)
    assert [read[1] for read in seen] == [0, 1, 1, 2, 3, 3, 4, 4, 5, 6]  # it counts steps
    assert {read[3] for read in seen} == {0, 1}
    seen.clear()
    pl.Trainer(**options).fit(Tiny(manual=True), data)
    assert seen and all(read is None for read in seen)  # manual optimization: the properties


def test_the_progress_counters_are_none_where_lightning_has_no_such_trackers():
    from types import SimpleNamespace

    from traceml.capture.frameworks.lightning_instruments import progress_counters

    module = SimpleNamespace(automatic_optimization=True)
    trainer = SimpleNamespace(lightning_module=module, global_step=3, current_epoch=0)
    assert progress_counters(trainer) is None  # no fit_loop
    done = SimpleNamespace(completed=2)  # trackers that disagree with the properties
    loop = SimpleNamespace(
        epoch_loop=SimpleNamespace(
            automatic_optimization=SimpleNamespace(
                optim_progress=SimpleNamespace(
                    optimizer=SimpleNamespace(step=SimpleNamespace(total=done))
                )
            )
        ),
        epoch_progress=SimpleNamespace(current=SimpleNamespace(completed=0)),
    )
    trainer.fit_loop = loop
    assert progress_counters(trainer) is None
    done.completed = 3
    assert progress_counters(trainer) == (done, loop.epoch_progress.current)
