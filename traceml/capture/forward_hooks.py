"""Forward hooks on the user's module that copying and saving the module do not carry.

A hook added with ``register_forward_hook`` lives in the module's own ``_forward_hooks`` dict, so
``pickle``, ``copy.deepcopy`` and ``torch.save(model)`` of the module during training would carry
traceml's hook with it: pickling fails, or the user's checkpoint names traceml. Lightning makes
this common: every callback's ``log`` is bound to the LightningModule, so pickling a callback
pickles the module.

While traceml's hooks are on a module, the module gets an instance-level ``__getstate__`` that
hands the pickler the module's usual state (its class's ``__getstate__``) without traceml's
entries. ``pickle`` and ``copy`` look ``__getstate__`` up on the instance, so the class and every
other instance are untouched, and the copy is exactly what it would be untraced. The undo takes
the hooks and the ``__getstate__`` away again.

:func:`wrap_forward` and :func:`wrap_forward_once` time the forward without hooks. A module with
hooks takes torch's slow call path (every hook dict consulted, ~3.5 us per call on a 2-core
machine); without them ``module(x)`` takes the fast path straight to ``self.forward``. Where it
can, the wrapper is a door on the module's class that times that one module (held by a weak
reference) and lets every other instance through: ``module.forward`` stays a bound method of
the module, pickles, scripts and reads as untraced (``class_doors.weak_door_on_class``).
Otherwise (an inherited ``forward``, a torch or Hugging Face class, the user's own instance
``forward``) it is an instance-level ``forward`` that the same ``__getstate__`` leaves out of
every copy. Either holds the module weakly (no cycle of traceml's through the module's own
``__dict__``) and calls the class's ``forward`` function as it was at install (or the user's
own instance ``forward``) exactly once per call. Only for a module whose forward is a plain
method and whose class copies itself through ``__getstate__`` (:func:`can_wrap_forward`):
anything else keeps the hooks. :func:`call_before_method` puts a door before one of the
module's methods the same way (the LightningModule's ``on_train_batch_end``, where Lightning's
step ends). Known and left, for the instance-level wrapper: code that copies a module's
``__dict__`` itself (``nn.DataParallel``'s replicas) would carry it, and it runs the original
module; Lightning 2.x has no DataParallel strategy.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

from traceml.capture import class_doors
from traceml.capture.compiling import compiler_check
from traceml.capture.exact_doors import call_before, one_door_forward

# A class that copies itself by any of these may copy its __dict__ as is, the wrapper with it.
_OWN_COPYING = ("__deepcopy__", "__copy__", "__reduce__", "__reduce_ex__")
# Module attributes keyed by hook id (torch 2.x): every one a forward hook may leave an entry in.
# Methods traceml may wrap on an instance: its forward, and Lightning's batch-end hook.
_WRAPPED_NAMES = ("forward", "on_train_batch_end")
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def add_forward_hooks(
    module: Any,
    pre: Callable[..., Any],
    post: Callable[..., Any],
    *,
    always_call: bool = False,
    first: bool = False,
) -> Callable[[], None]:
    """Register ``pre``/``post`` as forward hooks on ``module`` (``first``: before the hooks
    it has, as global hooks run); return their undo."""
    # (keywords only where asked: torch before 2.1 has no always_call)
    pre_kwargs = {"prepend": True} if first else {}
    post_kwargs = {**pre_kwargs, **({"always_call": True} if always_call else {})}
    handles = [module.register_forward_pre_hook(pre, **pre_kwargs)]
    try:
        handles.append(module.register_forward_hook(post, **post_kwargs))
    except BaseException:
        handles[0].remove()  # no half-installed pair left behind
        raise
    ours = frozenset(handle.id for handle in handles)
    getstate = _getstate_without(module, ours)
    module.__dict__["__getstate__"] = getstate
    # Weakly: a hand-written loop's undo waits for the interpreter's exit, and must not keep
    # the user's model (its parameters' memory) alive until then.
    module_ref = weakref.ref(module)

    def undo() -> None:
        for handle in handles:
            handle.remove()
        held = module_ref()
        if held is not None:
            _remove_getstate(held, getstate)

    return undo


def can_wrap_forward(module: Any, name: str = "forward") -> bool:
    """Whether ``module``'s ``name`` method (its forward, or a Lightning hook) can be wrapped
    (on the class or the instance): a plain Python method of its class (or a callable the user
    set on the instance), and a class that copies itself through ``__getstate__`` (no
    ``__deepcopy__`` / ``__reduce__`` of its own, which could carry the wrapper into a copy).
    Otherwise (a scripted module, say) the caller uses hooks."""
    try:
        cls = type(module)
        if any(own in vars(base) for base in cls.__mro__[:-1] for own in _OWN_COPYING):
            return False
        if name in module.__dict__:
            return callable(module.__dict__[name])
        bound = getattr(module, name)
        return (
            inspect.ismethod(bound)
            and bound.__self__ is module
            and inspect.isfunction(bound.__func__)
        )
    except Exception:
        return False


def _untimed_call(module: Any, name: str = "forward") -> tuple[Any, Any]:
    """(the user's own instance attribute or None, the class's function)."""
    previous = module.__dict__.get(name)
    return previous, None if previous is not None else getattr(module, name).__func__


def wrap_forward(
    module: Any,
    before: Callable[[], Any],
    after: Callable[[], Any],
    *,
    on_instance: bool = True,
) -> Callable[[], None] | None:
    """Time ``module``'s forward with ``before()`` and ``after()`` around each call (``after``
    also when the forward raises; both must never raise: guarded entry points); the undo.
    Only for a module that :func:`can_wrap_forward`. ``on_instance=False``: a door on the
    class or nothing (None: the caller keeps its hooks)."""
    _traceml_before, _traceml_after = before, after  # (closure names: see _rehomed)

    def make(_traceml_call: Any, _traceml_target: Any) -> Any:
        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self is not _traceml_target.obj():
                return _traceml_call(self, *args, **kwargs)
            _traceml_before()
            try:
                return _traceml_call(self, *args, **kwargs)
            finally:
                _traceml_after()

        return forward

    undo = class_doors.weak_door_on_class(module, "forward", make)
    if undo is not None or not on_instance:
        return undo
    module_ref = weakref.ref(module)
    previous, function = _untimed_call(module)

    def timed_forward(*args: Any, **kwargs: Any) -> Any:
        before()
        try:
            if previous is not None:
                return previous(*args, **kwargs)
            return function(module_ref(), *args, **kwargs)
        finally:
            after()

    return _install_forward(module, timed_forward, previous)


def wrap_forward_once(
    module: Any, clock: Callable[[], int], log: Callable[[Any], Any], door: str, inside: Any = None
) -> Callable[[], None]:
    """Time ``module``'s forward with one door: ``log((door, start, end))`` once the outermost
    call of this module returns or raises (``clock()`` reads before and after it; ``log`` must
    never raise: a ``deque.append``). A call inside another (a module calling itself) is part of
    the outer one; so is a call while ``inside.depth`` is set (a recomputation inside the
    backward pass, whose time is Backward's). The undo; after it, a copy of the wrapper that
    the user's code kept (``fwd = model.forward``, read while traced) calls the forward untimed
    and logs nothing: its log would otherwise grow for as long as they call it. Only for a
    module that :func:`can_wrap_forward`."""
    _traceml_clock, _traceml_log, _traceml_door, _traceml_inside = clock, log, door, inside
    # Inside a compiled region (a training_step or module compiled after the door went on) the
    # door calls straight through: its clock is a call the compiler cannot trace (a graph
    # break, a recompile on its value, and a fullgraph compile raised in the user's fit).
    _traceml_compiling = compiling = compiler_check()

    def make(_traceml_call: Any, _traceml_target: Any) -> Any:
        exact = one_door_forward(
            _traceml_call, _traceml_call, _traceml_target, clock, log, door, inside, compiling
        )
        if exact is not None:  # the forward's own parameters: nothing packed and passed on
            return exact
        _traceml_depth = 0  # 1 inside the outermost call of the traced module

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            nonlocal _traceml_depth
            if (
                _traceml_compiling()
                or _traceml_depth
                or self is not _traceml_target.obj()
                or (_traceml_inside is not None and _traceml_inside.depth)
            ):
                return _traceml_call(self, *args, **kwargs)
            _traceml_depth = 1
            start = _traceml_clock()
            try:
                return _traceml_call(self, *args, **kwargs)
            finally:
                _traceml_depth = 0
                _traceml_log((_traceml_door, start, _traceml_clock()))

        return forward

    undo = class_doors.weak_door_on_class(module, "forward", make)
    if undo is not None:
        return undo
    return _wrap_forward_once_on_instance(module, clock, log, door, inside, compiling)


def _wrap_forward_once_on_instance(
    module: Any,
    clock: Callable[[], int],
    log: Callable[[Any], Any],
    door: str,
    inside: Any,
    compiling: Callable[[], bool],
) -> Callable[[], None]:
    """:func:`wrap_forward_once` where the door cannot be on the class."""
    module_ref = weakref.ref(module)
    previous, function = _untimed_call(module)
    depth = 0  # 1 inside the outermost call; 2 or 1 for good after the undo (see disarm)

    def timed_forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal depth
        if compiling() or depth or (inside is not None and inside.depth):
            if previous is not None:
                return previous(*args, **kwargs)
            return function(module_ref(), *args, **kwargs)
        depth = 1
        start = clock()
        try:
            if previous is not None:
                return previous(*args, **kwargs)
            return function(module_ref(), *args, **kwargs)
        finally:
            depth -= 1  # 0, or 1 where the undo came during this call: untimed from now on
            log((door, start, clock()))

    undo = _install_forward(module, timed_forward, previous)

    def disarm_and_undo() -> None:
        nonlocal depth
        depth = 2  # every later call takes the untimed path, which leaves depth alone
        undo()

    return disarm_and_undo


def _install_forward(
    module: Any, timed_forward: Any, previous: Any, name: str = "forward"
) -> Callable[[], None]:
    timed_forward.traceml_previous_forward = previous
    _look_like(timed_forward, getattr(module, name))
    getstate = _getstate_without(module, frozenset())
    module.__dict__["__getstate__"] = getstate
    module.__dict__[name] = timed_forward

    def undo() -> None:
        if module.__dict__.get(name) is timed_forward:  # else the user replaced it: theirs
            if previous is None:
                del module.__dict__[name]
            else:
                module.__dict__[name] = previous
        _remove_getstate(module, getstate)

    return undo


def call_before_method(module: Any, name: str, before: Callable[[], Any]) -> Callable[[], None]:
    """``before()`` at each call of ``module``'s ``name`` method, just before the method runs
    (``before`` must never raise: a guarded entry point, or a function that catches its own
    failures; arguments it needs are bound beforehand, by a ``functools.partial``, whose call
    costs no frame and no ``*args`` call); the undo. A door on the class, or an instance-level
    attribute that no copy of the module carries, as the forward's. Only where
    :func:`can_wrap_forward` says so for ``name``."""
    _traceml_before = before

    def make(_traceml_call: Any, _traceml_target: Any) -> Any:
        exact = call_before(_traceml_call, _traceml_call, _traceml_target, before)
        if exact is not None:  # the method's own parameters: nothing packed and passed on
            return exact

        def door(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self is _traceml_target.obj():
                _traceml_before()
            return _traceml_call(self, *args, **kwargs)

        return door

    undo = class_doors.weak_door_on_class(module, name, make)
    if undo is not None:
        return undo
    module_ref = weakref.ref(module)
    previous, function = _untimed_call(module, name)
    if previous is not None:

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before()
            return previous(*args, **kwargs)

    else:

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before()
            return function(module_ref(), *args, **kwargs)

    return _install_forward(module, wrapper, previous, name)


def _look_like(timed_forward: Any, untimed: Any) -> None:
    """What code that inspects ``model.forward`` reads: its name, docstring and signature (the
    bound one, without ``self``: Hugging Face and Lightning read forward's parameters). Not
    ``__wrapped__``: it would hold the bound method, and so the module, from its own dict."""
    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        try:
            setattr(timed_forward, name, getattr(untimed, name))
        except (AttributeError, TypeError):
            pass
    try:
        timed_forward.__signature__ = inspect.signature(untimed)
    except (TypeError, ValueError):
        pass


def _remove_getstate(module: Any, getstate: Any) -> None:
    getstate.traceml_active = False
    if module.__dict__.get("__getstate__") is getstate:
        previous = getstate.traceml_previous
        while getattr(previous, "traceml_active", True) is False:  # undone out of order
            previous = previous.traceml_previous
        if previous is None:
            del module.__dict__["__getstate__"]
        else:
            module.__dict__["__getstate__"] = previous


def _getstate_without(module: Any, ours: frozenset[int]) -> Any:
    # A weak reference: a closure holding the module would keep it alive past the user's last
    # reference to it (a cycle through its own __dict__).
    module_ref = weakref.ref(module)
    previous = module.__dict__.get("__getstate__")  # another traced training's, or the user's

    def __getstate__() -> Any:
        owner = module_ref()
        # The user's (or the class's) own state first: what it raises reaches the user as is.
        state = previous() if previous is not None else type(owner).__getstate__(owner)
        try:
            return _without_traceml(state, ours)
        except Exception:  # never make pickling fail where it would not have untraced
            return state

    __getstate__.traceml_previous = previous  # type: ignore[attr-defined]
    __getstate__.traceml_active = True  # type: ignore[attr-defined]
    return __getstate__


def _without_traceml(state: Any, ours: frozenset[int]) -> Any:
    """``state`` as it would be untraced: no traceml hook entries, no traceml ``__getstate__``."""
    if not isinstance(state, dict):
        return state
    state = dict(state)
    for name in _WRAPPED_NAMES:
        wrapper = state.get(name)
        if not hasattr(wrapper, "traceml_previous_forward"):
            continue
        while hasattr(wrapper, "traceml_previous_forward"):  # traceml's, maybe more than one
            wrapper = wrapper.traceml_previous_forward
        if wrapper is None:
            del state[name]
        else:
            state[name] = wrapper
    untraced = _untraced(state.get("__getstate__"))
    if untraced is None:
        state.pop("__getstate__", None)
    else:
        state["__getstate__"] = untraced
    for name in _HOOK_DICTS:
        hooks = state.get(name)
        if isinstance(hooks, dict) and not ours.isdisjoint(hooks):
            state[name] = type(hooks)((k, v) for k, v in hooks.items() if k not in ours)
    return state


def _untraced(getstate: Any) -> Any:
    """The instance ``__getstate__`` the module would have untraced (usually none)."""
    while getstate is not None and hasattr(getstate, "traceml_previous"):
        getstate = getstate.traceml_previous
    return getstate
