"""One run directory per job: ranks that derived their run name take global rank 0's; each
attempt of a job torchrun restarted is a run of its own."""

from __future__ import annotations

import os
from collections.abc import Mapping

from traceml import console
from traceml.settings import _NAME_MAX, Settings

# torchelastic's count of the job's restarts (torchrun --max-restarts), in each worker.
ENV_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
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
        # One key per attempt: torchrun keeps its store across restarts, where the last
        # attempt's name would be waiting already (review).
        key = f"{RUN_NAME_KEY}/{restart_count()}"
        if rank == 0:
            store.set(key, settings.run_name)
            return settings
        store.wait([key], timedelta(seconds=RUN_NAME_WAIT_S))
        name = store.get(key).decode()
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


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """torchrun's restarts of this job so far (0 on its first attempt, or not under torchrun)."""
    raw = (os.environ if environ is None else environ).get(ENV_RESTART_COUNT, "").strip()
    return int(raw) if raw.isdigit() else 0


def restarted(settings: Settings, restarts: int) -> Settings:
    """Run name ``<name>-restart<n>``: each attempt of a restarted torchrun job is a run of its
    own (the first attempt's rank files hold its steps and its failure). Every rank derives it
    alike; a name already so suffixed is kept. ``traceml run`` made its run directory for the
    job: its runs are left as they are (it passes no restart option to torchrun)."""
    suffix = _restart_suffix(restarts)
    name = settings.run_name
    if not restarts or settings.launcher_managed or name.endswith(suffix):
        return settings
    return settings.replace(run_name=name[: _NAME_MAX - len(suffix)] + suffix)


def earlier_attempts(name: str, restarts: int) -> list[str]:
    """The run names of the attempts before restart ``restarts`` of the run ``name``."""
    suffix = _restart_suffix(restarts)
    base = name[: -len(suffix)] if name.endswith(suffix) else name
    return [base, *(base + _restart_suffix(n) for n in range(1, restarts))]


def _restart_suffix(restarts: int) -> str:
    return f"-restart{restarts}"
