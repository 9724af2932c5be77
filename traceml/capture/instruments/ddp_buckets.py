"""DDP's gradient buckets, timed through DDP's one communication hook, without taking it.

DDP allows one communication hook per model (``Reducer::register_comm_hook`` refuses a second),
so traceml never holds that slot against the user:

* A hook the user registers while the traced fit starts or runs (``register_comm_hook`` in
  ``setup`` or ``on_train_start``, Lightning's ``ddp_comm_hook``) reaches torch's
  ``dist._register_comm_hook``, wrapped for the fit: it goes in with timing around it.
* Otherwise traceml registers, at the start of training, a *route*: DDP's default all-reduce,
  timed, behind a slot the user can still fill. A user hook registered later (through
  ``DDP.register_comm_hook``, which does its own bookkeeping first) takes the route's place and
  is timed the same way; a second registration fails exactly as untraced.
* A hook registered before traceml was attached (a built-in C++ hook, or a Python hook before
  the fit) is left alone: bucket timing is off, said once in the rank file.

DDP's Python side (``_comm_hooks``, its logger's hook name) is only ever touched by DDP itself,
and traceml's knowledge of which reducers it routes lives beside them (a weak dictionary).

Buckets are launched during backward and overlap the remaining gradient computation; the host
blocks at the end of backward until every bucket is done (``Reducer::finalize_backward``). The
exposed wait is therefore the time inside the hook calls plus the tail from the last bucket's
launch to the last bucket's completion.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from traceml import schema
from traceml.capture.guard import entry_point


class BucketRoute:
    """What a routed reducer's buckets go to: DDP's default all-reduce until the user
    registers a hook of their own."""

    __slots__ = ("hook", "state", "users")

    def __init__(self, hook: Callable[[Any, Any], Any], state: Any) -> None:
        self.hook, self.state, self.users = hook, state, False


def _route_bucket(route: BucketRoute, bucket: Any) -> Any:
    return route.hook(route.state, bucket)


class BucketTiming:
    """The DDP half of :class:`~traceml.capture.instruments.distributed.CommTimer` (a mixin:
    the clock, device timer, failure handling and per-thread depth are the timer's)."""

    bucket_timing: str | None
    bucket_note: str | None

    def _init_buckets(self) -> None:
        self.bucket_timing = None  # "on" / "off"; None: no DDP model
        self.bucket_note = None  # why bucket timing is off
        self._register_original: Callable[..., Any] | None = None
        self._routes: weakref.WeakKeyDictionary[Any, BucketRoute] = weakref.WeakKeyDictionary()
        self._timed_reducers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._reset_buckets()

    # -- registration ------------------------------------------------------------------------

    def wrap_hook_registration(self, ddp_class: type | None = None) -> None:
        """Wrap ``torch.distributed._register_comm_hook`` (where ``DDP.register_comm_hook``
        ends) for the fit: a user hook goes in timed, into a route's slot if traceml put one
        there. Must run before the strategy wraps the model (Lightning's ``setup`` does)."""
        import torch.distributed as dist

        original = getattr(dist, "_register_comm_hook", None)
        if original is None or getattr(original, "_traceml_routed", False):
            return
        timer, timing = self, [True]

        @functools.wraps(original)
        def register_comm_hook(reducer: Any, state: Any, hook: Any) -> Any:
            route = timer._route_of(reducer)
            if route is not None and not route.users:
                route.hook, route.state, route.users = hook, state, True
                return None
            if not timing[0]:  # tracing is over: the user's hook goes in as it is
                return original(reducer, state, hook)
            timed = timer.wrapped_hook(hook) or hook
            result = original(reducer, state, timed)  # a second hook fails here, as untraced
            if timed is not hook:
                timer._note_timed(reducer)
            return result

        register_comm_hook._traceml_routed = True  # type: ignore[attr-defined]
        dist._register_comm_hook = register_comm_hook
        self._register_original = original

        def restore() -> None:
            timing[0] = False
            if getattr(dist, "_register_comm_hook", None) is not register_comm_hook:
                return
            # A routed DDP model that lives on (tracing stopped at the step limit or after a
            # failure; a loop's model after its Trainer) holds traceml's route in its one hook
            # slot: the wrapper stays to hand that slot to the user's hook, as untraced DDP
            # would take it. It times nothing from now on.
            if any(not route.users for route in list(self._routes.values())):
                return
            dist._register_comm_hook = original

        self._undo.append(restore)

    @entry_point("distributed.register_comm_hook", "DDP's comm hook registration, wrapped")
    def wrapped_hook(self, hook: Any) -> Any:
        """The user's DDP communication hook with timing around it."""
        return self.bucket_hook(hook)

    def _route_of(self, reducer: Any) -> BucketRoute | None:
        try:
            return self._routes.get(reducer)
        except TypeError:  # not weakly referenceable: never routed
            return None

    def _note_timed(self, reducer: Any) -> None:
        try:
            self._timed_reducers.add(reducer)
        except TypeError:
            pass

    def attach_buckets(self, ddp: Any) -> None:
        """Time ``ddp``'s gradient buckets: through the user's hook if it went in timed, else
        through a route of traceml's; say why when neither is possible."""
        reducer = getattr(ddp, "reducer", None)
        if reducer is not None and reducer in self._timed_reducers:
            self.bucket_timing = "on"
            return
        if getattr(ddp, "_comm_hooks", None):
            self._buckets_off(
                "a DDP communication hook was registered before traceml was attached "
                "(it keeps working; its bucket waits show up in Backward)"
            )
            return
        try:
            import torch.distributed as dist
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            register = self._register_original or dist._register_comm_hook
            route = BucketRoute(allreduce_hook, getattr(ddp, "process_group", None))
            self._routes[reducer] = route  # first: a reducer that cannot be weakly kept fails here
            try:
                register(reducer, route, self.bucket_hook(_route_bucket))
            except BaseException:
                del self._routes[reducer]
                raise
            self.bucket_timing = "on"
        except Exception as exc:
            # e.g. a built-in (C++) hook is registered already: DDP accepts one hook only.
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self._buckets_off(
                f"could not add a timing hook to DDP ({type(exc).__name__}: {first_line}); "
                "bucket waits show up in Backward"
            )

    def _buckets_off(self, reason: str) -> None:
        self.bucket_timing = "off"
        self.bucket_note = reason

    # -- the buckets -------------------------------------------------------------------------

    def bucket_hook(self, hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """``hook`` (a DDP communication hook) with its launches and completions timed."""
        timer = self

        @functools.wraps(hook)
        def timed_bucket_hook(state: Any, bucket: Any) -> Any:
            token = None
            here = timer._here
            if timer.active and not here.depth:
                token = timer._bucket_started(bucket)
            if token is None:
                return hook(state, bucket)
            here.depth += 1
            try:
                future = hook(state, bucket)
            finally:
                here.depth -= 1
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
        """End of backward (the strategy's ``backward`` returned): charge the exposed wait."""
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
