"""The timed dataset class times a batch once and changes nothing the user's dataset returns."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from traceml.capture.instruments import dataloader


class Squares(Dataset):
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> torch.Tensor:
        self.calls.append(index)
        return torch.tensor([index * index])


class SquaresWithGetitems(Squares):
    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        self.calls.append(-1)  # one call for the whole batch
        return [torch.tensor([i * i]) for i in indices]


class Recorder:
    on = True

    def __init__(self) -> None:
        self.made: list[int] = []

    def sample_made(self, start: int, samples: int) -> None:
        self.made.append(samples)


@pytest.mark.parametrize("base", [Squares, SquaresWithGetitems])
def test_one_timing_per_batch_and_the_same_batches(monkeypatch, base):
    plain, timed = base(), base()
    timed.__class__ = dataloader.timed_dataset_class(base)
    recorder = Recorder()
    monkeypatch.setattr(dataloader, "_active", recorder)
    expected = [b.tolist() for b in DataLoader(plain, batch_size=4)]
    got = [b.tolist() for b in DataLoader(timed, batch_size=4)]
    assert got == expected
    assert timed.calls == plain.calls  # the user's own methods, called exactly as untimed
    assert recorder.made == [4, 4, 2]


def test_unbatched_loading_times_each_item(monkeypatch):
    timed = Squares()
    timed.__class__ = dataloader.timed_dataset_class(Squares)
    recorder = Recorder()
    monkeypatch.setattr(dataloader, "_active", recorder)
    assert [b.tolist() for b in DataLoader(timed, batch_size=None)][:2] == [[0], [1]]
    assert recorder.made == [1] * 10


def test_a_user_error_passes_through_untouched(monkeypatch):
    class Broken(Squares):
        def __getitem__(self, index: int) -> torch.Tensor:
            raise KeyError(f"no item {index}")

    timed = Broken()
    timed.__class__ = dataloader.timed_dataset_class(Broken)
    monkeypatch.setattr(dataloader, "_active", Recorder())
    with pytest.raises(KeyError, match="no item 0"):
        next(iter(DataLoader(timed, batch_size=4)))
