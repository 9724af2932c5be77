"""A door on one object's method, set on the object's class for the traced training.

Why not on the instance: on CPython 3.11 and later, an object keeps its attribute values
inline, and the interpreter's specialized method loads (``self.strategy.backward(...)``) hold
only while the object has no ``__dict__`` of its own made. A new instance attribute (beyond
what its class's shared keys hold), a read of ``obj.__dict__`` or a ``__class__`` assignment
makes one, and from then on every method load on that object takes the generic lookup.
Lightning loads the strategy's and the data fetcher's methods ~80 times a batch: instance-level
wrappers there cost ~40,000 instructions a batch on the stress loop (callgrind, with every
door taken away again: more than the doors themselves), and those objects never recover.

So the door is set on the object's own class while the training is traced, and every other
instance of that class goes straight through (one identity check). Where that cannot be done
(the object has an attribute of that name of its own, the class's is not a plain function, the
class takes no attributes), the door is an instance attribute, as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from inspect import CO_VARARGS, CO_VARKEYWORDS
from types import FunctionType, MethodType
from typing import Any

Door = Callable[..., Any]  # door(self, *args, **kwargs)


class Target:
    """The one object a door times (``target.obj``). The undo sets it to None (a weak door's:
    to a function that returns None): a door that must stay on its class (another patch
    stacked on it, taken away out of order) then times nothing and keeps nothing alive."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj


def door_on_class(
    owner: Any,
    name: str,
    make: Callable[[Callable[..., Any], Target], Door],
    on_instance: bool = True,
) -> Callable[[], None]:
    """Time ``owner.<name>`` with ``make(call, target)``: a function ``door(self, *args,
    **kwargs)`` that runs ``call(self, *args, **kwargs)`` (the untimed method) exactly once
    and must time only ``self is target.obj`` (``owner`` until the undo). Set on
    ``type(owner)`` where it can be, else on the instance (``on_instance=False``: a TypeError
    instead; a special method such as ``__next__`` is read from the class only). Returns the
    undo."""
    cls, target = type(owner), Target(owner)
    original = getattr(cls, name, None)
    bound = getattr(owner, name)
    if (
        isinstance(original, FunctionType)
        and isinstance(bound, MethodType)
        and bound.__func__ is original  # else the instance has its own attribute
        and bound.__self__ is owner
    ):
        door = make(original, target)
        look_like(door, original)
        missing = object()
        previous = cls.__dict__.get(name, missing)  # a mappingproxy: nothing made
        try:
            setattr(cls, name, door)
        except (TypeError, AttributeError):  # a class that takes no attributes
            pass
        else:

            def undo() -> None:
                target.obj = None
                if cls.__dict__.get(name) is door:  # else someone replaced it since: theirs
                    if previous is missing:
                        delattr(cls, name)
                    else:
                        setattr(cls, name, previous)

            return undo
    if not on_instance:
        raise TypeError(f"{cls.__name__}.{name} cannot be timed on its class")

    def call(_self: Any, *args: Any, **kwargs: Any) -> Any:
        return bound(*args, **kwargs)

    restore = set_instance_attribute(owner, name, MethodType(make(call, target), owner))

    def undo_on_instance() -> None:
        target.obj = None
        restore()

    return undo_on_instance


def set_instance_attribute(owner: Any, name: str, wrapper: Any) -> Callable[[], None]:
    """``owner.<name> = wrapper`` on this instance; the undo puts back what the instance had
    (its own attribute, if someone set one, else none) unless the attribute changed since."""
    missing = object()
    previous = owner.__dict__.get(name, missing)
    setattr(owner, name, wrapper)

    def restore() -> None:
        if owner.__dict__.get(name) is wrapper:
            if previous is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)

    return restore


def look_like(door: Door, original: Any) -> None:
    """What code that inspects the class's method reads: its name, module and docstring, and
    ``__wrapped__`` (``inspect.signature`` and Lightning's ``is_overridden`` follow it)."""
    for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
        value = getattr(original, attribute, None)
        if value is not None:
            setattr(door, attribute, value)
    door.__wrapped__ = original


def parameters(function: Any) -> tuple[tuple[str, ...], int] | None:
    """A plain function's named parameters (all positional-or-keyword) and its ``rest``:
    ``*args`` (1), ``**kwargs`` (2), both (3) or neither (0); None for anything else (not a
    plain function, keyword-only or positional-only parameters). What a door with the same
    signature needs to know (``takes``; ``exact_doors``)."""
    code = getattr(function, "__code__", None)
    if not isinstance(function, FunctionType) or code is None:
        return None
    if code.co_kwonlyargcount or code.co_posonlyargcount:
        return None
    rest = (1 if code.co_flags & CO_VARARGS else 0) + (2 if code.co_flags & CO_VARKEYWORDS else 0)
    return code.co_varnames[: code.co_argcount], rest


