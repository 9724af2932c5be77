"""Everything traceml says on the terminal goes through here: one line, prefixed, to stderr.

Warnings are shown once per key, and by default only on global rank 0 (or when the rank is
not known yet), so a 64-rank job prints one line, not 64.
"""

from __future__ import annotations

import _thread
import sys

PREFIX = "traceml: "

_lock = _thread.allocate_lock()
_seen: set[str] = set()
_rank: int | None = None


def set_rank(rank: int | None) -> None:
    """Record this process's global rank once it is known (Lightning setup)."""
    global _rank
    _rank = rank


def _current_rank() -> int | None:
    if _rank is not None:
        return _rank
    from traceml.settings import distributed_env

    return distributed_env().rank


def warn(message: str, *, key: str | None = None, all_ranks: bool = False) -> bool:
    """Print ``traceml: <message>`` to stderr once per ``key`` (default: the message).

    Returns whether the line was printed.
    """
    if not all_ranks and (_current_rank() or 0) != 0:
        return False
    with _lock:
        marker = key or message
        if marker in _seen:
            return False
        _seen.add(marker)
    return say(PREFIX + message.replace("\n", " "))


def say(line: str) -> bool:
    """Write ``line`` and its newline to stderr in one write call.

    ``print`` writes the text and the newline separately, and with ``PYTHONUNBUFFERED`` (set by
    many CI runners and job schedulers) each becomes its own system call: two ranks sharing one
    stderr pipe then run their lines together. One call of a line this short is one atomic
    pipe write.
    """
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:
        return False
    return True


def reset_for_tests() -> None:
    global _rank
    with _lock:
        _seen.clear()
    _rank = None
