"""Input records -> the input pipeline's breakdown, and what to change when input-bound. Pure.

The rank files' ``input`` records (one per epoch, written by
``traceml.capture.instruments.dataloader``) say, per producer (each DataLoader worker, or the main
process with ``num_workers=0``), how many batches it made and how long it spent in the dataset's
``__getitem__``, in ``collate_fn``, busy (first sample to collate end) and alive (first batch
start to last batch end). This module adds them up over ranks and epochs, and turns them and the
step times into a quantified next step.

The model behind the estimate: W workers each take P ms per batch, so together they make a
batch every P/W ms; the loop needs one every C ms (the step without its Input Wait). The wait
per step is then about max(0, P/W - C), and ceil(P/C) workers keep up.
"""

from __future__ import annotations

import math
from typing import Any

from traceml import schema
from traceml.analysis.clean import is_count, is_number

# Workers busier than this are the bottleneck; idler than IDLE_SHARE, they are not.
BUSY_SHARE = 0.80
IDLE_SHARE = 0.50
# Worker start-up worth a sentence: this much of the traced time.
STARTUP_SHARE = 0.05


def _number(value: Any) -> float | None:
    # Past the step fields' bound a value is damage, and int() of its total could not be
    # written to the summary.
    return float(value) if is_number(value) and value >= 0 else None


