"""Never break the user's training, by construction: every place user code calls into traceml.

Training code reaches traceml through a few doors: Lightning's callback hooks, the forward
wrapper (Lightning) or forward hooks (any loop), the DataLoader-fetch, batch-transfer and
backward wrappers, the collective and DDP-hook wrappers, the import hooks, ``init()`` and the
exit handler. Each door is a function decorated with :func:`entry_point`, which

* registers its name in :data:`ENTRY_POINTS` (the fault-injection suite enumerates them, and a
  test fails when a door exists that is not registered);
* catches every exception raised inside traceml's part of the call, hands it to the owner's
  ``_entry_failed(name, exc)`` (the owner turns tracing off for the process with one warning
  naming the door) and returns ``default``, so the user's values pass through untouched;
* adds the time spent inside to the owner's ``own_cost_ns``, when the owner keeps one (the
  per-step "traceml's own cost" figure).

One mechanism for every place that sits between the user's call and the user's code (the
``Trainer.fit`` wrapper, the fetch, transfer and backward wrappers, the collective wrappers, the
DataLoader's iterator and fetcher, the import finder, loader and hook runner): the wrapper
never calls the user's function inside a guarded function. It calls a guarded "before" and a
guarded "after" (an :func:`entry_point`, or :func:`guarded_call` for a door registered by name)
around the delegation (or only the "after", where the "before" would only read the clock), so
a failure in traceml's part still runs the user's code exactly once and the user's exceptions
reach the user unchanged. The fault-injection suite breaks each one.

``TRACEML_FAULT_INJECT=<entry point>`` (tests only) makes that door raise, to prove the above.
"""

from __future__ import annotations

import _thread
import functools
import sys

from traceml import console
from traceml.capture.clock import clock_ns

# typing costs ~8 ms to import at start-up; annotations are strings (PEP 563) anyway.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


# name -> one line saying what calls it.
ENTRY_POINTS: dict[str, str] = {}


# The threads inside an entry point now (nested calls are counted once, by the outermost). Per
# thread: a sampler or checkpoint thread entering traceml while the training thread is inside
# an entry point must not hide either one's cost. A set of thread idents, not a threading.local:
# the local's attribute access cost ~0.6 us per door, a third of the guard.
_inside: set[int] = set()
_get_ident = _thread.get_ident
# Called when a door with no owner fails (no callback to turn off): turn tracing off for the
# whole process. Filled by whoever activated tracing (traceml.capture.bootstrap), so that this
# module imports nothing of the activation side (no import cycle).
_process_switches: list[Callable[[], None]] = []


def on_unowned_failure(switch_off: Callable[[], None]) -> None:
    """Have ``switch_off()`` called when a door with no owner fails (idempotent)."""
    if switch_off not in _process_switches:
        _process_switches.append(switch_off)


class InjectedFault(RuntimeError):
    """Raised by an entry point named in TRACEML_FAULT_INJECT (tests only)."""


def _injected_point() -> str | None:
    from traceml.settings import fault_injection_point

    return fault_injection_point()


_inject: str | None = _injected_point()


def reload_injection() -> None:
    """Re-read TRACEML_FAULT_INJECT (for tests that set it after import)."""
    global _inject
    _inject = _injected_point()


def entry_point(
    name: str, what: str, *, default: Any = None, owner_arg: int = 0, per_step: bool = False
) -> Callable:
    """Decorate a function that training code calls into traceml (see the module docstring).

    ``owner_arg``: the positional argument that owns the failure and the cost (``self`` for a
    method); -1 for a plain function, whose failure only warns (the process-wide fallback).
    ``per_step``: a door of the training step's hot path that is never entered while its
    thread is inside another door and enters none itself whose owner's cost is part of
    ``traceml_us`` (it would then be counted twice): it skips the per-thread nesting
    bookkeeping.
    """
    if name in ENTRY_POINTS:
        raise ValueError(f"entry point {name!r} registered twice")
    ENTRY_POINTS[name] = what

    def decorate(function: Callable) -> Callable:
        factory = _guarded_factory(function, owner_arg, per_step)
        guarded = factory(function, name, default)
        functools.update_wrapper(guarded, function)
        guarded.traceml_entry_point = name  # type: ignore[attr-defined]
        return guarded

    return decorate


# The guard's body, one per parameter list. Written out with the function's own parameters
# (``self, trainer, pl_module``) rather than ``*args, **kwargs``: packing and unpacking the
# arguments cost ~0.4 us per door, and the hot doors run ~10 times per training step. The
# same text for every entry point; only the parameter list and the owner's name differ.
_BODY = """
def factory(_g_function, _g_name, _g_default):
    def guarded({params}):
        _g_owner = {owner}
        _g_start = _g_clock()
        _g_ident = _g_get_ident()
        _g_outermost = _g_ident not in _g_inside
        if _g_outermost:
            _g_inside.add(_g_ident)
        try:
            if _g_guard._inject == _g_name:
                raise _g_InjectedFault("fault injected into " + _g_name)
            return _g_function({params})
        except Exception as _g_exc:
            _g_failed(_g_owner, _g_name, _g_exc)
            return _g_default
        finally:
            if _g_outermost:
                _g_inside.discard(_g_ident)
                if _g_owner is not None:
                    try:
                        _g_owner.own_cost_ns += _g_clock() - _g_start
                    except Exception:
                        pass
    return guarded
"""
# The same for a per-step door: no nesting bookkeeping (three calls on a set per door, ~0.15 us,
# 5-7 such doors a step). Its cost is counted whole: it is never inside another door and
# enters none (see entry_point's per_step).
_PER_STEP_BODY = """
def factory(_g_function, _g_name, _g_default):
    def guarded({params}):
        _g_owner = {owner}
        _g_start = _g_clock()
        try:
            if _g_guard._inject == _g_name:
                raise _g_InjectedFault("fault injected into " + _g_name)
            return _g_function({params})
        except Exception as _g_exc:
            _g_failed(_g_owner, _g_name, _g_exc)
            return _g_default
        finally:
            if {owner_known}:
                try:
                    _g_owner.own_cost_ns += _g_clock() - _g_start
                except Exception:
                    pass
    return guarded
"""
_factories: dict[tuple[str, str, bool], Callable] = {}


