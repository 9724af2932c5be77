"""The places a Lightning training step is timed without a callback hook.

* Input Wait: the training loop's data fetcher's ``__next__`` (and ``__iter__``) are wrapped,
  on its class for the traced fit (``class_doors``: an instance-level door would cost Lightning's
  method loads on that object their fast path); validation fetchers and other trainers' go
  straight through.
* H2D: ``strategy.batch_to_device`` is wrapped for this strategy instance only (on its class,
  as the fetcher's).
* Backward: ``strategy.backward`` is wrapped for this strategy instance only. Lightning's own
  ``on_before_backward`` / ``on_after_backward`` hooks would do, but each costs a hook dispatch
  per step (a profiler context and a call, ~3 us on the stress loop) on top of traceml's door;
  the wrapper is one frame, and its window is the same for every callback order (every
  callback's and the module's backward hooks, the DDP reducer's preparation, ``loss.backward``).
* Optimizer's end: ``strategy.optimizer_step`` is wrapped for this strategy instance (its
  return: the update is done; lr schedulers and batch-end callbacks after it are Residual).
* The step's end: a door just before the LightningModule's own ``on_train_batch_end``, an
  instance-level wrapper that no copy of the module carries. Lightning calls that hook right
  after every callback's, so the step ends where traceml's callback hook (the last callback)
  would end it, without a callback dispatch per batch (a profiler context, its f-string and a
  call: ~10% of traceml's bytecodes per batch on the stress loop). Where the module cannot be
  wrapped, the callback's hook does it.
* Forward: an instance-level ``forward`` on the model's inner network, which pickling,
  deepcopy and ``torch.save`` of the model do not carry (traceml.capture.forward_hooks). Not
  forward hooks: a module with hooks takes torch's slow call path (~3.5 us per call). A module
  whose forward is not a plain method (a scripted one) keeps the hooks.

Where nothing needs a door at a phase's start (no CUDA event to record, no collective to place
in the phase: a single process without CUDA events), the transfer, the forward and the
backward are timed by one door after the call, whose start is a clock read (a C function that
cannot fail).

Each wrapper calls the user's function itself, exactly once, outside any guard; traceml's part
before and after it goes through the observer's guarded entry points (traceml.capture.guard), so a
traceml failure turns tracing off and never changes what the user's call returns or raises.
Everything installed is removed by :meth:`Instruments.remove`.
"""

from __future__ import annotations

from typing import Any

from traceml import schema
from traceml.capture.class_doors import door_on_class, takes
from traceml.capture.clock import clock_ns
from traceml.capture.forward_hooks import (
    add_forward_hooks,
    call_before_method,
    can_wrap_forward,
    wrap_forward,
    wrap_forward_once,
)
from traceml.capture.guard import declare
from traceml.capture.undo import undo_all

from .lightning_forward import forward_module, forward_note


def guarded_doors(observer: Any) -> Any:
    """The fetcher's event log where each door is a guarded entry point of ``observer`` (the
    callback): ``log((door, start, end))`` calls the door's. One frame more per fetch than the
    session's log, only where the steps have CUDA events or collectives to time as well."""
    doors = {FETCH_DOOR: observer.fetched, ITERATOR_DOOR: observer.iterator_created}

    def log(event: tuple[Any, ...]) -> None:
        doors[event[0]](*event[1:])

    return log


def progress_counters(trainer: Any) -> tuple[Any, Any] | None:
    """Lightning's progress trackers behind ``trainer.global_step`` and
    ``trainer.current_epoch`` (automatic optimization): their ``completed`` read at each step's
    end, without the properties' chain (~8 property frames a step: the trainer's, the epoch
    loop's, ``lightning_module``'s, the strategy's...). Lightning updates these trackers in
    place, checkpoint restores included. None where they cannot be found or do not read what
    the properties read now: the step's end reads the properties."""
    try:
        module = trainer.lightning_module
        if module is None or not module.automatic_optimization:
            return None
        fit_loop = trainer.fit_loop
        steps = fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
        epochs = fit_loop.epoch_progress.current
        if type(steps.completed) is not int or type(epochs.completed) is not int:
            return None
        if steps.completed != trainer.global_step or epochs.completed != trainer.current_epoch:
            return None
        return steps, epochs
    except Exception:  # another Lightning: the properties
        return None


