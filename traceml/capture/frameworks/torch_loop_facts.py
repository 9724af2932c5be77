"""What the any-loop capture reads about the process and the model when its session opens:
the rank's place in the job, the model's device, and whether the model can be traced at all."""

from __future__ import annotations

import os
import sys
from typing import Any

from traceml import schema


def scripted(module: Any) -> bool:
    import torch

    return isinstance(module, torch.jit.ScriptModule)


def sharded(module: Any) -> bool:
    """Is ``module`` (or a module in it) sharded by FSDP (``FullyShardedDataParallel`` or
    ``fully_shard``)? Its all-gathers and reduce-scatters are not timed: a wait on another
    rank would read as the rank's own Forward and Backward."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded
    kinds = tuple(
        kind
        for kind in (
            getattr(fsdp, "FullyShardedDataParallel", None),
            getattr(fsdp, "FSDPModule", None),
        )
        if isinstance(kind, type)
    )
    if not kinds:
        return False
    try:
        return any(isinstance(sub, kinds) for sub in module.modules())
    except Exception:
        return False


def rfdetr_loaded() -> bool:
    """RF-DETR trains through Lightning, whose fit claims the process its own way."""
    return "rfdetr" in sys.modules


def lightning_loaded() -> bool:
    """A Lightning Trainer may train here: its fit claims the process before its first
    training forward, and traces it through Lightning's hooks (more precise)."""
    return "lightning.pytorch" in sys.modules or "pytorch_lightning" in sys.modules


def module_device(module: Any) -> Any:
    try:
        for parameter in module.parameters():
            return parameter.device
    except Exception:
        pass
    return None


def rank_info() -> dict[str, Any]:
    """This process's place in the job: torch.distributed when initialised, else torchrun's
    environment, else a single process."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return {
        schema.RANK: rank,
        schema.LOCAL_RANK: int(os.environ.get("LOCAL_RANK", 0)),
        schema.WORLD_SIZE: world,
        schema.NODE_RANK: int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0))),
        schema.LOCAL_WORLD_SIZE: int(os.environ.get("LOCAL_WORLD_SIZE", world)),
    }


def loop_facts() -> dict[str, Any]:
    return {schema.ACCUMULATE_GRAD_BATCHES: None, schema.BATCH_SIZE: None}


def with_loader(facts: dict[str, Any], iterator: Any) -> dict[str, Any]:
    """``facts`` with what the training DataLoader's iterator says where they say nothing: its
    workers and, where torch's own ``BatchSampler`` makes its batches, their size (a sampler of
    the user's may vary it). A hand-written loop names no loader: without these the report had
    no samples/s and compare no batch-size or workers difference."""
    merged = dict(facts)
    try:
        from torch.utils.data import BatchSampler

        workers = getattr(iterator, "_num_workers", None)
        if merged.get("num_workers") is None and type(workers) is int:
            merged["num_workers"] = workers
        sampler = getattr(iterator, "_index_sampler", None)
        auto = getattr(iterator, "_auto_collation", False)
        if merged.get(schema.BATCH_SIZE) is None and auto and type(sampler) is BatchSampler:
            size = sampler.batch_size
            merged[schema.BATCH_SIZE] = size if type(size) is int and size > 0 else None
    except Exception:
        pass
    return merged
