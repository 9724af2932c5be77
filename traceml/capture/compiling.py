"""Is torch's compiler tracing this call? traceml's doors and hooks ask it first: inside a
compiled region their clock reads are calls the compiler cannot trace (a graph break, a
recompile on the value read, and a fullgraph compile raised in the user's code), so there
they call straight through."""

from __future__ import annotations

from collections.abc import Callable


def compiler_check() -> Callable[[], bool]:
    """``torch.compiler.is_compiling``: the compiler reads it as True and leaves what it
    guards out of its graph; run natively, it is False. Torch before 2.3 compiles no module
    hooks or doors in place: never."""
    try:
        from torch.compiler import is_compiling
    except ImportError:
        return lambda: False
    return is_compiling