class InBackward:
    """Whether the strategy's backward is running (the one-door wrappers' shared state)."""

    __slots__ = ("depth",)

    def __init__(self) -> None:
        self.depth = 0


# The per-step doors of one-door timing, logged as events (event_doors); the first four are
# the callback's entry points too, for the other modes.
FETCH_DOOR, ITERATOR_DOOR, H2D_DOOR, STEPPED_DOOR = (
    "lightning.fetcher_next",
    "lightning.fetcher_iter",
    "lightning.batch_transferred",
    "lightning.optimizer_stepped",
)
FORWARD_DOOR = declare("lightning.forward_timed", "after the traced module's forward (one door)")
BACKWARD_DOOR = declare("lightning.backward_timed", "after the strategy's backward (one door)")
END_DOOR = "lightning.on_train_batch_end"


def event_doors(session: Any) -> Any:
    """One-door timing (a single process, no CUDA events, no collectives to place): each
    wrapper logs its phase as an event, ``log((door, start, end))``, one ``deque.append``, and
    the sink's flusher replays the events into the session's clock (``step_events``). The
    session's state needs no check here: it removes every instrument when it leaves TRACING,
    and the replay of an event logged after that writes nothing. Returns the log."""
    clock = session.clock
    doors = {
        FETCH_DOOR: clock.fetched,
        ITERATOR_DOOR: clock.iterator_created,
        H2D_DOOR: clock.transferred,
        FORWARD_DOOR: clock.forward_timed,
        BACKWARD_DOOR: clock.backward_timed,
        STEPPED_DOOR: clock.optimizer_ended,
    }
    usual = (FETCH_DOOR, H2D_DOOR, FORWARD_DOOR, BACKWARD_DOOR, STEPPED_DOOR)
    return session.log_events(doors, END_DOOR, usual)