def _count(value: Any) -> int | None:
    """A count from a record (workers, cores, an epoch), or None when it is not one: a
    damaged field is unmeasured, never a crash in the advice's arithmetic."""
    return value if is_count(value) else None


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def summarise(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's breakdown from every rank's ``input`` records, or None without any."""
    totals = dict.fromkeys(("batches", "samples", "getitem_ms", "collate_ms", "busy_ms"), 0.0)
    worker_busy = worker_span = 0.0
    per_worker: dict[str, int] = {}
    startups: list[float] = []
    first_batches: list[float] = []
    last: dict[str, Any] = {}
    epochs = set()
    for record in records:
        if not isinstance(record, dict) or not isinstance(record.get("producers"), list):
            continue
        last = record
        epochs.add((_count(record.get(schema.RANK)), _count(record.get(schema.EPOCH))))
        for key, into in (("worker_startup_ms", startups), ("first_batch_ms", first_batches)):
            value = _number(record.get(key))
            if value is not None:
                into.append(value)
        for producer in record["producers"]:
            if not isinstance(producer, dict):
                continue
            values = {key: _number(producer.get(key)) for key in (*totals, "span_ms")}
            if any(value is None for value in values.values()):
                continue
            for key in totals:
                totals[key] += values[key]
            worker = producer.get("worker")
            if isinstance(worker, int):
                worker_busy += values["busy_ms"]
                worker_span += values["span_ms"]
                name = str(worker)
                per_worker[name] = per_worker.get(name, 0) + int(values["batches"])
    if not last or not totals["batches"]:
        return None
    if not all(is_number(total) for total in totals.values()):
        return None  # many producers each near the bound: a damaged record, no breakdown
    batches = totals["batches"]
    return {
        "num_workers": _count(last.get("num_workers")),
        "persistent_workers": _flag(last.get("persistent_workers")),
        "pin_memory": _flag(last.get("pin_memory")),
        "cpu_count": _count(last.get("cpu_count")),
        "epochs": len(epochs),
        "batches": int(batches),
        "samples": int(totals["samples"]),
        "getitem_ms_per_batch": totals["getitem_ms"] / batches,
        "getitem_ms_per_sample": totals["getitem_ms"] / totals["samples"]
        if totals["samples"]
        else None,
        "collate_ms_per_batch": totals["collate_ms"] / batches,
        "busy_ms_per_batch": totals["busy_ms"] / batches,
        "worker_busy_share": worker_busy / worker_span if worker_span > 0 else None,
        "batches_per_worker": per_worker or None,
        "worker_startup_ms": startups or None,
        "worker_startup_mean_ms": sum(startups) / len(startups) if startups else None,
        "first_batch_mean_ms": sum(first_batches) / len(first_batches) if first_batches else None,
    }


def _workers(count: int) -> str:
    return f"{count} worker" + ("" if count == 1 else "s")


def predicted_input_wait_ms(breakdown: dict[str, Any], loop_ms: float, workers: int) -> float:
    """Input Wait per batch with ``workers`` workers (the model in the module docstring)."""
    per_batch = breakdown["busy_ms_per_batch"]
    return max(0.0, per_batch / max(workers, 1) - loop_ms)


def workers_to_keep_up(breakdown: dict[str, Any], loop_ms: float) -> int:
    return max(1, math.ceil(breakdown["busy_ms_per_batch"] / max(loop_ms, 1e-3)))


def advice(
    breakdown: dict[str, Any] | None,
    step_ms: float,
    input_wait_ms: float,
    *,
    integration: str | None = None,
    microbatches: float = 1.0,
) -> tuple[str, dict[str, Any]] | None:
    """The quantified next step for an input-bound run, and its evidence; None without data."""
    if not breakdown:
        return None
    workers = breakdown.get("num_workers") or 0
    per_batch = breakdown["busy_ms_per_batch"]
    # What the loop needs per batch besides waiting for it.
    loop_ms = max((step_ms - input_wait_ms) / max(microbatches, 1.0), 0.0)
    getitem, collate = breakdown["getitem_ms_per_batch"], breakdown["collate_ms_per_batch"]
    part = "the dataset's __getitem__" if getitem >= collate else "collate_fn"
    parts = f"{getitem:.1f} ms in __getitem__, {collate:.1f} ms in collate_fn"
    needed = workers_to_keep_up(breakdown, loop_ms)
    evidence: dict[str, Any] = {
        "loop_ms_per_batch": loop_ms,
        "batch_ms": per_batch,
        "dominant": "getitem" if part.startswith("the dataset") else "collate",
        "workers_needed": needed,
        "predicted_input_wait_ms": predicted_input_wait_ms(breakdown, loop_ms, needed),
    }
    sentences = _throughput_sentences(breakdown, evidence, part, parts, loop_ms)
    startup = breakdown.get("worker_startup_mean_ms")
    if startup and workers and not breakdown.get("persistent_workers"):
        epochs = breakdown.get("epochs") or 1
        if epochs > 1 and startup >= 2 * max(step_ms, 1e-3):
            sentences.append(
                f"Each epoch starts with {startup / 1000:.1f} s of worker start-up: set "
                "persistent_workers=True."
            )
    if integration == "rfdetr" and part.startswith("the dataset"):
        sentences.append(
            "In RF-DETR the dataset's __getitem__ decodes the image and runs its transforms "
            "(multi-scale resizing, augmentation); its on-device augmentation counts as H2D."
        )
    return " ".join(sentences), evidence


def _throughput_sentences(
    breakdown: dict[str, Any], evidence: dict[str, Any], part: str, parts: str, loop_ms: float
) -> list[str]:
    """Whether the workers keep up: idle workers (the wait is elsewhere), or how many would."""
    workers = breakdown.get("num_workers") or 0
    per_batch = breakdown["busy_ms_per_batch"]
    needed = evidence["workers_needed"]
    cores = breakdown.get("cpu_count")
    busy = breakdown.get("worker_busy_share")
    sentences: list[str] = []
    if workers and busy is not None and busy < IDLE_SHARE:
        sentences.append(
            f"The {_workers(workers)} {'are' if workers != 1 else 'is'} idle "
            f"{(1 - busy) * 100:.0f}% of the time: the wait is in the main process (pin "
            "memory, the transfer queue, what runs between fetches), not in making batches."
        )
    else:
        making = (
            f"{_workers(workers)} {'are' if workers != 1 else 'is'} busy {busy * 100:.0f}% of "
            "the time, each taking"
            if workers and busy is not None
            else "The main process makes every batch itself (num_workers=0), taking"
        )
        rate = per_batch / max(workers, 1)
        sentences.append(
            f"{making} {per_batch:.0f} ms per batch ({parts}): a batch every {rate:.0f} ms; "
            f"the step needs one every {loop_ms:.0f} ms. About {needed} workers would keep up "
            f"(predicted Input Wait {evidence['predicted_input_wait_ms']:.0f} ms per batch)"
            + (f"; this host has {cores} cores." if cores else ".")
        )
        if cores and needed > cores:
            sentences.append(
                f"That is more workers than cores (fine only if {part} waits on storage "
                f"rather than computing): make {part} cheaper (it takes most of each batch) or "
                "move the work to the GPU."
            )
        elif part == "collate_fn":
            sentences.append("Most of each batch is collate_fn: make it cheaper.")
    return sentences


# Figures compared between two runs (summary key, label, unit).
_COMPARED = (
    ("num_workers", "workers", ""),
    ("getitem_ms_per_batch", "__getitem__ per batch", " ms"),
    ("collate_ms_per_batch", "collate_fn per batch", " ms"),
    ("busy_ms_per_batch", "busy per batch", " ms"),
    ("worker_busy_share", "workers busy", ""),
    ("worker_startup_mean_ms", "worker start-up per epoch", " ms"),
)


def compare_breakdowns(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """The two runs' input breakdowns side by side (compare shows them, does not judge them)."""
    first = a.get(schema.SUMMARY_INPUT_PIPELINE) or {}
    second = b.get(schema.SUMMARY_INPUT_PIPELINE) or {}
    if not first and not second:
        return None
    return {key: {"a": first.get(key), "b": second.get(key)} for key, _l, _u in _COMPARED}


def comparison_lines(entry: dict[str, Any] | None) -> list[str]:
    if not entry:
        return []

    def shown(value: Any, unit: str) -> str:
        if value is None:
            return "-"
        if isinstance(value, float) and not unit:
            return f"{value * 100:.0f}%"
        return f"{value:.1f}{unit}" if isinstance(value, float) else f"{value}{unit}"

    lines = ["  Input pipeline (A -> B)"]
    for key, label, unit in _COMPARED:
        pair = entry.get(key) or {}
        lines.append(
            f"    {label:<28}{shown(pair.get('a'), unit):>12} -> {shown(pair.get('b'), unit)}"
        )
    return lines
