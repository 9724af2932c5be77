"""What the rank file says about the traced training DataLoader: its ``input`` records.

Pure bookkeeping over the counters the producers publish (:mod:`input_counters`) and the
loader's configuration; nothing here runs per batch.
"""

from __future__ import annotations

import os
from typing import Any

from traceml.capture.instruments.input_counters import MAX_WORKERS, SLOT_FIELDS


def producers_since(
    slots: dict[int, tuple[int, ...]], seen: dict[int, tuple[int, ...]]
) -> tuple[list[dict[str, Any]], list[tuple[int, int]]]:
    """Per producer, what it made since the reading kept in ``seen`` (updated), and the
    (first start, first end) of the workers seen for the first time."""
    workers = []
    started: list[tuple[int, int]] = []  # (first start, first end) of workers new here
    for slot, values in sorted(slots.items()):
        fields = dict(zip(SLOT_FIELDS, values, strict=True))
        previous = seen.get(fields["pid"])
        seen[fields["pid"]] = values
        if previous is not None:
            before = dict(zip(SLOT_FIELDS, previous, strict=True))
            span_start = before["last_end_ns"]
        else:
            before = dict.fromkeys(SLOT_FIELDS, 0)
            span_start = fields["first_start_ns"]
            if slot:
                started.append((fields["first_start_ns"], fields["first_end_ns"]))
        batches = fields["batches"] - before["batches"]
        if batches <= 0:
            continue
        busy = fields["busy_ns"] - before["busy_ns"]
        workers.append(
            {
                "worker": slot - 1 if slot else None,
                "batches": batches,
                "samples": fields["samples"] - before["samples"],
                "getitem_ms": (fields["getitem_ns"] - before["getitem_ns"]) / 1e6,
                "collate_ms": (fields["collate_ns"] - before["collate_ns"]) / 1e6,
                "busy_ms": busy / 1e6,
                "span_ms": max(fields["last_end_ns"] - span_start, busy) / 1e6,
            }
        )
    return workers, started


def input_record(
    loader: Any, epoch: Any, workers: list[dict[str, Any]], iterator_ms: float | None
) -> dict[str, Any]:
    from traceml import schema

    return {
        schema.KIND: schema.KIND_INPUT,
        schema.EPOCH: epoch,
        "num_workers": int(getattr(loader, "num_workers", 0) or 0),
        "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
        "pin_memory": bool(getattr(loader, "pin_memory", False)),
        "start_method": start_method(loader),
        "cpu_count": cpu_count(),
        "iterator_ms": iterator_ms,
        "worker_startup_ms": None,
        "first_batch_ms": None,
        "producers": workers,
    }


def start_method(loader: Any) -> str:
    """How ``loader`` starts its workers, without fixing the process-wide start method: plain
    ``multiprocessing.get_start_method()`` sets it for good, and a later
    ``set_start_method(...)`` in the user's script would then raise."""
    context = getattr(loader, "multiprocessing_context", None)
    if context is None:
        import multiprocessing

        chosen = multiprocessing.get_start_method(allow_none=True)
        # The first of get_all_start_methods() is the platform's default.
        return chosen or multiprocessing.get_all_start_methods()[0]
    if isinstance(context, str):
        return context
    return context.get_start_method()


def cpu_count() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def unsupported_reason(loader: Any) -> str | None:
    """Why this DataLoader's input cannot be timed, or None."""
    from torch.utils.data import IterableDataset

    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, IterableDataset):
        return "an iterable dataset (no per-sample call to time)"
    if int(getattr(loader, "num_workers", 0) or 0) > MAX_WORKERS:
        return f"more than {MAX_WORKERS} DataLoader workers"
    if int(getattr(loader, "num_workers", 0) or 0) > 0:
        method = start_method(loader)
        if method not in ("fork", "spawn", "forkserver"):
            return f"DataLoader workers started with {method!r}"
    return None
