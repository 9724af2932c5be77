"""What every verdict rule shares: the verdict kinds and severities, the advice texts, the
verdict dict, and the phase view the share rules judge."""

from __future__ import annotations

from typing import Any

from traceml import schema

# The kinds and severities are schema constants; these names are kept for readers' convenience.
INPUT_BOUND = schema.VERDICT_INPUT_BOUND
H2D_BOUND = schema.VERDICT_H2D_BOUND
COMPUTE_BOUND = schema.VERDICT_COMPUTE_BOUND
OPTIMIZER_HEAVY = schema.VERDICT_OPTIMIZER_HEAVY
RESIDUAL_HEAVY = schema.VERDICT_RESIDUAL_HEAVY
STRAGGLER = schema.VERDICT_STRAGGLER
COMM_BOUND = schema.VERDICT_COMM_BOUND
MEMORY_PRESSURE = schema.VERDICT_MEMORY_PRESSURE
INSUFFICIENT_DATA = schema.VERDICT_INSUFFICIENT_DATA
NO_CLEAR_BOTTLENECK = schema.VERDICT_NO_CLEAR_BOTTLENECK
NOT_TRACED = schema.VERDICT_NOT_TRACED

CRITICAL = schema.SEVERITY_CRITICAL
WARN = schema.SEVERITY_WARN
INFO = schema.SEVERITY_INFO
SEVERITY_ORDER = {severity: order for order, severity in enumerate(schema.SEVERITIES)}

# A run on the CPU has no GPU to feed and no use for pinned memory; its workers share the
# training's cores.
INPUT_NEXT_ON_CPU = (
    "Feed the training faster: raise DataLoader num_workers{workers} (on a CPU-only run the "
    "workers share the cores with training), set persistent_workers=True, or make per-sample "
    "decoding and augmentation cheaper."
)
NEXT_STEPS = {
    INPUT_BOUND: (
        "Feed the GPU faster: raise DataLoader num_workers{workers}, set pin_memory=True and "
        "persistent_workers=True, or make per-sample decoding and augmentation cheaper."
    ),
    H2D_BOUND: (
        "Use pinned memory with non_blocking copies, send smaller tensors (uint8 images, "
        "normalise on the device), or keep augmentation on the device light (RF-DETR's "
        "on_after_batch_transfer counts as H2D)."
    ),
    OPTIMIZER_HEAVY: (
        "Try a fused or foreach optimizer (e.g. AdamW(fused=True)), fewer parameter groups, "
        "or gradient accumulation to step less often; with Lightning, gradient clipping and "
        "on_before_optimizer_step hooks count here too."
    ),
    RESIDUAL_HEAVY: (
        "Residual is your loop's own work between the phases: the loss when it is computed "
        "outside the model's forward, zero_grad, metrics and logging (each .item() waits for "
        "the device): profile one iteration (torch.profiler) and log less often."
    ),
    COMPUTE_BOUND: (
        "The model is the bottleneck, as it should be: for more speed try mixed precision, "
        "a larger batch per device, channels_last, or a smaller resolution or model."
    ),
    MEMORY_PRESSURE: (
        "Lower the batch size or resolution, or use mixed precision or activation "
        "checkpointing: near capacity the allocator fragments, retries and slows down."
    ),
    COMM_BOUND: (
        "Communicate less often or overlap it better: gradient accumulation (DDP skips the "
        "all-reduce on accumulating microbatches via no_sync), a larger bucket_cap_mb, "
        "gradient_as_bucket_view=True, a compression hook (fp16/bf16 or PowerSGD), fewer "
        "collectives in training_step (sync_dist logging), or a faster interconnect."
    ),
    NO_CLEAR_BOTTLENECK: (
        "Nothing stands out; change one thing at a time and check it with `traceml compare`."
    ),
}

# Where a step ends, and so what lies between steps, by integration (the outside-steps caveat).
STEP_END_BY_INTEGRATION: dict[str, str] = {
    "torch": (
        "A step ends as optimizer.step() returns: what your loop does after it (an lr "
        "scheduler, zero_grad, logging, a sync such as .item()) runs there every step"
    ),
    "hf_trainer": (
        "A step ends at the Trainer's on_step_end: its logging (logging_steps), evaluation "
        "and checkpoints, and your callbacks' on_log / on_save, run there"
    ),
    "lightning": (
        "A step ends once the callbacks' on_train_batch_end have run: the LightningModule's "
        "own on_train_batch_end, per-step logging, validation and checkpoints run there"
    ),
}
STEP_END_BY_INTEGRATION["rfdetr"] = STEP_END_BY_INTEGRATION["lightning"]

