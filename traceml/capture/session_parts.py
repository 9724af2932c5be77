"""The parts a :class:`~traceml.capture.session.Session` drives, as typed interfaces.

Each part has one real implementation in ``traceml.capture`` (named below) and fakes in the
unit tests; the session talks to them only through these methods, so an adapter or a test can
hand in its own (the CUDA path is tested on CPU with lagging fake events this way).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol


class PhaseClock(Protocol):
    """Boundaries in, step records out (``step_clock.StepClock``)."""

    origin_ns: int
    overlaps: int
    comm_enabled: bool
    optimizer_from_backward: bool

    @property
    def in_microbatch(self) -> bool: ...
    @property
    def in_step(self) -> bool: ...
    def iterator_created(self, start_ns: int, end_ns: int) -> None: ...
    def fetched(self, start_ns: int | None, end_ns: int) -> None: ...
    def transfer_started(self) -> None: ...
    def transferred(self, start_ns: int, end_ns: int) -> None: ...
    def forward_started(self, now_ns: int) -> bool: ...
    def forward_ended(self, now_ns: int) -> bool: ...
    def forward_timed(self, start_ns: int, end_ns: int) -> None: ...
    def backward_timed(self, start_ns: int, end_ns: int) -> None: ...
    def backward_started(self, now_ns: int) -> None: ...
    def backward_ended(self, now_ns: int) -> None: ...
    def optimizer_started(self, now_ns: int) -> None: ...
    def optimizer_ended(self, now_ns: int) -> None: ...
    def batch_ended(self, now_ns: int, global_step: Any = None, epoch: Any = None) -> Any: ...
    def epoch_ended(self, now_ns: int, global_step: Any = None, epoch: Any = None) -> Any: ...
    # The session's hot path: the step closed, its record made later by ``record()``
    # (``closed_step.ClosedStep``), on the sink's flusher.
    def batch_closed(self, now_ns: int, global_step: Any = None, epoch: Any = None) -> Any: ...
    def epoch_closed(self, now_ns: int, global_step: Any = None, epoch: Any = None) -> Any: ...
    def abandon(self) -> None: ...


class DeviceTimer(Protocol):
    """Device-side phase times from CUDA events (``cuda_timing.CudaStepTimer``)."""

    comm_enabled: bool
    unreadable: int
    unreadable_reason: str | None

    def step_started(self) -> None: ...
    def phase_started(self, phase: str) -> None: ...
    def phase_ended(self, phase: str) -> None: ...
    def step_ended(self, record: dict[str, Any], at_last_phase: bool = False) -> None: ...
    def abandon_step(self) -> None: ...
    def ready(self) -> Iterator[dict[str, Any]]: ...
    def drain(self) -> Iterator[dict[str, Any]]: ...


class CommTiming(Protocol):
    """Waits on other ranks (``instruments.distributed.CommTimer``)."""

    clock: Any
    gpu: Any
    active: bool
    own_cost_ns: int
    bucket_timing: str | None
    bucket_note: str | None

    def wrap_hook_registration(self, ddp_class: type) -> None: ...
    def attach_buckets(self, ddp: Any) -> None: ...
    def install_collectives(self, dist_module: Any) -> None: ...
    def backward_started(self) -> None: ...
    def backward_finished(self) -> None: ...
    def uninstall(self) -> None: ...


class TelemetrySource(Protocol):
    """Host and allocator samples from a thread of its own (``telemetry.TelemetrySampler``)."""

    pending: bool

    def start(self) -> None: ...
    def collect(self) -> list[dict[str, Any]]: ...
    def stop(self) -> Iterable[dict[str, Any]]: ...


class InputTimingSource(Protocol):
    """Worker-side input timing (``instruments.dataloader.InputTiming``)."""

    own_cost_ns: int

    def epoch_record(self, epoch: Any) -> dict[str, Any] | None: ...
    def uninstall(self) -> None: ...
    # Counting from the session's door events (step_events), where the batches are made in
    # this process; False where they are not.
    def log_events(self, session: Any) -> bool: ...


class CostOwner(Protocol):
    """Anything whose guarded entry points add their time to ``own_cost_ns``."""

    own_cost_ns: int


Undo = Callable[[], None]


def device_timer_for(device: Any) -> DeviceTimer | None:
    """CUDA events for device-side phase times, on a CUDA device (else None)."""
    if getattr(device, "type", None) != "cuda":
        return None
    from traceml.capture.cuda_timing import cuda_step_timer

    return cuda_step_timer(device)


def describe_device(device: Any) -> dict[str, Any]:
    """The header's device entry for ``device`` (a ``torch.device`` or None: cpu)."""
    from traceml import schema

    info: dict[str, Any] = {
        schema.DEVICE_TYPE: getattr(device, "type", None) or "cpu",
        schema.DEVICE_NAME: None,
        schema.DEVICE_TOTAL_MEMORY: None,
    }
    if info[schema.DEVICE_TYPE] == "cuda":
        try:
            import torch

            props = torch.cuda.get_device_properties(device)
            info[schema.DEVICE_NAME] = props.name
            info[schema.DEVICE_TOTAL_MEMORY] = int(props.total_memory)
        except Exception:
            pass
    else:
        info[schema.DEVICE_NAME] = "cpu"
    return info
