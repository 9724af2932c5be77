"""The input timing times a batch once and changes nothing the user's objects do or are.

The user's dataset, DataLoader and collate_fn keep their class and attributes while timed
(pickle, deepcopy, validation loaders over the same dataset); the counters' sequence lock never
hands out a half-written slot; the process-wide start method is left unset.
"""

from __future__ import annotations

import copy
import gc
import multiprocessing
import os
import pickle
import struct
import weakref

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from traceml.capture.instruments import dataloader, input_counters, input_fetch


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


class Owner:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def _entry_failed(self, name: str, exc: BaseException) -> None:
        self.failures.append(name)


def stack(batch):
    return torch.stack(batch)


@pytest.fixture
def timed():
    """install_input_timing on a loader, uninstalled after the test."""
    installed = []

    def install(loader):
        timing, reason = dataloader.install_input_timing(loader, Owner())
        assert reason is None
        installed.append(timing)
        return timing

    yield install
    for timing in installed:
        timing.uninstall()


@pytest.mark.parametrize("base", [Squares, SquaresWithGetitems])
def test_one_timing_per_batch_and_the_same_batches(timed, base):
    plain, traced = base(), base()
    expected = [b.tolist() for b in DataLoader(plain, batch_size=4)]
    loader = DataLoader(traced, batch_size=4)
    timing = timed(loader)
    got = [b.tolist() for b in loader]
    assert got == expected
    assert traced.calls == plain.calls  # the user's own methods, called exactly as untimed
    (producer,) = timing.epoch_record(0)["producers"]
    assert producer["batches"] == 3 and producer["samples"] == 10


def test_unbatched_loading_times_each_item(timed):
    loader = DataLoader(Squares(), batch_size=None)
    timing = timed(loader)
    assert [b.tolist() for b in loader][:2] == [[0], [1]]
    (producer,) = timing.epoch_record(0)["producers"]
    assert producer["batches"] == 10 and producer["samples"] == 10


def test_a_user_error_passes_through_untouched(timed):
    class Broken(Squares):
        def __getitem__(self, index: int) -> torch.Tensor:
            raise KeyError(f"no item {index}")

    loader = DataLoader(Broken(), batch_size=4)
    timed(loader)
    with pytest.raises(KeyError, match="no item 0"):
        next(iter(loader))


def test_the_users_objects_keep_their_class_and_pickle_as_untraced(timed):
    dataset = Squares()
    loader = DataLoader(dataset, batch_size=4, collate_fn=stack)
    timed(loader)
    iterator = iter(loader)
    next(iterator)  # mid-epoch, as in a training_step
    assert type(dataset) is Squares and type(loader) is DataLoader and loader.collate_fn is stack
    for obj in (dataset, stack):
        assert b"traceml" not in pickle.dumps(obj)
    assert type(copy.deepcopy(dataset)) is Squares
    buffer = pickle.loads(pickle.dumps(dataset))
    assert type(buffer) is Squares and buffer.calls == dataset.calls


def _has_own_dict(obj) -> bool:
    # gc's view, not obj.__dict__: reading that would make the dict this looks for
    return any(type(referent) is dict for referent in gc.get_referents(obj))


def test_the_fetcher_keeps_its_class_no_dict_of_its_own_and_its_class_comes_back():
    from torch.utils.data._utils.fetch import _MapDatasetFetcher

    untimed = _MapDatasetFetcher.__dict__["fetch"]
    loader = DataLoader(Squares(), batch_size=4, collate_fn=stack)
    timing, _ = dataloader.install_input_timing(loader, Owner())
    iterator = iter(loader)
    next(iterator)
    fetcher = iterator._dataset_fetcher
    assert type(fetcher) is _MapDatasetFetcher and not _has_own_dict(fetcher)
    assert _MapDatasetFetcher.fetch.__wrapped__ is untimed  # inspect sees torch's
    assert type(fetcher.collate_fn) is input_fetch.TimedCollate
    timing.uninstall()
    assert _MapDatasetFetcher.__dict__["fetch"] is untimed
    # The epoch's fetcher gets the user's collate_fn back: its batches skip TimedCollate.
    assert fetcher.collate_fn is stack and not _has_own_dict(fetcher)
    assert [b.tolist() for b in iterator] == [[[16], [25], [36], [49]], [[64], [81]]]
    assert timing.epoch_record(0)["producers"][0]["batches"] == 1  # untimed after the undo


def test_the_fetchers_undo_leaves_a_collate_fn_set_since_and_keeps_no_fetcher_alive():
    class Fetcher:
        def __init__(self) -> None:
            self.collate_fn = stack

    kept, dropped = Fetcher(), Fetcher()
    undo_kept, undo_dropped = input_fetch.time_fetcher(kept), input_fetch.time_fetcher(dropped)
    assert input_fetch.time_fetcher(kept)() is None  # timed already: nothing to undo twice
    theirs = kept.collate_fn = lambda batch: batch  # set by someone else since
    gone = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert gone() is None  # the undo holds the fetcher weakly
    undo_kept()
    undo_dropped()
    assert kept.collate_fn is theirs