# RESIDUAL_HEAVY's advice where the integration says what its Residual holds (the phases'
# spans: docs/supported.md, docs/any_pytorch.md); any other loop gets NEXT_STEPS's.
RESIDUAL_BY_INTEGRATION: dict[str, str] = {
    "rfdetr": (
        "Residual is RF-DETR's loss (its Hungarian matching), logging and the callbacks' "
        "batch-end work (the EMA update): profile training_step around the model call "
        "(torch.profiler) and log less often."
    ),
    "lightning": (
        "Residual is training_step's own work beyond the model's forward (the loss, metrics), "
        "self.log calls (sync_dist, .item()) and the callbacks' on_train_batch_end (an EMA "
        "update): profile training_step around the model call (torch.profiler) and log less "
        "often."
    ),
    "hf_trainer": (
        "Residual is compute_loss beyond the model's forward, gradient clipping, the lr "
        "scheduler and zero_grad, and your callbacks' step hooks (on_pre_optimizer_step, "
        "on_optimizer_step: an EMA update): profile one step (torch.profiler)."
    ),
}

STRAGGLER_NEXT = {
    schema.INPUT_WAIT: "check that rank's data shard and its host's CPU and storage",
    schema.BACKWARD: (
        "check that rank's device (clocks, thermal throttling, other jobs on it) and any "
        "rank-specific gradient hooks"
    ),
    schema.H2D: "check that rank's PCIe/NUMA placement (pinned memory, CPU affinity)",
    schema.FORWARD: "check that rank's device (clocks, thermal throttling, other jobs on it)",
    schema.OPTIMIZER: "check that rank's device and any rank-specific work in the step",
    schema.RESIDUAL: "look for rank-specific work in training_step (logging, saving on rank 0)",
}


def label(kind: str) -> str:
    """``INPUT_BOUND`` -> ``INPUT-BOUND`` (how verdicts are printed)."""
    return kind.replace("_", "-")


def pct(value: float) -> str:
    return f"{value * 100:.0f}%"


def new_verdict(
    kind: str, severity: str, why: str, next_step: str, weight: float, **evidence: Any
) -> dict[str, Any]:
    return {
        schema.VERDICT_KIND: kind,
        schema.VERDICT_SEVERITY: severity,
        schema.VERDICT_WHY: why,
        schema.VERDICT_NEXT: next_step,
        schema.VERDICT_EVIDENCE: evidence,
        "_weight": weight,
    }


def severity_for(value: float | None, warn: float, critical: float) -> str | None:
    if value is None:
        return None
    if value >= critical:
        return CRITICAL
    if value >= warn:
        return WARN
    return None


def step_stats(summary: dict[str, Any]) -> dict[str, Any] | None:
    overall = summary.get(schema.SUMMARY_OVERALL) or {}
    return (overall.get(schema.PHASE_STATS) or {}).get(schema.STEP)


def finish(verdict: dict[str, Any]) -> dict[str, Any]:
    verdict.pop("_weight", None)
    return verdict


def sum_present(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


class PhaseView:
    """The shares and mean times the phase verdicts judge. With comm timing, each phase is its
    own time: waiting on other ranks is the straggler's or the network's doing (STRAGGLER and
    COMM_BOUND say so), not the phase's."""

    def __init__(self, shares: dict[str, Any], means: dict[str, Any], own: bool) -> None:
        self.shares = shares
        self.means = means
        self.own = own

    @classmethod
    def of(cls, summary: dict[str, Any]) -> PhaseView:
        overall = summary.get(schema.SUMMARY_OVERALL) or {}
        phase_stats = overall.get(schema.PHASE_STATS) or {}
        shares = dict(overall.get(schema.SHARES) or {})
        means = {f: (phase_stats.get(f) or {}).get("mean") for f in schema.TIMED_FIELDS}
        own = shares.get(schema.OWN_OF_PHASE[schema.BACKWARD]) is not None
        if own:
            for phase in schema.PHASES:
                shares[phase] = shares.get(schema.OWN_OF_PHASE[phase])
                means[phase] = (phase_stats.get(schema.OWN_OF_PHASE[phase]) or {}).get("mean")
        return cls(shares, means, own)

    def compute_shares(self) -> tuple[float | None, float | None]:
        """Forward + Backward on the host clock, and on the device clock (None: unmeasured).
        On the device, their own time where the waits inside them were measured: with NCCL
        the device's Backward holds the all-reduce, which is waiting, not compute."""
        host = sum_present(self.shares.get(schema.FORWARD), self.shares.get(schema.BACKWARD))
        forward, backward = schema.GPU_FORWARD, schema.GPU_BACKWARD
        own = schema.GPU_OWN_OF_PHASE
        if self.shares.get(own[schema.BACKWARD]) is not None:
            forward, backward = own[schema.FORWARD], own[schema.BACKWARD]
        device = sum_present(self.shares.get(forward), self.shares.get(backward))
        return host, device
