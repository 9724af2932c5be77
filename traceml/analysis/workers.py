"""Worker processes for the reducer's parallel parts (``--jobs``)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from traceml.errors import OutputError


class WorkerDied(OutputError):
    """A worker process of the reduction was killed (the OOM killer, a signal)."""


def _ignore_interrupt() -> None:
    # Ctrl-C reaches the terminal's whole process group: the parent stops the work and says so
    # in one line, and each worker would otherwise print a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def pool_map(jobs: int, function: Callable[..., Any], *arguments: Iterable[Any]) -> Iterator[Any]:
    """``map(function, *arguments)`` over at most ``jobs`` worker processes, in order. A
    worker that dies (the OOM killer) raises BrokenProcessPool here at once. When the caller
    stops (an interrupt, a failure, a result it did not read) the work left is cancelled and
    the workers are stopped: work in flight is not waited for, only the pool's own thread
    (left running, its exit handler could find the pool's wake-up pipe closed at the
    interpreter's exit: "Exception ignored ... Bad file descriptor" under the one line)."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    pool = ProcessPoolExecutor(max_workers=jobs, initializer=_ignore_interrupt)
    finished = False
    try:
        yield from pool.map(function, *arguments)
        finished = True
    except BrokenProcessPool:
        raise WorkerDied(
            "a worker process of the reduction died (killed; out of memory?): each holds one "
            "rank's steps, so run it again with fewer --jobs (--jobs 1: none)"
        ) from None
    finally:
        if not finished:
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.terminate()  # (a private table: at worst, in-flight work finishes)
        pool.shutdown(wait=True, cancel_futures=not finished)