class Instruments:
    """What one traced training installed, and how to take it away again."""

    def __init__(self, observer: Any) -> None:
        self.observer = observer
        # What the wrappers call: the observer's guarded methods, or with one-door timing
        # the session's event log (event_doors).
        self.doors: Any = observer
        self.fetcher: Any = None
        self.one_door = False  # install() timed the transfer, forward and backward by one door
        self._restore_fetcher: Any = None
        self._undo: list[Any] = []

    def install(self, trainer: Any, pl_module: Any, fetcher: Any) -> None:
        observer = self.observer
        module = forward_module(pl_module)
        note = forward_note(pl_module, module)
        if note is not None:
            observer.session.note("info", schema.EVENT_NOTE, note)
        wrappable = module is None or can_wrap_forward(module)
        # One door per phase needs both wrappers: the forward's tells a recomputation inside
        # backward by the backward wrapper's flag (hooks would need the clock's, two doors).
        one_door = self.one_door = wrappable and not observer.needs_start_doors()
        if one_door:
            self.doors = observer.event_doors()
        self.instrument_fetcher(fetcher)
        self._wrap_optimizer_step(trainer.strategy)
        self._wrap_transfer(trainer.strategy)
        inside = InBackward()
        if one_door:
            self._wrap_backward_once(trainer.strategy, inside)
        else:
            self._wrap_backward(trainer.strategy)
        if module is None:
            return
        if one_door:
            undo = wrap_forward_once(module, clock_ns, self.doors, FORWARD_DOOR, inside)
        elif wrappable:
            undo = wrap_forward(module, observer.forward_started, observer.forward_ended)
        else:  # a forward that is not a plain method (a scripted module): hooks, as before
            undo = add_forward_hooks(
                module,
                lambda _module, _inputs: observer.forward_started(),
                lambda _module, _inputs, _output: observer.forward_ended(),
            )
        self._undo.append(undo)

    def end_steps_before_module_hook(self, pl_module: Any, ended: Any) -> bool:
        """Call ``ended()`` (the callback's guarded batch-end hook with its arguments bound,
        or the replay's ``step_end_door``, which catches its own failures) just before
        ``pl_module.on_train_batch_end`` instead of as a callback hook; False where the
        module's hook cannot be wrapped."""
        if not can_wrap_forward(pl_module, "on_train_batch_end"):
            return False
        undo = call_before_method(pl_module, "on_train_batch_end", ended)
        self._undo.append(undo)
        return True

    def instrument_fetcher(self, fetcher: Any) -> None:
        """Input Wait: doors on the one training fetcher's ``__iter__`` and ``__next__``, set
        on its class (``class_doors``: every other fetcher of that class, validation's, goes
        straight through). Also called again when reload_dataloaders_every_n_epochs gives the
        loop a new fetcher."""
        if self._restore_fetcher is not None:
            self._restore_fetcher()
        log = self.doors if self.one_door else guarded_doors(self.observer)

        def timed(door: str) -> Any:
            def make(untimed: Any, target: Any) -> Any:  # __iter__'s and __next__'s door
                def fetcher_door(this: Any) -> Any:
                    if this is not target.obj:
                        return untimed(this)
                    start = clock_ns()
                    result = untimed(this)  # the user's errors and StopIteration pass through
                    log((door, start, clock_ns()))
                    return result

                return fetcher_door

            return make

        undo = [door_on_class(fetcher, "__iter__", timed(ITERATOR_DOOR), on_instance=False)]
        try:
            undo.append(door_on_class(fetcher, "__next__", timed(FETCH_DOOR), on_instance=False))
        except BaseException:
            undo_all(undo)
            raise
        self.fetcher = fetcher
        self._restore_fetcher = lambda: undo_all(undo)

    def release_fetcher(self) -> None:
        """At an epoch's end: the doors off the fetcher and no reference to it kept, so that a
        loop that reloads its DataLoaders drops the old fetcher (and shuts its workers down)
        where it would untraced, not inside traceml's next hook. The next epoch's start times
        the fetcher the loop has then."""
        if self._restore_fetcher is not None:
            self._restore_fetcher()
            self._restore_fetcher = None
        self.fetcher = None

    def _wrap_optimizer_step(self, strategy: Any) -> None:
        observer, log = self.observer, self.doors

        def make(step: Any, target: Any) -> Any:
            if self.one_door and takes(step, ("self", "optimizer", "closure", "model"), (None,), 2):

                def timed_optimizer_step(
                    this: Any, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any
                ) -> Any:
                    if kwargs:
                        result = step(this, optimizer, closure, model, **kwargs)
                    else:  # Lightning's own call: nothing more to pass on
                        result = step(this, optimizer, closure, model)
                    if this is target.obj:
                        log((STEPPED_DOOR, clock_ns()))
                    return result

            elif self.one_door:

                def timed_optimizer_step(this: Any, *args: Any, **kwargs: Any) -> Any:
                    result = step(this, *args, **kwargs)  # the user's errors pass through
                    if this is target.obj:
                        log((STEPPED_DOOR, clock_ns()))
                    return result

            else:

                def timed_optimizer_step(this: Any, *args: Any, **kwargs: Any) -> Any:
                    result = step(this, *args, **kwargs)  # the user's errors pass through
                    if this is target.obj:
                        observer.optimizer_stepped()
                    return result

            return timed_optimizer_step

        self._undo.append(door_on_class(strategy, "optimizer_step", make))

    def _wrap_transfer(self, strategy: Any) -> None:
        observer, log = self.observer, self.doors
        start_doors, one_door = observer.needs_start_doors(), self.one_door

        def make(transfer: Any, target: Any) -> Any:
            if start_doors:
                # A CUDA event to record, or collectives to place in H2D: a door before too.
                def timed_batch_to_device(this: Any, *args: Any, **kwargs: Any) -> Any:
                    if this is not target.obj:
                        return transfer(this, *args, **kwargs)
                    token = observer.transfer_started()
                    result = transfer(this, *args, **kwargs)
                    if token is not None:
                        observer.transferred(token)
                    return result

            elif one_door and takes(
                transfer, ("self", "batch", "device", "dataloader_idx"), (None, 0)
            ):

                def timed_batch_to_device(
                    this: Any, batch: Any, device: Any = None, dataloader_idx: int = 0
                ) -> Any:
                    if this is not target.obj:
                        return transfer(this, batch, device, dataloader_idx)
                    start = clock_ns()
                    result = transfer(this, batch, device, dataloader_idx)
                    log((H2D_DOOR, start, clock_ns()))
                    return result

            elif one_door:

                def timed_batch_to_device(this: Any, *args: Any, **kwargs: Any) -> Any:
                    if this is not target.obj:
                        return transfer(this, *args, **kwargs)
                    start = clock_ns()
                    result = transfer(this, *args, **kwargs)
                    log((H2D_DOOR, start, clock_ns()))
                    return result

            else:

                def timed_batch_to_device(this: Any, *args: Any, **kwargs: Any) -> Any:
                    if this is not target.obj:
                        return transfer(this, *args, **kwargs)
                    start = clock_ns()
                    result = transfer(this, *args, **kwargs)
                    observer.transferred(start)
                    return result

            return timed_batch_to_device

        self._undo.append(door_on_class(strategy, "batch_to_device", make))

    def _wrap_backward(self, strategy: Any) -> None:
        observer = self.observer

        def make(backward: Any, target: Any) -> Any:
            def timed_backward(this: Any, *args: Any, **kwargs: Any) -> Any:
                if this is not target.obj:
                    return backward(this, *args, **kwargs)
                observer.backward_started()
                try:
                    return backward(this, *args, **kwargs)  # the user's errors pass through
                finally:
                    observer.backward_ended()

            return timed_backward

        self._undo.append(door_on_class(strategy, "backward", make))

    def _wrap_backward_once(self, strategy: Any, inside: InBackward) -> None:
        """Backward with one door after it. ``inside.depth`` (an integer on traceml's own
        object: nothing to fail) tells the one-door forward that a forward run now is a
        recomputation inside backward (activation checkpointing): Backward, not Forward."""
        log = self.doors

        def make(backward: Any, target: Any) -> Any:
            if takes(backward, ("self", "closure_loss", "optimizer"), None, 3):

                def timed_backward_named(
                    this: Any, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any
                ) -> Any:
                    if inside.depth or this is not target.obj:
                        return backward(this, closure_loss, optimizer, *args, **kwargs)
                    inside.depth = 1
                    start = clock_ns()
                    try:
                        if args or kwargs:
                            return backward(this, closure_loss, optimizer, *args, **kwargs)
                        return backward(this, closure_loss, optimizer)  # Lightning's own call
                    finally:
                        inside.depth = 0
                        log((BACKWARD_DOOR, start, clock_ns()))

                return timed_backward_named

            def timed_backward(this: Any, *args: Any, **kwargs: Any) -> Any:
                if inside.depth or this is not target.obj:
                    return backward(this, *args, **kwargs)
                inside.depth = 1
                start = clock_ns()
                try:
                    return backward(this, *args, **kwargs)  # the user's errors pass through
                finally:
                    inside.depth = 0
                    log((BACKWARD_DOOR, start, clock_ns()))

            return timed_backward

        self._undo.append(door_on_class(strategy, "backward", make))

    def add_undo(self, undo: Any) -> None:
        self._undo.append(undo)

    def remove(self) -> None:
        """Take everything away (idempotent; each undo is attempted even if one fails)."""
        if self._restore_fetcher is not None:
            restore, self._restore_fetcher = self._restore_fetcher, None
            try:
                restore()
            except Exception:
                pass
        undo_all(self._undo)
