"""Worker processes for the reducer's parallel parts (``--jobs``)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def _ignore_interrupt() -> None:
    # Ctrl-C reaches the terminal's whole process group: the parent stops the work and says so
    # in one line, and each worker would otherwise print a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _Spread:
    """``function(*arguments)`` from one tuple (``imap`` passes one value); picklable."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, arguments: tuple[Any, ...]) -> Any:
        return self.function(*arguments)


def pool_map(jobs: int, function: Callable[..., Any], *arguments: Iterable[Any]) -> Iterator[Any]:
    """``map(function, *arguments)`` over at most ``jobs`` worker processes, in order. The
    workers are stopped when the results are read or the caller stops (an interrupt, a
    failure): work in flight is not waited for."""
    from multiprocessing import Pool

    with Pool(jobs, initializer=_ignore_interrupt) as pool:  # its exit terminates the workers
        yield from pool.imap(_Spread(function), zip(*arguments, strict=True))
