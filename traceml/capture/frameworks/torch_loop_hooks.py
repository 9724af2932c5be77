"""What the any-loop capture installs in torch, and how it takes it away again.

* module forward hooks: global (``register_module_forward_pre_hook``: every module call) until
  the first optimizer step, then on the root modules found by then only: a door on the root's
  own class where it can be, else hooks that pickling and ``torch.save`` of the model do not
  carry (traceml.capture.forward_hooks);
* ``torch.optim``'s global optimizer step pre/post hooks;
* ``torch.autograd.backward`` (``Tensor.backward`` calls it through the module attribute);
* ``_BaseDataLoaderIter.__next__`` (every torch DataLoader iterator);
* ``torch.export.export``, which runs with the global module hooks lifted (a strict export
  fails while any global module hook is registered: torch's own wrapper module then takes
  the hooked call path into a file its compiler skips).

Each wrapper calls the user's function itself, exactly once, outside any guard; traceml's part
before and after goes through the capture's guarded entry points. Everything is undone by
:meth:`LoopHooks.remove` (at stand-down, on a failure, at the end of tracing).
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

from traceml.capture import class_doors
from traceml.capture.clock import clock_ns
from traceml.capture.compiling import compiler_check
from traceml.capture.forward_hooks import add_forward_hooks, wrap_forward
from traceml.capture.optimizer_hooks import remove_hook
from traceml.capture.undo import undo_all

# A module compiled in place (``model.compile(fullgraph=True)``) has torch's compiler trace
# its whole call, the forward hooks in it: traceml's clock there is a call the compiler cannot
# trace, and a fullgraph compile raised in the user's loop. The compiler reads this check as
# True and leaves the hooks out of its graph; run natively, it is False.
_compiling = compiler_check()


def _parameter_free(module: Any) -> bool:
    for _parameter in module.parameters():
        return False
    return True


class LoopHooks:
    def __init__(self, capture: Any) -> None:
        self.capture = capture
        self.roots: weakref.WeakSet = weakref.WeakSet()
        self._depth = 0  # module calls in progress (the outermost one is the forward)
        self._outer_timed = False
        self._forward_handles: list[Any] = []
        self._inert = False  # the global hooks left registered, doing nothing (see remove)
        self._inert_handles: list[Any] = []
        self._export_undo: Any = None  # torch.export.export's restore (see remove)
        self.maybe_compiled_in_place = False  # no training forward seen (model.compile())
        self.optimizer_calls = 0  # optimizer.step() calls begun (GradScaler: did it skip?)
        self._in_hook: str | None = None  # "pre"/"post": inside traceml's optimizer step hook
        self._undo: list[Any] = []

    def install(self) -> None:
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_module

        self._forward_handles = [
            nn_module.register_module_forward_pre_hook(self._pre),
            nn_module.register_module_forward_hook(self._post, always_call=True),
        ]
        pre = optim_module.register_optimizer_step_pre_hook(self._optimizer_pre)
        post = optim_module.register_optimizer_step_post_hook(self._optimizer_post)

        def remove_optimizer_hooks() -> None:  # also from inside them (optimizer_hooks)
            remove_hook(pre, iterating=self._in_hook == "pre")
            remove_hook(post, iterating=self._in_hook == "post")

        self._undo.append(remove_optimizer_hooks)
        self._wrap_backward()
        self._wrap_fetch()
        self._wrap_grad_scaler()
        self._wrap_export()

    # -- forward ---------------------------------------------------------------------------

    def _pre(self, module: Any, _args: Any) -> None:
        if _compiling() or self._inert:  # (compiling: only while torch's compiler traces)
            return
        depth = self._depth
        if depth == 0 and self._forward_handles and _parameter_free(module):
            # A loss (``nn.CrossEntropyLoss()(out, y)``) or an augmentation module called
            # outside the model: not the model's Forward (Residual, as the loss is with
            # Lightning), and never a root; a model it calls is the outermost call (its depth
            # is not counted: its post hook comes at depth 0). Roots are found while the hooks
            # are global, so later steps pay nothing for this.
            return
        self._depth = depth + 1
        if depth == 0:
            timed = self.capture.forward_started(module)
            self._outer_timed = bool(timed)
            if timed and self._forward_handles:  # still global: remember the root
                self.roots.add(module)

    def _post(self, _module: Any, _args: Any, _output: Any) -> None:
        if _compiling() or self._inert or self._depth == 0:  # (0: parameter-free, see _pre)
            return
        self._depth -= 1
        if self._depth == 0 and self._outer_timed:
            self._outer_timed = False
            self.capture.forward_ended()

    def roots_found(self) -> None:
        """After the first optimizer step: hooks on the roots only (no per-module cost).
        Not where torch's compiler ran with the global hooks (see :meth:`_compiled`): they
        stay, and time the forward; the module calls they see are the compiled graph's
        outside (inside it, the compiler leaves them out)."""
        if not self._forward_handles or self._compiled():
            return
        global_handles, self._forward_handles = self._forward_handles, []
        for handle in global_handles:
            handle.remove()
        for root in list(self.roots):
            self._undo.append(self._time_root(root))

    def _time_root(self, root: Any) -> Any:
        """A door on the root's own class where it can be (``model.forward`` stays a bound
        method; ``torch.jit.script(model)`` compiles as untraced, during and after the loop;
        ``model(x)`` keeps torch's fast call path); else hooks that pickle / deepcopy /
        torch.save of the model do not carry. Either holds the root weakly. The undo."""
        held = weakref.ref(root)
        pre, post = self._pre, self._post

        def before() -> None:
            pre(held(), None)

        def after() -> None:
            post(None, None, None)

        # The root's own forward hooks (the user's): where it has some, traceml's hooks go
        # first, as the global ones did in the first step, so every step counts them alike
        # (its pre-hooks in Forward, its post-hooks after it); a door would leave them all out.
        # (A class copying itself by __deepcopy__ / __reduce__ is fine for a door: it leaves
        # the instance as it is, so no copy can carry it.)
        hooked = getattr(root, "_forward_pre_hooks", None) or getattr(root, "_forward_hooks", None)
        undo = None if hooked else wrap_forward(root, before, after, on_instance=False)
        if undo is None:
            undo = add_forward_hooks(root, pre, post, always_call=True, first=True)
        return undo

    # -- optimizer -------------------------------------------------------------------------

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # An optimizer step inside torch.compile: the compiler would trace traceml's clock and
        # bookkeeping and break the user's graph there; such a step is left undelimited (the
        # rank file's "no optimizer step" note, as a step compiled into one graph).
        if _compiling():
            return
        self.optimizer_calls += 1
        self._in_hook = "pre"  # torch iterates the pre-hooks now (remove_optimizer_hooks)
        try:
            # (``args`` starts with the optimizer itself; Accelerate's wrapper passes
            # closure=None positionally: only a closure counts)
            if (args[1] if len(args) > 1 else kwargs.get("closure")) is not None:
                self.capture.closure_step(optimizer)
            else:
                self.capture.optimizer_started(optimizer)
        finally:
            self._in_hook = None

    def _optimizer_post(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if _compiling():
            return
        self._in_hook = "post"
        try:
            self.capture.optimizer_ended(optimizer)
        finally:
            self._in_hook = None

    # -- backward --------------------------------------------------------------------------

    def _wrap_backward(self) -> None:
        import torch.autograd

        original = torch.autograd.backward
        capture = self.capture

        @functools.wraps(original)
        def backward(*args: Any, **kwargs: Any) -> Any:
            if _compiling():  # torch's compiler tracing the user's step: no clock in its graph
                return original(*args, **kwargs)
            began = capture.backward_started()
            try:
                result = original(*args, **kwargs)  # the user's errors pass through unchanged
            except BaseException:
                if began:
                    capture.backward_raised()
                raise
            if began:
                capture.backward_ended()
            return result

        torch.autograd.backward = backward

        def restore() -> None:
            if torch.autograd.backward is backward:
                torch.autograd.backward = original

        self._undo.append(restore)

    # -- input -----------------------------------------------------------------------------

    def _wrap_fetch(self) -> None:
        from torch.utils.data import dataloader

        base = dataloader._BaseDataLoaderIter
        original = base.__dict__["__next__"]
        capture = self.capture

        def __next__(self: Any) -> Any:
            if _compiling():  # (as backward's)
                return original(self)
            start = clock_ns()
            try:
                batch = original(self)  # the user's errors and StopIteration pass through
            except StopIteration:
                capture.iterator_exhausted(self, start, clock_ns())
                raise
            capture.fetched(self, start, clock_ns())
            return batch

        __next__.__qualname__ = original.__qualname__
        base.__next__ = __next__

        def restore() -> None:
            if base.__dict__.get("__next__") is __next__:
                base.__next__ = original

        self._undo.append(restore)

    # -- AMP -------------------------------------------------------------------------------

    def _wrap_grad_scaler(self) -> None:
        """``GradScaler.step`` skips ``optimizer.step()`` when gradients overflowed: no step
        hook fires, yet the loop made a step. The wrapper tells the capture so."""
        from torch.amp import grad_scaler

        scaler_class = grad_scaler.GradScaler
        original = scaler_class.__dict__["step"]
        capture, hooks = self.capture, self

        @functools.wraps(original)
        def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            # Skipped: optimizer.step() was not called. (Not "no step ended": with one scaler
            # for two optimizers, the one whose step ends no step is no skip; review.)
            before = hooks.optimizer_calls
            result = original(self, optimizer, *args, **kwargs)
            if hooks.optimizer_calls == before:
                capture.scaler_skipped(optimizer)
            return result

        scaler_class.step = step

        def restore() -> None:
            if scaler_class.__dict__.get("step") is step:
                scaler_class.step = original

        self._undo.append(restore)

    # -- export ----------------------------------------------------------------------------

    def _wrap_export(self) -> None:
        """``torch.export.export`` runs with traceml's global module hooks and its doors on
        classes lifted: an export is no training, a strict export fails with any global hook,
        and the program it saves names the file of each frame it ran through (traceml's door
        on the model's class, else). ``torch.jit.trace`` records every frame of the Python
        stack, a wrapper's too: not wrapped (docs/transparency.md)."""
        import torch.export as export_module

        original = export_module.export
        wrapper = self._lifting(original)
        export_module.export = wrapper

        def restore() -> None:
            if export_module.export is wrapper:
                export_module.export = original

        self._export_undo = restore

    def _lifting(self, original: Any) -> Any:
        @functools.wraps(original)
        def lifting(*args: Any, **kwargs: Any) -> Any:
            lifted = self._lift_global()
            doors = class_doors.lifted()
            try:  # the user's errors pass through unchanged
                return original(*args, **kwargs)
            finally:
                class_doors.put_back(doors)
                self._put_back(lifted)

        return lifting

    def _lift_global(self) -> list[Any]:
        """traceml's global module hooks out of torch's dicts (an export is no training)."""
        try:
            from torch.nn.modules import module as nn_module

            ours = {handle.id for handle in self._forward_handles or self._inert_handles}
            lifted = []
            for hooks in (
                nn_module._global_forward_pre_hooks,
                nn_module._global_forward_hooks,
                nn_module._global_forward_hooks_always_called,
            ):
                order = list(hooks)
                lifted.append((hooks, order, {k: hooks.pop(k) for k in order if k in ours}))
            return lifted
        except Exception:
            return []  # left registered: the export runs as it did before this wrapper

    def _put_back(self, lifted: list[Any]) -> None:
        """Each hook back in its place (the ones still traceml's: none if removed meanwhile)."""
        try:
            ours = {handle.id for handle in self._forward_handles or self._inert_handles}
            for hooks, order, taken in lifted:
                now = dict(hooks)
                hooks.clear()
                for key in order:
                    if key in taken and key in ours:
                        hooks[key] = taken[key]
                    elif key in now:
                        hooks[key] = now.pop(key)
                hooks.update(now)  # registered during the export: after the others
        except Exception:
            pass

    # -- removing --------------------------------------------------------------------------

    def _compiled(self) -> bool:
        """Whether torch's compiler made a graph while traceml's global module hooks were on:
        its graphs are guarded on the number of global hooks, so taking them away would make
        it compile the model again (a recompile of seconds to minutes, in the user's next
        step; helper review, stop 57)."""
        for root in self.roots:  # torch.compile(model): the wrapper is the root
            if type(root).__name__ == "OptimizedModule" or getattr(
                root, "_compiled_call_impl", None
            ):
                return True
        if not self.maybe_compiled_in_place:  # (a compiled loss, helper: not the hooks' case)
            return False
        dynamo = sys.modules.get("torch._dynamo")  # model.compile(): no root is seen
        try:
            return bool(dynamo is not None and dynamo.utils.counters["stats"]["unique_graphs"])
        except Exception:
            return False

    def remove(self) -> None:
        """Take everything away (idempotent; each undo is attempted even if one fails). The
        global module hooks, where the compiler ran with them, stay registered and do nothing
        (:meth:`_compiled`): the one trace of traceml left, in torch's private hook dicts."""
        handles, self._forward_handles = self._forward_handles, []
        if handles and self._compiled():
            self._inert = True
            self._inert_handles, handles = handles, []  # export still lifts them
        for handle in handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._depth = 0
        self._outer_timed = False
        undo_all(self._undo)
        if not self._inert and self._export_undo is not None:
            self._export_undo, undo = None, self._export_undo
            undo()