def declare(name: str, what: str) -> str:
    """Register entry point ``name`` that has no guarded callable of its own (a door that
    logs an event, replayed as this entry point: ``step_events``); returns the name."""
    if name in ENTRY_POINTS:
        raise ValueError(f"entry point {name!r} registered twice")
    ENTRY_POINTS[name] = what
    return name


def _factory_namespace() -> dict[str, Any]:
    return {
        "_g_clock": clock_ns,
        "_g_get_ident": _get_ident,
        "_g_inside": _inside,
        "_g_guard": sys.modules[__name__],
        "_g_InjectedFault": InjectedFault,
        "_g_failed": failed,
    }


def _guarded_factory(function: Callable, owner_arg: int, per_step: bool = False) -> Callable:
    """``factory(function, name, default) -> guarded`` for ``function``'s parameter list."""
    code = getattr(function, "__code__", None)
    plain = (
        code is not None
        and not function.__defaults__
        and not function.__kwdefaults__
        and not code.co_kwonlyargcount
        and not code.co_posonlyargcount
        and not code.co_flags & 0x08  # **kwargs
        # the body's own names start with _g_
        and not any(n.startswith("_g_") for n in code.co_varnames[: code.co_argcount + 1])
    )
    # The parameter list, spelled the same in the wrapper's signature and in its call.
    if plain:
        names = list(code.co_varnames[: code.co_argcount])
        rest = ["*" + code.co_varnames[code.co_argcount]] if code.co_flags & 0x04 else []  # *args
        params = ", ".join([*names, *rest])
        owner = names[owner_arg] if 0 <= owner_arg < len(names) else "None"
    else:
        params = "*args, **kwargs"
        owner = "None"
        if owner_arg >= 0:
            owner = f"args[{owner_arg}] if len(args) > {owner_arg} else None"
    key = (params, owner, per_step)
    if key not in _factories:
        namespace = _factory_namespace()
        # A named parameter (``self``) is never None: the check compiles away.
        owner_known = "True" if owner.isidentifier() and owner != "None" else "_g_owner is not None"
        body = (_PER_STEP_BODY if per_step else _BODY).format(
            params=params, owner=owner, owner_known=owner_known
        )
        exec(compile(body, f"<traceml guard ({params})>", "exec"), namespace)
        _factories[key] = namespace["factory"]
    return _factories[key]


def failed(owner: Any, name: str, exc: BaseException, key: str | None = None) -> None:
    """Route a failure inside entry point ``name`` to its owner (or warn, if it has none;
    once per ``key``, default the name)."""
    handler = getattr(owner, "_entry_failed", None)
    if handler is not None:
        try:
            handler(name, exc)
            return
        except Exception:
            pass
    # No owner to turn off (a wrapper, an import hook, init()): turn tracing off for the whole
    # process, as the warning says. Otherwise a later door would trace what this one should
    # have: after rfdetr.build_trainer failed, the plain Trainer.fit hook traced RF-DETR as
    # generic Lightning, past RF-DETR's unsupported-model checks.
    for switch_off in list(_process_switches):
        try:
            switch_off()
        except Exception:
            pass
    try:  # str(exc) runs the exception's own code: it may raise too
        console.warn(
            f"tracing disabled: {name} failed ({type(exc).__name__}: {exc}); "
            "training continues untraced",
            key="guard:" + (key or name),
            all_ranks=True,
        )
    except Exception:
        pass


# Registered by name: traceml.capture.import_hooks calls them through guarded_call.
ENTRY_POINTS["import hook"] = "a post-import hook, when a watched library is imported"
ENTRY_POINTS["import_hooks.runner"] = "taking the hooks of a watched module, once imported"
ENTRY_POINTS["import_hooks.finder"] = "the import finder, chaining a watched module's loader"
ENTRY_POINTS["import_hooks.loader"] = "the chained loader, before the watched module runs"


def guarded_call(name: str, piece: str, function: Callable, *args: Any) -> Any:
    """Call ``function(*args)`` as entry point ``name`` with no owner (a plain function that
    is registered by name rather than decorated: the import-hook runner); ``piece`` names it
    in the warning."""
    try:
        if _inject is not None and _inject == name:
            raise InjectedFault(f"fault injected into {name}")
        return function(*args)
    except Exception as exc:
        # One warning per entry point: after the first failure tracing is off, and the
        # same door failing for the next watched module says nothing new.
        failed(None, piece, exc, key=name)
        return None
