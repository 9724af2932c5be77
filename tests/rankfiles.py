"""Hand-made rank files: the records a traced run would write, with numbers chosen by the test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from traceml import schema
from traceml.step_rows import row_records

_PHASE_KEYS = {
    "input": schema.INPUT_WAIT,
    "h2d": schema.H2D,
    "forward": schema.FORWARD,
    "backward": schema.BACKWARD,
    "optimizer": schema.OPTIMIZER,
    "residual": schema.RESIDUAL,
}


def header(rank: int = 0, world_size: int = 1, **extra: Any) -> dict[str, Any]:
    record = {
        schema.KIND: schema.KIND_HEADER,
        schema.SCHEMA: schema.RANK_SCHEMA,
        schema.RUN: "handmade",
        schema.RANK: rank,
        schema.LOCAL_RANK: rank,
        schema.WORLD_SIZE: world_size,
        schema.NODE_RANK: 0,
        schema.LOCAL_WORLD_SIZE: world_size,
        schema.HOST: "testhost",
        schema.PID: 1000 + rank,
        schema.STARTED_AT: "2026-01-01T00:00:00+00:00",
        schema.CLOCK_ORIGIN_UNIX: 1.0e9,
        schema.VERSIONS: {"python": "3.11", "torch": "2.14.1", "rfdetr": "1.10.1"},
        schema.DEVICE: {"type": "cpu", "name": "cpu", "total_memory_bytes": None},
        schema.TIMING: "host",
        schema.SCRIPT: "train.py",
        schema.INTEGRATION: "rfdetr",
        schema.ACCUMULATE_GRAD_BATCHES: 1,
        schema.BATCH_SIZE: 2,
        "num_workers": 0,
        schema.SETTINGS: {"trace_max_steps": None},
    }
    record.update(extra)
    return record


def step(index: int, t_ms: float = 0.0, **phases: float | None) -> dict[str, Any]:
    """A step record; unspecified phases are 0, ``None`` means unmeasured.

    ``comm_<phase>=ms`` (e.g. ``comm_backward=30``) marks the record as from a multi-rank run
    with comm timing: the wait sits inside that phase; other comm fields are then 0.
    ``gpu_<field>=ms`` (e.g. ``gpu_step=90``, ``gpu_comm=40``) sets CUDA-event fields."""
    comm = {key[5:]: phases.pop(key) for key in list(phases) if key.startswith("comm_")}
    gpu = {key: phases.pop(key) for key in list(phases) if key.startswith("gpu_")}
    record: dict[str, Any] = {
        schema.KIND: schema.KIND_STEP,
        schema.STEP_INDEX: index,
        schema.GLOBAL_STEP: index + 1,
        schema.EPOCH: 0,
        schema.MICROBATCHES: 1,
        schema.OPTIMIZER_STEPPED: True,
        schema.T_START_MS: t_ms,
        schema.GAP_MS: None if index == 0 else 0.5,
        schema.RSS: 1_000_000 + index,
        schema.MEM_PEAK_ALLOCATED: None,
        schema.MEM_PEAK_RESERVED: None,
    }
    total = 0.0
    for short, key in _PHASE_KEYS.items():
        value = phases.get(short, 0.0)
        record[key] = value
        total += value or 0.0
    record[schema.STEP] = total
    for key in (*schema.GPU_FIELDS, *schema.GPU_COMM_FIELDS, *schema.COMM_FIELDS):
        record[key] = None
    if comm:
        for short, key in _PHASE_KEYS.items():
            record[schema.COMM_OF_PHASE[key]] = comm.get(short, 0.0)
        record[schema.COMM] = sum(comm.values())
        record[schema.COMM_COUNT] = len(comm)
        record[schema.COMM_BYTES] = 1024 * len(comm)
    for key, value in gpu.items():
        record[key + "_ms"] = value
    return record


def footer(steps: int, status: str = schema.STATUS_COMPLETED, **extra: Any) -> dict[str, Any]:
    return {
        schema.KIND: schema.KIND_FOOTER,
        schema.STATUS: status,
        schema.STEPS: steps,
        schema.ENDED_AT: "2026-01-01T00:01:00+00:00",
        **extra,
    }


def write_rank(run_dir: Path, rank: int, records: list[dict[str, Any]]) -> Path:
    path = run_dir / schema.RANKS_DIR / schema.rank_file_name(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r, option=orjson.OPT_APPEND_NEWLINE) for r in records))
    return path


def write_run(
    run_dir: Path,
    per_rank_steps: list[list[dict[str, float]]],
    *,
    world_size: int | None = None,
    with_footer: bool = True,
) -> Path:
    """One rank file per list of phase dicts; steps laid out back to back in time."""
    size = world_size or len(per_rank_steps)
    for rank, phases_list in enumerate(per_rank_steps):
        records = [header(rank, size)]
        t = 0.0
        for index, phases in enumerate(phases_list):
            record = step(index, t, **phases)
            t += record[schema.STEP] + 0.5
            records.append(record)
        if with_footer:
            records.append(footer(len(phases_list)))
        write_rank(run_dir, rank, records)
    return run_dir


def synthetic_run(
    run_dir: Path,
    *,
    steps: int = 40,
    ranks: int = 1,
    seed: int = 0,
    noise: float = 0.05,
    per_rank: dict[int, dict[str, float]] | None = None,
    synchronised: bool = False,
    **means: float,
) -> Path:
    """A run whose phase times scatter (gaussian, ``noise`` relative sd) around ``means``
    (ms per step, keys as in :func:`step`); ``per_rank`` overrides means for some ranks.

    ``synchronised``: the ranks meet in an all-reduce at the end of Backward, as under DDP.
    Each rank then also waits there for the last one to arrive (its work since the previous
    all-reduce: that step's Optimizer and Residual, this step's Input Wait to Backward's own
    part); the transfer itself takes rank 0's ``comm_backward`` on every rank, so all leave
    together. Backward is its own part plus the wait and the transfer."""
    import random

    rng = random.Random(seed)
    phases_per_rank = []
    for rank in range(ranks):
        rank_means = {**means, **(per_rank or {}).get(rank, {})}
        phases_per_rank.append(
            [
                {
                    key: max(0.0, value * (1.0 + noise * rng.gauss(0.0, 1.0)))
                    for key, value in rank_means.items()
                }
                for _ in range(steps)
            ]
        )
    if synchronised:
        _meet_in_backward(phases_per_rank)
    return write_run(run_dir, phases_per_rank)


def _meet_in_backward(phases_per_rank: list[list[dict[str, float]]]) -> None:
    carried = [0.0] * len(phases_per_rank)
    for index in range(len(phases_per_rank[0])):
        steps = [rank_steps[index] for rank_steps in phases_per_rank]
        own_backward = [s.get("backward", 0.0) - s.get("comm_backward", 0.0) for s in steps]
        arrivals = [
            carry + own + sum(s.get(k, 0.0) for k in ("input", "h2d", "forward"))
            for carry, own, s in zip(carried, own_backward, steps, strict=True)
        ]
        last = max(arrivals)
        transfer = steps[0].get("comm_backward", 0.0)
        for rank, s in enumerate(steps):
            s["comm_backward"] = last - arrivals[rank] + transfer
            s["backward"] = max(0.0, own_backward[rank]) + s["comm_backward"]
            carried[rank] = s.get("optimizer", 0.0) + s.get("residual", 0.0)


def lines_as_written(path: Path) -> list[dict[str, Any]]:
    """A rank file's records as traceml wrote them, one per step: a rows line (rank schema
    3.0, ``step_rows``) stands for its steps' records, short keys and all."""
    records: list[dict[str, Any]] = []
    for line in Path(path).read_bytes().splitlines():
        record = orjson.loads(line)
        if record.get(schema.KIND) == schema.KIND_STEP_ROWS:
            records.extend(dict(step) for step in row_records(record))
        else:
            records.append(record)
    return records
