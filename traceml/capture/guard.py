"""Never break the user's training, by construction: every place user code calls into traceml.

Training code reaches traceml through a few doors: Lightning's callback hooks, the module
forward hooks, the DataLoader-fetch and batch-transfer wrappers, the collective and DDP-hook
wrappers, the import hooks, ``init()`` and the exit handler. Each door is a function decorated
with :func:`entry_point`, which

* registers its name in :data:`ENTRY_POINTS` (the fault-injection suite enumerates them, and a
  test fails when a door exists that is not registered);
* catches every exception raised inside traceml's part of the call, hands it to the owner's
  ``_entry_failed(name, exc)`` (the owner turns tracing off for the process with one warning
  naming the door) and returns ``default``, so the user's values pass through untouched;
* adds the time spent inside to the owner's ``own_cost_ns``, when the owner keeps one (the
  per-step "traceml's own cost" figure).

One mechanism for every place that sits between the user's call and the user's code (the
``Trainer.fit`` wrapper, the fetch and transfer wrappers, the collective wrappers, the
DataLoader's iterator and fetcher, the import finder, loader and hook runner): the wrapper
never calls the user's function inside a guarded function. It calls a guarded "before" and a
guarded "after" (an :func:`entry_point`, or :func:`guarded_call` for a door registered by name)
around the delegation, so a failure in traceml's part still runs the user's code exactly once
and the user's exceptions reach the user unchanged. The fault-injection suite breaks each one.

``TRACEML_FAULT_INJECT=<entry point>`` (tests only) makes that door raise, to prove the above.
"""

from __future__ import annotations

import _thread
import functools

from traceml import console
from traceml.capture.clock import clock_ns

# typing costs ~8 ms to import at start-up; annotations are strings (PEP 563) anyway.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


# name -> one line saying what calls it.
ENTRY_POINTS: dict[str, str] = {}


class _PerThread(_thread._local):
    """How many entry points this thread is inside (nested calls are counted once, by the
    outermost). Per thread: a sampler or checkpoint thread entering traceml while the training
    thread is inside an entry point must not hide either one's cost."""

    depth = 0


_here = _PerThread()
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


def entry_point(name: str, what: str, *, default: Any = None, owner_arg: int = 0) -> Callable:
    """Decorate a function that training code calls into traceml (see the module docstring).

    ``owner_arg``: the positional argument that owns the failure and the cost (``self`` for a
    method); -1 for a plain function, whose failure only warns (the process-wide fallback).
    """
    if name in ENTRY_POINTS:
        raise ValueError(f"entry point {name!r} registered twice")
    ENTRY_POINTS[name] = what

    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            owner = args[owner_arg] if owner_arg >= 0 and len(args) > owner_arg else None
            start = clock_ns()
            here = _here
            here.depth += 1
            try:
                if _inject == name:
                    raise InjectedFault(f"fault injected into {name}")
                return function(*args, **kwargs)
            except Exception as exc:
                failed(owner, name, exc)
                return default
            finally:
                here.depth -= 1
                # An entry point called from inside another is already in the outer's time.
                if owner is not None and not here.depth:
                    try:
                        owner.own_cost_ns += clock_ns() - start
                    except Exception:
                        pass

        guarded.traceml_entry_point = name  # type: ignore[attr-defined]
        return guarded

    return decorate


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
