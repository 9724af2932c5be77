"""Doors on the user's methods with the methods' own parameters, made from source per door.

The generic door, ``door(self, *args, **kwargs)``, passes ``*args, **kwargs`` on: a tuple and
a dict made again at every call, ~0.4 us a step in situ on the stress loop (stop 50's probe,
docs/overhead.md). Where the user's method names its parameters plainly (no ``*args``,
``**kwargs``, keyword-only or positional-only ones), the door takes the same parameters, with
the method's own default objects, and calls the method with them by position: the same call.
Any other method keeps the generic door. Two doors: the one-door forward
(``forward_hooks.wrap_forward_once``) and the call before a method
(``forward_hooks.call_before_method``: the step's end before the module's
``on_train_batch_end``).

The source is a fixed template; only the parameters' names, read from the forward's code object
(identifiers by construction), go into it. Every name of the door's own starts with
``_traceml_`` (``class_doors._rehomed``: torch.jit.script resolves names in the door's globals
and closure), and a forward with a parameter named so keeps the generic door.
"""

from __future__ import annotations

from types import FunctionType
from typing import Any

from traceml.capture.class_doors import parameters

_FORWARD = """
def _traceml_make(
    _traceml_call,
    _traceml_target,
    _traceml_clock,
    _traceml_log,
    _traceml_door,
    _traceml_inside,
    _traceml_compiling,
):
    _traceml_depth = 0

    def forward({params}):
        nonlocal _traceml_depth
        if (
            _traceml_compiling()
            or _traceml_depth
            or {first} is not _traceml_target.obj()
            or (_traceml_inside is not None and _traceml_inside.depth)
        ):
            return _traceml_call({params})
        _traceml_depth = 1
        _traceml_start = _traceml_clock()
        try:
            return _traceml_call({params})
        finally:
            _traceml_depth = 0
            _traceml_log((_traceml_door, _traceml_start, _traceml_clock()))

    return forward
"""

_BEFORE = """
def _traceml_make(_traceml_call, _traceml_target, _traceml_before):
    def door({params}):
        if {first} is _traceml_target.obj():
            _traceml_before()
        return _traceml_call({params})

    return door
"""


def plain_parameters(function: Any) -> tuple[str, ...] | None:
    """The names of ``function``'s parameters where all are positional-or-keyword, else None."""
    found = parameters(function)
    if found is None or found[1]:
        return None
    names = found[0]
    if not names or any(name.startswith("_traceml") for name in names):
        return None
    return names


def one_door_forward(
    original: Any,
    call: Any,
    target: Any,
    clock: Any,
    log: Any,
    door: str,
    inside: Any,
    compiling: Any,
) -> FunctionType | None:
    """``forward_hooks.wrap_forward_once``'s door for ``original``, with its parameters; None
    where it does not name them plainly."""
    return _made(_FORWARD, original, call, target, clock, log, door, inside, compiling)


def call_before(original: Any, call: Any, target: Any, before: Any) -> FunctionType | None:
    """``forward_hooks.call_before_method``'s door for ``original``, with its parameters; None
    where it does not name them plainly."""
    return _made(_BEFORE, original, call, target, before)


def _made(template: str, original: Any, *closure: Any) -> FunctionType | None:
    names = plain_parameters(original)
    if names is None:
        return None
    source = template.format(params=", ".join(names), first=names[0])
    namespace: dict[str, Any] = {}
    exec(compile(source, "<traceml door>", "exec"), namespace)
    door = namespace["_traceml_make"](*closure)
    door.__defaults__ = original.__defaults__
    return door
