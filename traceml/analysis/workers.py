"""Worker processes for the reducer's parallel parts (``--jobs``).

Each worker has a pipe of its own to the parent and no thread stands between them, so no way
of ending can leave anything waiting: a worker that dies (the OOM killer) closes its end, which
the parent reads as the pipe's end at once; when the caller stops (an interrupt, a failure, a
result it did not read) the workers are terminated and their pipes closed. With
``concurrent.futures.ProcessPoolExecutor`` a worker stopped while it sent a result left half a
message in the pool's one result pipe, and the pool's thread, then ``traceml report`` itself,
waited for the rest forever (a refused rank file with ``--jobs 2``: 16 hangs in 20; Ctrl-C: 2
in 12; helper review).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

from traceml.errors import OutputError


class WorkerDied(OutputError):
    """A worker process of the reduction was killed (the OOM killer, a signal)."""


_DIED = (
    "a worker process of the reduction died (killed; out of memory?): each holds one rank's "
    "steps, so run it again with fewer --jobs (--jobs 1: none)"
)


def _serve(tasks: Connection, function: Callable[..., Any]) -> None:
    """A worker: ``(index, arguments)`` in, ``(index, True, result)`` or ``(index, False,
    exception)`` out, until None or the pipe's end."""
    # Ctrl-C reaches the terminal's whole process group: the parent stops the work and says so
    # in one line, and each worker would otherwise print a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            task = tasks.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        index, arguments = task
        try:
            reply = (index, True, function(*arguments))
        except Exception as exc:
            reply = (index, False, exc)
        try:
            tasks.send(reply)
        except OSError:  # the parent is gone (killed): nobody to tell, nothing to print
            return
        except Exception as exc:  # an exception (or a result) that does not pickle
            with contextlib.suppress(OSError):  # (gone: the next recv ends the loop)
                tasks.send((index, False, RuntimeError(f"{type(exc).__name__}: {exc}")))


def pool_map(jobs: int, function: Callable[..., Any], *arguments: Iterable[Any]) -> Iterator[Any]:
    """``map(function, *arguments)`` over at most ``jobs`` worker processes, in order; an
    exception of ``function``'s is raised here as it was raised there. A worker that dies
    raises :class:`WorkerDied` here at once."""
    tasks = list(zip(*arguments, strict=True))
    if not tasks:
        return
    context = multiprocessing.get_context()
    pipes: dict[Connection, Any] = {}  # the parent's end -> its worker
    finished = False
    try:
        for _ in range(min(jobs, len(tasks))):
            here, there = context.Pipe()
            worker = context.Process(target=_serve, args=(there, function), daemon=True)
            worker.start()
            there.close()  # the worker's end is the worker's alone: its death ends the pipe
            pipes[here] = worker
        given = 0
        for pipe in pipes:
            pipe.send((given, tasks[given]))
            given += 1
        done: dict[int, tuple[bool, Any]] = {}
        for wanted in range(len(tasks)):
            while wanted not in done:
                for pipe in wait(list(pipes)):
                    try:
                        index, ok, value = pipe.recv()  # type: ignore[union-attr]
                    except (EOFError, OSError):
                        raise WorkerDied(_DIED) from None
                    done[index] = (ok, value)
                    if given < len(tasks):
                        pipe.send((given, tasks[given]))  # type: ignore[union-attr]
                        given += 1
            ok, value = done.pop(wanted)
            if not ok:
                raise value
            yield value
        for pipe in pipes:
            pipe.send(None)
        finished = True
    finally:
        _stop(pipes, finished)


def _stop(pipes: dict[Connection, Any], finished: bool) -> None:
    """Every worker ended and every pipe closed: a worker with nothing left to do ends on its
    own; where the caller stopped early, work in flight is not waited for."""
    for pipe, worker in pipes.items():
        if not finished:
            worker.terminate()
        worker.join()
        pipe.close()
