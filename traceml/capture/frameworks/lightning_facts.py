"""Facts about a Lightning training read at its start: the rank, the setups traceml names
instead of measuring, and the loop's batch size, accumulation and workers."""

from __future__ import annotations

from typing import Any

from traceml import schema

from .lightning_forward import forward_module


def rank_info_of(trainer: Any) -> dict[str, Any]:
    return {
        schema.RANK: int(getattr(trainer, "global_rank", 0) or 0),
        schema.LOCAL_RANK: int(getattr(trainer, "local_rank", 0) or 0),
        schema.WORLD_SIZE: int(getattr(trainer, "world_size", 1) or 1),
        schema.NODE_RANK: int(getattr(trainer, "node_rank", 0) or 0),
        schema.LOCAL_WORLD_SIZE: int(getattr(trainer, "num_devices", 1) or 1),
    }


def unsupported_configuration(trainer: Any, pl_module: Any) -> str | None:
    """Name the setup that these hooks would mis-measure, or None when it is supported."""
    if pl_module is not None and not getattr(pl_module, "automatic_optimization", True):
        return "manual optimization (automatic_optimization=False)"
    strategy_name = type(getattr(trainer, "strategy", None)).__name__.lower()
    for token, label in (
        ("fsdp", "FSDP"),
        ("deepspeed", "DeepSpeed"),
        ("modelparallel", "ModelParallelStrategy (FSDP2/tensor parallel)"),
        ("xla", "TPU/XLA"),
    ):
        if token in strategy_name:
            return label
    accelerator_name = type(getattr(trainer, "accelerator", None)).__name__.lower()
    for token, label in (("xla", "TPU/XLA"), ("tpu", "TPU/XLA"), ("mps", "Apple MPS")):
        if token in accelerator_name:
            return label
    module = forward_module(pl_module)
    # model.compile() in place too: a fullgraph compile would trace the door's clock and raise
    in_place = getattr(module, "_compiled_call_impl", None) is not None
    # trainer.fit(torch.compile(module)): Lightning compiles its training_step and forward
    # (pl_module._compiler_ctx), so every door in the step would be inside the compiled graph.
    fit_compiled = getattr(pl_module, "_compiler_ctx", None) is not None
    wrapped = type(module).__name__ == "OptimizedModule"
    if fit_compiled or in_place or wrapped:
        return "torch.compile (and the CUDA graphs it may capture)"
    return None


def loop_facts(trainer: Any) -> dict[str, Any]:
    facts: dict[str, Any] = {
        schema.ACCUMULATE_GRAD_BATCHES: getattr(trainer, "accumulate_grad_batches", None),
        schema.BATCH_SIZE: None,
    }
    try:
        loader = trainer.train_dataloader
        loaders = loader if isinstance(loader, (list, tuple)) else [loader]
        sizes = [getattr(item, "batch_size", None) for item in loaders]
        if len(sizes) == 1 and isinstance(sizes[0], int):
            facts[schema.BATCH_SIZE] = sizes[0]
        workers = [getattr(item, "num_workers", None) for item in loaders]
        if len(workers) == 1 and isinstance(workers[0], int):
            facts["num_workers"] = workers[0]
    except Exception:
        pass
    return facts
