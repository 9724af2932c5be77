"""Waiting on other ranks: torch.distributed collectives and DDP's gradient buckets, timed.

Installed only in a traced training whose process group has more than one rank; a single
process pays nothing. Two kinds of blocking points:

* **Collectives called from anywhere in the step** (the model's own code: RF-DETR's criterion
  all-reduces its box count inside ``training_step``; Lightning's ``sync_dist`` logging; EMA or
  metric syncs; ``barrier()`` in callbacks). The ``torch.distributed`` functions are replaced by
  timing wrappers for the duration of the traced fit. A synchronous call is timed as a whole;
  an ``async_op=True`` call returns a thin proxy whose ``wait()`` is timed, because that is
  where the host blocks. Calls made by torch itself (``distributed_c10d`` calling its own
  module globals) are not wrapped: they are inside an outer call already, or not the user's.
* **DDP's gradient buckets**, through a communication hook (the default all-reduce, or the
  user's own hook, wrapped). Buckets are launched during backward and overlap the remaining
  gradient computation; the host blocks at the end of backward until every bucket is done
  (``Reducer::finalize_backward``). The exposed wait is therefore the time inside the hook
  calls plus the tail from the last bucket's launch to the last bucket's completion. A rank
  that finished its gradients early waits that tail for the slow rank; the slow rank hardly
  waits at all.

On CUDA with NCCL the host does not block in a collective (the work runs on NCCL's stream and
``wait()`` only orders streams), so host times stay near zero there; CUDA events recorded on
the current stream around each collective (and from the last bucket launch to the end of
backward) measure what the device waited. They are read lazily with the step's other events.

Each wait is charged to the phase it happens in (``StepClock.current_phase``); it stays inside
that phase, so the phases still add up to the step and a phase's own time is the phase minus
its wait.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from traceml import schema
from traceml.capture.guard import entry_point

clock_ns = time.perf_counter_ns

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


class CommTimer:
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
        self.bucket_timing: str | None = None  # "on" / "off"; None: no DDP model
        self.bucket_note: str | None = None  # why bucket timing is off
        self._on_failure = on_failure
        self._now = now
        self.own_cost_ns = 0  # time inside this timer's entry points (traceml.capture.guard)
        self._failed = False
        self._depth = 0  # >0 inside a timed call: collectives it makes pass through
        self._undo: list[Callable[[], None]] = []
        self._register_original: Callable[..., Any] | None = None
        self._reset_buckets()

    # -- installing ------------------------------------------------------------------------

    def install_collectives(self, dist_module: Any) -> None:
        """Replace the ``torch.distributed`` collectives with timing wrappers (undone by
        :meth:`uninstall`)."""
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

    def wrap_hook_registration(self, ddp_class: type) -> None:
        """Wrap ``DistributedDataParallel.register_comm_hook`` so that a hook the user (or
        Lightning's ``ddp_comm_hook``) registers while this training starts is timed too.

        Must run before the strategy wraps the model (Lightning's ``setup`` hook does)."""
        original = ddp_class.__dict__.get("register_comm_hook")
        if original is None or getattr(original, _WRAPPED, False):
            return
        timer = self

        @functools.wraps(original)
        def register_comm_hook(ddp: Any, state: Any, hook: Any) -> Any:
            timed = timer.wrapped_hook(hook) or hook
            result = original(ddp, state, timed)
            if timed is not hook:
                ddp._traceml_timed_hook = True
            return result

        setattr(register_comm_hook, _WRAPPED, True)
        ddp_class.register_comm_hook = register_comm_hook
        self._register_original = original

        def restore() -> None:
            if ddp_class.__dict__.get("register_comm_hook") is register_comm_hook:
                ddp_class.register_comm_hook = original

        self._undo.append(restore)

    @entry_point("distributed.register_comm_hook", "DDP.register_comm_hook, wrapped")
    def wrapped_hook(self, hook: Any) -> Any:
        """The user's DDP communication hook with timing around it."""
        return self.bucket_hook(hook)

    def attach_buckets(self, ddp: Any) -> None:
        """Time ``ddp``'s gradient buckets: keep a hook already wrapped at registration, else
        register the default all-reduce wrapped in timing; say why when neither is possible."""
        if getattr(ddp, "_traceml_timed_hook", False):
            self.bucket_timing = "on"
            return
        if getattr(ddp, "_comm_hooks", None):
            self._buckets_off(
                "a DDP communication hook was registered before traceml could wrap it "
                "(it keeps working; its bucket waits show up in Backward)"
            )
            return
        try:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            register = self._register_original or type(ddp).register_comm_hook
            register(ddp, getattr(ddp, "process_group", None), self.bucket_hook(allreduce_hook))
            ddp._traceml_timed_hook = True
            self.bucket_timing = "on"
        except Exception as exc:
            # e.g. a built-in (C++) hook is registered already: DDP accepts one hook only.
            self._buckets_off(
                f"could not add a timing hook to DDP ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); "
                "bucket waits show up in Backward"
            )

    def _buckets_off(self, reason: str) -> None:
        self.bucket_timing = "off"
        self.bucket_note = reason

    def uninstall(self) -> None:
        """Stop timing and put the collectives back. A DDP hook cannot be unregistered: it
        stays and passes straight through to the all-reduce it wraps."""
        self.active = False
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception:
                pass

    # -- collectives -----------------------------------------------------------------------

    def _collective_wrapper(
        self, original: Callable[..., Any], payload_position: int = 0
    ) -> Callable[..., Any]:
        timer = self

        @functools.wraps(original)
        def timed_collective(*args: Any, **kwargs: Any) -> Any:
            token = None
            if timer.active and not timer._depth:
                token = timer._collective_started(args, kwargs, payload_position)
            if token is None:
                return original(*args, **kwargs)
            timer._depth += 1
            try:
                result = original(*args, **kwargs)  # the user's errors pass through unchanged
            finally:
                timer._depth -= 1
            timed = timer._collective_ended(token, result)
            return result if timed is None else timed

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
    def _collective_ended(self, token: tuple, result: Any) -> Any:
        end = self._now()
        phase, nbytes, start_event, start = token
        self.clock.collective(phase, end - start, nbytes)
        if result is not None and hasattr(result, "wait"):
            # async_op=True: the launch is timed above; the wait is timed where it happens.
            return TimedWork(result, self, start_event)
        if start_event is not None:
            self.gpu.add_comm(phase, start_event, self.gpu.mark())
        return None

    @entry_point("distributed.work_wait", "wait() of an async collective, after it")
    def work_waited(self, start: int, end: int, start_event: Any) -> None:
        phase = self.clock.current_phase() if self.active else None
        if phase is None:
            if start_event is not None and self.gpu is not None:
                self.gpu.release(start_event)
            return
        self.clock.collective(phase, end - start, 0, count=0)
        if start_event is not None and self.gpu is not None:
            self.gpu.add_comm(phase, start_event, self.gpu.mark())

    # -- DDP gradient buckets --------------------------------------------------------------

    def bucket_hook(self, hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """``hook`` (a DDP communication hook) with its launches and completions timed."""
        timer = self

        @functools.wraps(hook)
        def timed_bucket_hook(state: Any, bucket: Any) -> Any:
            token = None
            if timer.active and not timer._depth:
                token = timer._bucket_started(bucket)
            if token is None:
                return hook(state, bucket)
            timer._depth += 1
            try:
                future = hook(state, bucket)
            finally:
                timer._depth -= 1
            timed = timer._bucket_launched(token, future)
            return future if timed is None else timed

        return timed_bucket_hook

    def _reset_buckets(self) -> None:
        self._bucket_hook_ns = 0
        self._bucket_count = 0
        self._bucket_bytes = 0
        self._bucket_last_launch: int | None = None
        self._bucket_done: list[int] = []
        self._bucket_event: Any = None

    @entry_point("distributed.backward_started", "the bucket timer, at the start of backward")
    def backward_started(self) -> None:
        if self._bucket_event is not None and self.gpu is not None:
            self.gpu.release(self._bucket_event)
        self._reset_buckets()

    @entry_point("distributed.bucket_start", "a DDP gradient bucket's hook, before it")
    def _bucket_started(self, bucket: Any) -> tuple | None:
        if self.clock.current_phase() is None:
            return None
        buffer = bucket.buffer()
        return buffer.numel() * buffer.element_size(), self._now()

    @entry_point("distributed.bucket_launched", "a DDP gradient bucket's hook, after it")
    def _bucket_launched(self, token: tuple, future: Any) -> Any:
        end = self._now()
        nbytes, start = token
        self._bucket_hook_ns += end - start
        self._bucket_count += 1
        self._bucket_bytes += nbytes
        self._bucket_last_launch = end
        if self.gpu is not None:
            if self._bucket_event is not None:
                self.gpu.release(self._bucket_event)
            self._bucket_event = self.gpu.mark()
        done = self._bucket_done
        now = self._now

        def completed(fut: Any) -> Any:
            # Runs where the future completes (gloo: its worker thread), before DDP's wait on
            # it returns; list.append is atomic under the GIL.
            done.append(now())
            return fut.value()

        return future.then(completed)

    @entry_point("distributed.backward_finished", "the bucket timer, at the end of backward")
    def backward_finished(self) -> None:
        """End of backward (``on_after_backward``): charge the buckets' exposed wait."""
        if not self._bucket_count:
            return
        last_done = max(self._bucket_done, default=None)
        tail = 0
        if last_done is not None and self._bucket_last_launch is not None:
            tail = max(0, last_done - self._bucket_last_launch)
        self.clock.collective(
            schema.BACKWARD,
            self._bucket_hook_ns + tail,
            self._bucket_bytes,
            count=self._bucket_count,
        )
        if self._bucket_event is not None and self.gpu is not None:
            self.gpu.add_comm(schema.BACKWARD, self._bucket_event, self.gpu.mark())
            self._bucket_event = None
        self._reset_buckets()

    # -- failure ---------------------------------------------------------------------------

    def _entry_failed(self, name: str, exc: BaseException) -> None:
        self._fail(name, exc)

    def _fail(self, piece: str, exc: BaseException) -> None:
        if self._failed:
            return
        self._failed = True
        self.active = False
        self._on_failure(f"{piece} failed ({type(exc).__name__}: {exc})")


class TimedWork:
    """The ``Work`` of an ``async_op=True`` collective, with its ``wait()`` timed.

    Everything else is the original object's (attribute access is forwarded)."""

    __slots__ = ("_start_event", "_timer", "_work")

    def __init__(self, work: Any, timer: CommTimer, start_event: Any) -> None:
        self._work = work
        self._timer = timer
        self._start_event = start_event

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        timer = self._timer
        if not timer.active:
            return self._work.wait(*args, **kwargs)
        start = timer._now()
        result = self._work.wait(*args, **kwargs)
        end = timer._now()
        event, self._start_event = self._start_event, None
        timer.work_waited(start, end, event)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)

    def __repr__(self) -> str:
        return repr(self._work)
