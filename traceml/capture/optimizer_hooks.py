"""Taking a global optimizer step hook away, also from inside the step that runs it.

torch runs the global optimizer step hooks by iterating its live ``OrderedDict``s
(``chain(..., _global_optimizer_pre_hooks.values())``), unlike module hooks, which it copies
first: deleting an entry while another one is still to come raises "OrderedDict mutated during
iteration" out of the user's ``optimizer.step()``. traceml takes its hooks away from inside
them (a loop refused at its first step, tracing turned off at an L-BFGS closure, the one-shot
warning about an untraced child): where a hook of someone else's comes after traceml's, the
entry stays, holding a no-op (a value replaced is no mutation to the iterator), which deletes
itself at a later call made when nothing follows it. Deleting the last entry is safe: the
iterator checks the dict only before it yields another.
"""

from __future__ import annotations

import weakref
from typing import Any


def remove_hook(handle: Any, iterating: bool) -> None:
    """``handle.remove()``, safe where torch may be iterating the hook's dict (``iterating``:
    called from inside a hook of that dict)."""
    dict_ref = getattr(handle, "hooks_dict_ref", None)
    if dict_ref is None:  # (a torch whose handles keep their dict otherwise)
        handle.remove()
        return
    hooks, key = dict_ref(), handle.id
    if hooks is None or key not in hooks:
        return
    if iterating and next(reversed(hooks)) != key:
        hooks[key] = _Removed(hooks, key)
    else:
        del hooks[key]


class _Removed:
    """A removed hook's place, kept while torch iterates the dict: does nothing, and goes at a
    call where its key is the dict's last (its deletion then ends no iteration early)."""

    def __init__(self, hooks: Any, key: int) -> None:
        self._hooks = weakref.ref(hooks)
        self._key = key

    def __call__(self, *_: Any, **__: Any) -> None:
        hooks = self._hooks()
        if (
            hooks is not None
            and hooks.get(self._key) is self
            and next(reversed(hooks)) == self._key
        ):
            del hooks[self._key]
