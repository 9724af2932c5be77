"""The input breakdown (pure) and the worker-side timing's promises to the user's objects."""

from __future__ import annotations

from torch.utils.data import DataLoader, Dataset

from traceml.analysis import input_pipeline
from traceml.capture.instruments import dataloader


def record(epoch, producers, **extra):
    return {
        "kind": "input",
        "epoch": epoch,
        "num_workers": 4,
        "cpu_count": 16,
        "persistent_workers": False,
        "producers": producers,
        **extra,
    }


def worker(index, batches, busy_ms, span_ms, getitem_ms=None):
    return {
        "worker": index,
        "batches": batches,
        "samples": batches * 8,
        "getitem_ms": busy_ms - 10 * batches if getitem_ms is None else getitem_ms,
        "collate_ms": 10.0 * batches,
        "busy_ms": busy_ms,
        "span_ms": span_ms,
    }


def test_busy_workers_get_a_worker_count_and_a_predicted_wait():
    records = [
        record(0, [worker(i, 10, 3100.0, 3200.0) for i in range(4)], worker_startup_ms=24000.0),
        record(1, [worker(i, 10, 3100.0, 3200.0) for i in range(4)], worker_startup_ms=24000.0),
    ]
    breakdown = input_pipeline.summarise(records)
    assert breakdown["busy_ms_per_batch"] == 310.0
    assert breakdown["batches_per_worker"] == {"0": 20, "1": 20, "2": 20, "3": 20}
    text, evidence = input_pipeline.advice(breakdown, step_ms=198.0, input_wait_ms=78.0)
    # 310 ms per batch, one needed every 120 ms: ceil(310/120) = 3 workers keep up.
    assert evidence["workers_needed"] == 3 and evidence["dominant"] == "getitem"
    assert input_pipeline.predicted_input_wait_ms(breakdown, 120.0, 2) == 35.0
    assert "persistent_workers=True" in text and "16 cores" in text


def test_idle_workers_point_at_the_main_process():
    breakdown = input_pipeline.summarise([record(0, [worker(0, 10, 400.0, 1000.0)])])
    text, _ = input_pipeline.advice(breakdown, step_ms=100.0, input_wait_ms=60.0)
    assert "idle 60%" in text and "main process" in text


def test_no_records_no_breakdown():
    assert input_pipeline.summarise([]) is None
    assert input_pipeline.advice(None, 1.0, 1.0) is None


def test_counts_beyond_the_value_bound_are_unmeasured():
    # int(1e300) is a Python int that orjson cannot write into the summary.
    huge = worker(1, 10, 400.0, 1000.0)
    huge["batches"] = 1e300
    breakdown = input_pipeline.summarise([record(0, [worker(0, 10, 400.0, 1000.0), huge])])
    assert breakdown["batches"] == 10 and breakdown["batches_per_worker"] == {"0": 10}
    # Each producer in range, their total past it: no breakdown rather than a crash.
    many = [worker(i, 10, 400.0, 1000.0) | {"batches": 1e18} for i in range(20)]
    assert input_pipeline.summarise([record(0, many)]) is None


class Items(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return [index]


def collate(batch):
    return ("made", batch)


class Owner:
    def __init__(self):
        self.failures = []

    def _entry_failed(self, name, exc):
        self.failures.append(name)


def test_the_users_objects_and_calls_are_unchanged_and_everything_is_undone():
    items = Items()
    loader = DataLoader(items, batch_size=4, collate_fn=collate)
    timing, reason = dataloader.install_input_timing(loader, Owner())
    assert reason is None
    batches = list(loader)
    assert batches == [("made", [[0], [1], [2], [3]]), ("made", [[4], [5], [6], [7]])]
    produced = timing.epoch_record(0)["producers"]
    assert produced[0]["batches"] == 2 and produced[0]["samples"] == 8
    timing.uninstall()
    assert type(items) is Items and type(loader) is DataLoader and loader.collate_fn is collate


def test_a_failure_inside_traceml_never_reaches_the_batch(monkeypatch):
    owner = Owner()
    loader = DataLoader(Items(), batch_size=4, collate_fn=collate)
    timing, _ = dataloader.install_input_timing(loader, owner)
    monkeypatch.setattr(timing, "_here", lambda: 1 / 0)
    assert next(iter(loader)) == ("made", [[0], [1], [2], [3]])
    assert owner.failures == ["dataloader.batch"]
    timing.uninstall()
