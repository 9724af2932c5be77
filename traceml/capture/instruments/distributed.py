"""Waiting on other ranks: torch.distributed collectives and DDP's gradient buckets, timed.

Installed only in a traced training whose process group has more than one rank; a single
process pays nothing. Two kinds of blocking points:

* **Collectives called from anywhere in the step** (the model's own code: RF-DETR's criterion
  all-reduces its box count inside ``training_step``; Lightning's ``sync_dist`` logging; EMA or
  metric syncs; ``barrier()`` in callbacks). The ``torch.distributed`` functions are replaced by
  timing wrappers for the duration of the traced fit. A synchronous call is timed as a whole.
  An ``async_op=True`` call returns torch's own ``Work`` object, untouched (``isinstance``,
  ``get_future``, ``is_completed``, ``exception`` are torch's); its ``wait()`` is timed because
  ``Work.wait`` is wrapped on the class for the fit, acting only on the works this timer
  launched (kept beside them in a weak dictionary). Calls made by torch itself
  (``distributed_c10d`` calling its own module globals) are not wrapped.
* **DDP's gradient buckets**, through a communication hook (:mod:`ddp_buckets`).

Only the training thread is timed: a collective from another thread (async checkpointing, a
metric sync in a background thread) is not charged to the training thread's current phase,
and the nesting depth that keeps a collective inside another from counting twice is per thread.

On CUDA with NCCL the host does not block in a collective (the work runs on NCCL's stream and
``wait()`` only orders streams), so host times stay near zero there; CUDA events recorded on
the current stream around each blocking point measure what the device waited: around a
synchronous collective, around ``wait()`` of an async one (not from its launch: the compute
between launch and ``wait()`` is not waiting), and from the last bucket launch to the end of
backward. They are read lazily with the step's other events (traceml.capture.cuda_timing merges
overlapping ones).

Each wait is charged to the phase it happens in (``StepClock.current_phase``); it stays inside
that phase, so the phases still add up to the step and a phase's own time is the phase minus
its wait.
"""

from __future__ import annotations

import _thread
import functools
import weakref
from collections.abc import Callable
from typing import Any

from traceml.capture.clock import clock_ns
from traceml.capture.guard import entry_point
from traceml.capture.instruments.ddp_buckets import BucketTiming
from traceml.capture.undo import undo_all

# torch.distributed functions where a rank can wait for the others.
COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
    "monitored_barrier",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    # DDP's forward broadcasts the module's buffers from rank 0 every step
    # (broadcast_buffers=True, nn/parallel/distributed.py: _distributed_broadcast_coalesced
    # calls dist._broadcast_coalesced); rank 0 waits there for the others.
    "_broadcast_coalesced",
)
# Where the tensors are when the first argument is not them.
_PAYLOAD_ARGUMENT = {"_broadcast_coalesced": 1}
_WRAPPED = "_traceml_timed_collective"


def _tensor_bytes(value: Any) -> int:
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value[:64])
    return 0


def payload_bytes(args: tuple, kwargs: dict, position: int = 0) -> int:
    """The tensor payload of a collective: its first argument (the tensor or tensor list it
    reduces, gathers into or broadcasts); 0 for barriers and object collectives."""
    if len(args) > position:
        return _tensor_bytes(args[position])
    for key in ("tensor", "output_tensor", "output", "tensor_list", "output_tensor_list"):
        if key in kwargs:
            return _tensor_bytes(kwargs[key])
    return 0


class _Depth(_thread._local):
    depth = 0  # >0 inside a timed call on this thread: collectives it makes pass through


