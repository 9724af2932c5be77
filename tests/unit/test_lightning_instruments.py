"""The Lightning strategy wrappers' bookkeeping, on stand-ins (pure logic; on real Lightning:
test_attribution.py, test_fault_injection.py, test_transparency.py)."""

from __future__ import annotations

import pytest

from traceml.capture.frameworks.lightning_instruments import Instruments, _set_instance_attribute


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
    undo = _set_instance_attribute(strategy, "backward", lambda loss: loss)
    undo()
    assert strategy.__dict__["backward"] is theirs
    plain = Strategy()
    _set_instance_attribute(plain, "backward", lambda loss: loss)()
    assert "backward" not in vars(plain)


@pytest.mark.parametrize("one_door", [True, False])
def test_a_raising_backward_passes_through_and_leaves_nothing_open(one_door):
    from traceml.capture.frameworks.lightning_instruments import InBackward

    strategy, observer = Strategy(), Observer()
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
    assert strategy.backward("loss") == "loss"
    instruments.remove()
    assert "backward" not in vars(strategy)


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
def test_one_timed_fetcher_class_serves_the_event_log_and_the_guarded_doors(one_door):
    from traceml.capture.frameworks import lightning_instruments as li

    observer, logged = FetchObserver(), []
    instruments = Instruments(observer)
    instruments.one_door = one_door
    instruments.doors = logged.append if one_door else observer
    fetcher = Fetcher(["a", "b"])
    instruments.instrument_fetcher(fetcher)
    assert type(fetcher) is li.timed_fetcher_class(Fetcher)
    assert type(fetcher).__name__ == "TraceMLTimedFetcher"
    assert list(fetcher) == ["a", "b"]  # StopIteration passes through, not logged
    if one_door:
        assert [event[0] for event in logged] == [li.ITERATOR_DOOR, li.FETCH_DOOR, li.FETCH_DOOR]
        assert all(len(event) == 3 and event[2] >= event[1] for event in logged)
        assert observer.calls == []
    else:
        assert observer.calls == [("iterator", True), ("fetched", True), ("fetched", True)]
        assert logged == []
    instruments.remove()
    assert type(fetcher) is Fetcher and "_traceml_observer" not in vars(fetcher)


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