def test_a_door_left_under_a_later_patch_times_nothing_and_lets_go_of_the_timing():
    from torch.utils.data._utils.fetch import _MapDatasetFetcher

    untimed = _MapDatasetFetcher.__dict__["fetch"]
    loader = DataLoader(Squares(), batch_size=4, collate_fn=stack)
    timing, _ = dataloader.install_input_timing(loader, Owner())
    door = _MapDatasetFetcher.__dict__["fetch"]

    def theirs(self, possibly_batched_index):  # another tool's patch, stacked on the door
        return door(self, possibly_batched_index)

    _MapDatasetFetcher.fetch = theirs
    try:
        iterator = iter(loader)
        next(iterator)
        timing.uninstall()
        assert _MapDatasetFetcher.__dict__["fetch"] is theirs  # theirs stays
        assert [b.tolist() for b in iterator] == [[[16], [25], [36], [49]], [[64], [81]]]
        assert timing.epoch_record(0)["producers"][0]["batches"] == 1  # none after the undo
        gone = weakref.ref(timing)
        del timing
        gc.collect()
        assert gone() is None  # the door on the class keeps nothing alive
    finally:
        _MapDatasetFetcher.fetch = untimed


def test_a_validation_loader_over_the_same_dataset_is_not_counted(timed):
    dataset = Squares()
    train = DataLoader(dataset, batch_size=5)
    timing = timed(train)
    list(train)
    list(DataLoader(dataset, batch_size=2))  # validation, sharing the dataset
    (producer,) = timing.epoch_record(0)["producers"]
    assert producer["batches"] == 2 and producer["samples"] == 10


def test_a_failure_inside_traceml_never_reaches_the_batch(timed, monkeypatch):
    loader = DataLoader(Squares(), batch_size=4, collate_fn=stack)
    timing = timed(loader)
    monkeypatch.setattr(timing, "_here", lambda: 1 / 0)
    assert next(iter(loader)).tolist() == [[0], [1], [4], [9]]
    assert timing.observer.failures == ["dataloader.batch"]


def test_everything_is_undone():
    dataset = Squares()
    loader = DataLoader(dataset, batch_size=4, collate_fn=stack)
    timing, _ = dataloader.install_input_timing(loader, Owner())
    list(loader)
    timing.uninstall()
    assert DataLoader.__dict__["_get_iterator"] is not dataloader._timed_get_iterator
    assert "worker_init_fn" in loader.__dict__ and loader.worker_init_fn is None


def test_the_process_wide_start_method_is_left_unset(timed, monkeypatch):
    # A fresh default context, as in a new process: nothing has chosen a method yet.
    context = multiprocessing.context._default_context
    monkeypatch.setattr(context, "_actual_context", None)
    loader = DataLoader(Squares(), batch_size=4)
    timing = timed(loader)
    list(loader)
    assert timing.epoch_record(0)["start_method"] in multiprocessing.get_all_start_methods()
    assert multiprocessing.get_start_method(allow_none=True) is None


def test_install_failing_half_way_leaves_no_file(monkeypatch):
    made = []
    real = input_counters.file_backed_map

    def file_backed_map():
        shared, path = real()
        made.append(path)
        return shared, path

    monkeypatch.setattr(input_counters, "file_backed_map", file_backed_map)
    monkeypatch.setattr(dataloader, "_wrap_get_iterator", lambda cls: 1 / 0)
    loader = DataLoader(Squares(), batch_size=4, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(ZeroDivisionError):
        dataloader.install_input_timing(loader, Owner())
    assert made and not os.path.exists(made[0])


class ByteByByte:
    """A struct.Struct whose pack_into writes one byte at a time and lets a reader look after
    each byte: a real writer can be interrupted anywhere, and the reader must never accept a
    slot that is neither the old nor the new one."""

    def __init__(self, real: struct.Struct, check) -> None:
        self.real, self.check, self.size = real, check, real.size

    def pack_into(self, buffer, offset, *values):
        data = self.real.pack(*values)
        for index, byte in enumerate(data):
            buffer[offset + index] = byte
            self.check()

    def unpack_from(self, buffer, offset=0):
        return self.real.unpack_from(buffer, offset)


def test_a_reader_never_accepts_a_half_written_slot(monkeypatch):
    shared = bytearray(input_counters.MAP_SIZE)
    counters = input_counters.ProcessCounters(pid=7, slot=1)
    counters.samples, counters.batches = 4, 1
    counters.publish(shared)
    old = input_counters.read_slots(shared)[1]
    counters.samples, counters.batches, counters.getitem_ns = 8, 2, 10**12
    seen = []

    def check():
        slot = input_counters.read_slots(shared).get(1)
        seen.append(slot)

    for name in ("_SEQ", "_DATA", "_SLOT"):
        if hasattr(input_counters, name):
            monkeypatch.setattr(
                input_counters, name, ByteByByte(getattr(input_counters, name), check)
            )
    counters.publish(shared)
    monkeypatch.undo()
    new = input_counters.read_slots(shared)[1]
    assert new != old
    assert {slot for slot in seen if slot is not None} <= {old, new}


def start_worker(worker_id):
    pass


@pytest.mark.parametrize("door", ["dataloader.iterator", "dataloader.iterator_made"])
def test_a_failing_iterator_door_still_gives_the_users_loader_back(timed, monkeypatch, door):
    from traceml.capture import guard

    loader = DataLoader(
        Squares(),
        batch_size=5,
        num_workers=1,
        worker_init_fn=start_worker,
        multiprocessing_context="fork",
    )
    timing = timed(loader)
    monkeypatch.setattr(guard, "_inject", door)
    assert [b.tolist() for b in loader] == [
        [[0], [1], [4], [9], [16]],
        [[25], [36], [49], [64], [81]],
    ]
    assert loader.worker_init_fn is start_worker
    assert timing.observer.failures == [door]
