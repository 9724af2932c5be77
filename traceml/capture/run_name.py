"""One run directory per job: ranks that derived their run name take global rank 0's."""

from __future__ import annotations

from traceml import console
from traceml.settings import Settings

RUN_NAME_KEY = "traceml/run_name"
RUN_NAME_WAIT_S = 60.0


def adopt_rank_zero_run_name(settings: Settings, rank: int) -> Settings:
    """Ranks that derived their run name (no TRACEML_RUN_NAME chosen) take global rank 0's,
    so one job always writes one run directory even when the ranks started seconds apart.

    Through the process group's key-value store, not a collective: rank 0 never waits, and a
    rank whose rank 0 is not traced (different environments on different nodes) waits at most
    RUN_NAME_WAIT_S once and keeps its own name, instead of hanging the job.
    """
    try:
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if not (dist.is_available() and dist.is_initialized()):
            return settings
        store = distributed_c10d._get_default_store()
        if rank == 0:
            store.set(RUN_NAME_KEY, settings.run_name)
            return settings
        store.wait([RUN_NAME_KEY], timedelta(seconds=RUN_NAME_WAIT_S))
        name = store.get(RUN_NAME_KEY).decode()
        from traceml.settings import is_valid_run_name

        # Any process that reaches the store can write this key: a name that is not safe
        # ('..', a path) must not choose where this rank writes. Keep our own (warned below).
        if not is_valid_run_name(name):
            raise ValueError(f"rank 0's run name {name[:40]!r} is not a safe run name")
        if name != settings.run_name:
            return settings.replace(run_name=name)
    except Exception as exc:
        console.warn(
            f"could not agree on a run name with rank 0 ({type(exc).__name__}); "
            f"this rank writes to {settings.run_name}",
            all_ranks=True,
        )
    return settings