def takes(function: Any, names: tuple[str, ...], defaults: Any, rest: int = 0) -> bool:
    """Whether ``function``'s :func:`parameters` are exactly ``names`` and ``rest``, with
    ``defaults``: Lightning's own strategy methods. A door with the same signature then calls
    it without passing ``*args, **kwargs`` on (a tuple and a dict made again for each call,
    ~0.2-0.4 us a step a door); any other (an override) gets the door that passes everything
    on."""
    return parameters(function) == (names, rest) and _same_defaults(function.__defaults__, defaults)


def _same_defaults(theirs: Any, ours: Any) -> bool:
    """Equal and of the same types (``(None, False) == (None, 0)`` is not the same default)."""
    if theirs is None or ours is None:
        return theirs is ours
    return theirs == ours and [type(x) for x in theirs] == [type(x) for x in ours]


def _nobody() -> None:
    """What a class door's target becomes at its undo: it times no object from then on."""
    return None


# Classes whose instances are everywhere in a process (torch's containers, Hugging Face's and
# Lightning's own): a door on one of them would put traceml's frame in every instance's call.
_SHARED_PACKAGES = frozenset(
    {
        "torch",
        "torchvision",
        "torchaudio",
        "transformers",
        "timm",
        "accelerate",
        "lightning",
        "pytorch_lightning",
    }
)


# The weak doors on classes now (class, name, door): what an export lifts (lifted()).
_live: list[tuple[type, str, FunctionType]] = []


def lifted() -> list[tuple[type, str, FunctionType]]:
    """Every weak door off its class, its previous function back (``torch.export`` records
    the source of each frame it runs through, and the program would name traceml's file);
    :func:`put_back` sets them again."""
    taken = []
    for cls, name, door in list(_live):
        if cls.__dict__.get(name) is door:
            setattr(cls, name, door.traceml_previous)  # type: ignore[attr-defined]
            taken.append((cls, name, door))
    return taken


def put_back(taken: list[tuple[type, str, FunctionType]]) -> None:
    for cls, name, door in reversed(taken):
        if cls.__dict__.get(name) is door.traceml_previous:  # type: ignore[attr-defined]
            setattr(cls, name, door)


def weak_door_on_class(module: Any, name: str, make: Any) -> Callable[[], None] | None:
    """``make(call, target)``'s door set on ``module``'s class, timing ``module`` only (``self
    is target.obj()``, a weak reference: the class keeps no module alive); the undo, or None
    where the door is not to be on the class: then the caller sets it on the instance. That is
    where the class does not define ``name`` itself as a plain function (a door on a subclass
    would carry its base's ``__qualname__``), the module has its own ``name``, the class comes
    from a package whose classes are everywhere (``_SHARED_PACKAGES``), or it takes no
    attributes.

    On the class, ``module.<name>`` stays what it is untraced: a bound method of the module
    (``__self__``, ``inspect.ismethod``, pickling it, ``inspect.getsource`` through
    ``__wrapped__``, its annotations), nothing is added to the module's ``__dict__``, and
    ``torch.jit.script`` compiles the user's source, its names resolved in the globals of the
    user's module (:func:`_rehomed`)."""
    cls = type(module)
    original = cls.__dict__.get(name)
    if not isinstance(original, FunctionType) or name in module.__dict__:
        return None
    if str(getattr(cls, "__module__", "")).split(".")[0] in _SHARED_PACKAGES:
        return None
    bound = getattr(module, name, None)
    if not isinstance(bound, MethodType) or bound.__func__ is not original:
        return None
    try:
        target = Target(weakref.ref(module))
    except TypeError:  # no weak references to it
        return None
    door = _rehomed(make(original, target), original)
    look_like(door, original)
    for key, value in vars(original).items():  # torch.jit's markers (@torch.jit.ignore, ...)
        door.__dict__.setdefault(key, value)
    door.__annotations__ = dict(original.__annotations__)  # typing.get_type_hints reads them
    door.traceml_target = target
    door.traceml_previous = original
    try:
        setattr(cls, name, door)
    except (TypeError, AttributeError):
        return None
    live = (cls, name, door)
    _live.append(live)

    def undo() -> None:
        if live in _live:
            _live.remove(live)
        target.obj = _nobody  # a bound door the user kept runs untimed from now on
        if cls.__dict__.get(name) is door:  # else someone replaced it since: theirs
            restored = original
            while getattr(restored, "traceml_target", None) is not None:  # traceml's doors
                if restored.traceml_target.obj is not _nobody:  # still on: it stays
                    break
                restored = restored.traceml_previous  # undone out of order: skipped
            setattr(cls, name, restored)

    return undo


def _rehomed(door: FunctionType, original: FunctionType) -> FunctionType:
    """``door`` with the globals of ``original``'s module. ``torch.jit.script`` compiles the
    source it finds through ``__wrapped__`` (the user's method) but resolves its names in the
    globals and closure of the function it was given (the door): so the door reads no global
    of its own, and its closure's names start with ``_traceml_`` (no user name is hidden)."""
    rehomed = FunctionType(
        door.__code__, original.__globals__, door.__name__, door.__defaults__, door.__closure__
    )
    rehomed.__kwdefaults__ = door.__kwdefaults__
    return rehomed