class CommTimer(BucketTiming):
    """Times every wait on other ranks of one traced training (see the module docstring).

    ``clock`` is the training's :class:`~traceml.capture.step_clock.StepClock`
    (set when tracing starts);
    ``gpu`` its CUDA step timer, or None on CPU. ``on_failure`` is called once with a reason
    if the bookkeeping itself fails; the user's calls always go through, exactly once.
    """

    def __init__(self, on_failure: Callable[[str], None], now: Callable[[], int] = clock_ns):
        self.clock: Any = None
        self.gpu: Any = None
        self.active = False
        self._on_failure = on_failure
        self._now = now
        self.own_cost_ns = 0  # time inside this timer's entry points (traceml.capture.guard)
        self._failed = False
        self._here = _Depth()
        # The training thread (the one that installs the collectives): the only one timed.
        self.thread: int | None = None
        # Async collectives launched in a step, until their wait(): work -> nothing.
        self._launched: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._undo: list[Callable[[], None]] = []
        self._init_buckets()

    # -- installing ------------------------------------------------------------------------

    def install_collectives(self, dist_module: Any) -> None:
        """Replace the ``torch.distributed`` collectives with timing wrappers and wrap
        ``Work.wait`` (undone by :meth:`uninstall`). Called on the training thread."""
        self.thread = _thread.get_ident()
        for name in COLLECTIVES:
            original = getattr(dist_module, name, None)
            if original is None or getattr(original, _WRAPPED, False):
                continue
            wrapper = self._collective_wrapper(original, _PAYLOAD_ARGUMENT.get(name, 0))
            setattr(dist_module, name, wrapper)

            def restore(name: str = name, original: Any = original, wrapper: Any = wrapper) -> None:
                if getattr(dist_module, name, None) is wrapper:
                    setattr(dist_module, name, original)

            self._undo.append(restore)
        work_class = getattr(dist_module, "Work", None)
        if isinstance(work_class, type):
            self._wrap_work_wait(work_class)

    def _wrap_work_wait(self, work_class: type) -> None:
        own = work_class.__dict__.get("wait")
        original = getattr(work_class, "wait", None)
        if original is None or getattr(original, _WRAPPED, False):
            return
        timer = self

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            token = None
            if timer.active and timer._launched:
                token = timer.wait_starting(work)
            if token is None:
                return original(work, *args, **kwargs)
            result = original(work, *args, **kwargs)  # the user's errors pass through unchanged
            timer.work_waited(token)
            return result

        functools.update_wrapper(wait, original, updated=())
        setattr(wait, _WRAPPED, True)
        work_class.wait = wait

        def restore() -> None:
            if work_class.__dict__.get("wait") is wait:
                if own is None:
                    del work_class.wait
                else:
                    work_class.wait = own

        self._undo.append(restore)

    def uninstall(self) -> None:
        """Stop timing and put the collectives back. A DDP hook cannot be unregistered: it
        stays and passes straight through to the hook it wraps."""
        self.active = False
        undo_all(self._undo)
        self._launched.clear()

    # -- collectives -----------------------------------------------------------------------

    def _collective_wrapper(
        self, original: Callable[..., Any], payload_position: int = 0
    ) -> Callable[..., Any]:
        timer = self

        @functools.wraps(original)
        def timed_collective(*args: Any, **kwargs: Any) -> Any:
            token = None
            here = timer._here
            if timer.active and not here.depth and _thread.get_ident() == timer.thread:
                token = timer._collective_started(args, kwargs, payload_position)
            if token is None:
                return original(*args, **kwargs)
            here.depth += 1
            try:
                result = original(*args, **kwargs)  # the user's errors pass through unchanged
            finally:
                here.depth -= 1
            timer._collective_ended(token, result)
            return result  # torch's own object (a Work for async_op=True), never a proxy

        setattr(timed_collective, _WRAPPED, True)
        return timed_collective

    @entry_point("distributed.collective_start", "a torch.distributed collective, before it")
    def _collective_started(self, args: tuple, kwargs: dict, position: int) -> tuple | None:
        phase = self.clock.current_phase()
        if phase is None:
            return None  # outside a training step (validation, set-up): not ours to time
        nbytes = payload_bytes(args, kwargs, position)
        start_event = self.gpu.mark() if self.gpu is not None else None
        return phase, nbytes, start_event, self._now()

    @entry_point("distributed.collective_end", "a torch.distributed collective, after it")
    def _collective_ended(self, token: tuple, result: Any) -> None:
        end = self._now()
        phase, nbytes, start_event, start = token
        self.clock.collective(phase, end - start, nbytes)
        if result is not None and hasattr(result, "wait"):
            # async_op=True: the launch is timed above; the wait where it happens. On the
            # device, the wait starts at wait(), not here: compute in between is not waiting.
            if start_event is not None:
                self.gpu.release(start_event)
            self._launched[result] = True
        elif start_event is not None:
            self.gpu.add_comm(phase, start_event, self.gpu.mark())

    @entry_point("distributed.work_wait_start", "wait() of an async collective, before it")
    def wait_starting(self, work: Any) -> tuple | None:
        if self._launched.pop(work, None) is None or _thread.get_ident() != self.thread:
            return None
        phase = self.clock.current_phase()
        if phase is None:
            return None
        start_event = self.gpu.mark() if self.gpu is not None else None
        return phase, start_event, self._now()

    @entry_point("distributed.work_wait", "wait() of an async collective, after it")
    def work_waited(self, token: tuple) -> None:
        end = self._now()
        phase, start_event, start = token
        self.clock.collective(phase, end - start, 0, count=0)
        if start_event is not None:
            self.gpu.add_comm(phase, start_event, self.gpu.mark())

    # -- failure ---------------------------------------------------------------------------

    def _entry_failed(self, name: str, exc: BaseException) -> None:
        self._fail(name, exc)

    def _fail(self, piece: str, exc: BaseException) -> None:
        if self._failed:
            return
        self._failed = True
        self.active = False
        self._on_failure(f"{piece} failed ({type(exc).__name__}: {exc})")
