"""Per-rank JSONL writer: step records batched in memory, written by a small flusher thread.

Why batched: one ``os.write`` per step was the largest single item of traceml's per-step cost
on millisecond steps (a system call on a cold cache, every step). Step records and telemetry
samples are queued as they are (``append``; a step as the clock's closed step, whose record is
built on the flusher too: ``closed_step``), and a daemon thread encodes and writes everything
queued, in order and in one ``os.write``, every ``FLUSH_INTERVAL_S``. Encoding on the flusher,
not per step: between two steps the training evicts orjson's code from the CPU caches, and one
``orjson.dumps`` in the training loop measured 9-18 us (first call) against ~1 us for the next
ones; the flusher encodes ~100 records in a row. Headers, events and footers (``write``) go out
at once, after everything queued before them. A queued record must not change afterwards (the
session hands over records it has finished with). With one-door timing a step arrives as its
door events (a tuple, :meth:`RankSink.replay_with`), which the flusher replays into records
where the tuple stood (``step_events``), the usual steps that follow each other as one rows
line (``step_rows``).

The crash guarantee, stated honestly: a rank killed with SIGKILL (or by the OOM killer, or a
signal whose default action ends the process) loses at most the records queued in the last
``FLUSH_INTERVAL_S`` (250 ms), plus the time the flusher waits for the GIL (Python's switch
interval, 5 ms by default). A clean end, an exception, Ctrl-C and Lightning's SIGTERM handling
all reach :meth:`close`, which writes everything. At worst the last line is cut in two (the
reducer tolerates that); when it is a rows line, the steps of that write are lost with it.
A forked child (DataLoader workers) never writes its copy of the queue.

Fail-open: an unwritable directory or a full disk turns the sink off with one warning, from
whichever thread hit it; callers see ``False`` from their next call and keep training. A
queued record that cannot be built or encoded (a traceml bug) is dropped alone: the file stays
open, and ``append`` says ``False`` so that the session turns tracing off with its own note and
footer. No memory-mapped file: a full disk would then be a SIGBUS inside training.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from traceml import console

# How long a finished record may wait in memory before the flusher writes it. A flush has a
# fixed cost of ~0.3 ms on a 2-core VM (its code and data cold after torch's work, the write):
# at 100 ms the flusher took 5.3-6.7 us of a 0.56 ms step, at 250 ms 3.5-4.0 (stop 46).
FLUSH_INTERVAL_S = 0.25
# A queue this long is written by the caller at once (bounds memory if the flusher is starved).
MAX_QUEUED = 1024

_dumps = orjson.dumps
_NEWLINE = orjson.OPT_APPEND_NEWLINE


class SinkError(OSError):
    """The rank file could not be created (exists already, unwritable directory...)."""


class RankSink:
    def __init__(self, path: Path, *, flush_interval_s: float = FLUSH_INTERVAL_S) -> None:
        self.path = Path(path)
        self.flush_interval_s = flush_interval_s
        self._fd: int | None = None
        self.failed: str | None = None
        # Encoded lines (bytes) and records still to encode (dicts), in file order.
        self._queue: collections.deque[Any] = collections.deque()  # bytes, dicts, closed steps
        # One writer at a time (the flusher, or a caller writing at once): lines stay in order.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self._pid = os.getpid()
        # Time the flusher thread spent building, encoding and writing (traceml's own cost,
        # outside every entry point).
        self.write_ns = 0
        # Why a queued record could not be built or encoded (a traceml bug), if one could not:
        # it was dropped, the file stays open for the owner's note and footer, and ``append``
        # says False from then on, so the owner turns tracing off.
        self.bad_record: str | None = None
        self.writes = 0
        # What turns a step's door events (a tuple, :meth:`replay_with`) into records.
        self.on_event: Any = None
        # The owner must act at its next chance: the file failed, a record could not be made,
        # or the event replay asked (a failure, the step limit). One read per step.
        self.halted = False

    def open(self) -> None:
        """Create the rank file; raise :class:`SinkError` with a user-facing reason."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SinkError(f"cannot create {self.path.parent}: {exc.strerror or exc}") from None
        try:
            # O_EXCL: two processes claiming one rank file would interleave two runs.
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        except FileExistsError:
            raise SinkError(
                f"{self.path} already exists (another process or an earlier run wrote it); "
                "choose a new run name"
            ) from None
        except OSError as exc:
            raise SinkError(f"cannot create {self.path}: {exc.strerror or exc}") from None
        self._pid = os.getpid()

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    # -- the two ways in -------------------------------------------------------------------

    def append(self, record: Any) -> bool:
        """Queue one record (steps, samples): a dict, or an object whose ``record()`` makes one
        (a closed step, ``closed_step``); the flusher builds, encodes and writes it within the
        interval. Returns False once the sink is off (it has warned once) or a record could not
        be built or encoded (``bad_record``: the owner says so)."""
        if self._fd is None:
            return False
        queue = self._queue
        queue.append(record)
        if self._flusher is None:
            self._start_flusher()
        elif len(queue) >= MAX_QUEUED:
            self.flush()
        return self._fd is not None and self.bad_record is None

    def replay_with(self, on_event: Any) -> Any:
        """The queue itself, for a step's door events: a tuple of them, appended, that the
        flusher hands to ``on_event`` in file order, which returns None, a record (a dict or a
        closed step) or a list of them. Whoever appends must bound the queue (``MAX_QUEUED``,
        then :meth:`flush`): a bare ``deque.append`` and ``len``, one C call each."""
        self.on_event = on_event
        if self._flusher is None and self._fd is not None:
            self._start_flusher()
        return self._queue

    def write(self, record: dict[str, Any]) -> bool:
        """Write one record now, after everything queued (headers, events, footers).
        Returns False (after one warning) when it failed."""
        if self._fd is None:
            return False
        try:
            data = _dumps(record, option=_NEWLINE)
        except (TypeError, ValueError) as exc:
            self._fail(str(exc))
            return False
        self._queue.append(data)
        return self.flush()

    # -- writing ---------------------------------------------------------------------------

    def flush(self) -> bool:
        """Write everything queued in one system call. False when the sink is off."""
        if os.getpid() != self._pid:
            return False  # a forked child: its copy of the queue is the parent's to write
        with self._lock:
            fd, queue = self._fd, self._queue
            if fd is None:
                queue.clear()
                return False
            if not queue:
                return True
            start = time.perf_counter_ns()
            chunks = []
            # Bound once: the flusher runs this loop ~1,000 times a second on a fast loop.
            popleft, add, encode = queue.popleft, chunks.append, self._encode
            try:
                while queue:  # deque.popleft is atomic: a record appended meanwhile stays queued
                    item = popleft()
                    kind = type(item)
                    if kind is bytes:
                        add(item)
                        continue
                    if kind is tuple:  # a step's door events: their replay never raises
                        item = self.on_event(item, queue)  # read here: replay_with sets it
                        if item is None:
                            continue
                        if type(item) is list:
                            for each in item:
                                encode(each, chunks)
                            continue
                        if isinstance(item, dict):  # the usual step's record: encoded here
                            try:
                                add(_dumps(item, option=_NEWLINE))
                                continue
                            except Exception:
                                pass  # _encode says why
                    encode(item, chunks)
                if chunks:
                    _write_all(fd, chunks[0] if len(chunks) == 1 else b"".join(chunks))
            except OSError as exc:
                self._fail(exc.strerror or str(exc), locked=True)
                return False
            finally:
                # The flusher's time only: a caller's flush runs inside one of its entry points,
                # whose own timer has it already.
                if threading.current_thread() is self._flusher:
                    self.write_ns += time.perf_counter_ns() - start
                self.writes += 1
        return True

    def _encode(self, item: Any, chunks: list[bytes]) -> None:
        try:
            if not isinstance(item, dict):
                item = item.record()  # a closed step (closed_step): built here, warm
            chunks.append(_dumps(item, option=_NEWLINE))
        except Exception as exc:  # a traceml bug: that record only is dropped
            if self.bad_record is None:
                self.bad_record = f"{type(exc).__name__}: {exc}"
            self.halted = True

    def _start_flusher(self) -> None:
        thread = threading.Thread(target=self._flush_every_interval, name="traceml-sink")
        thread.daemon = True  # never keeps the interpreter alive; close() writes the rest
        self._flusher = thread
        thread.start()

    def _flush_every_interval(self) -> None:
        stop, interval = self._stop, self.flush_interval_s
        while not stop.wait(interval):
            if self._queue and not self.flush():
                return
            if self._fd is None:
                return

    # -- the end ---------------------------------------------------------------------------

    def close(self) -> None:
        """Write everything queued and close the file (idempotent)."""
        if os.getpid() != self._pid:
            return  # a forked child: the lock may have been held at the fork; nothing to write
        self._stop.set()
        thread = self._flusher
        if thread is not None and thread is not threading.current_thread() and thread.is_alive():
            thread.join(timeout=5.0)
        if self._fd is not None:
            self.flush()
        with self._lock:
            self._close_quietly()

    def _fail(self, reason: str, *, locked: bool = False) -> None:
        self.failed = reason
        self.halted = True
        if locked:
            self._close_quietly()
        else:
            with self._lock:
                self._close_quietly()
        self._queue.clear()
        self._stop.set()
        console.warn(
            f"cannot write {self.path} ({reason}); tracing disabled, training continues",
            all_ranks=True,
        )

    def _close_quietly(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None and os.getpid() == self._pid:
            try:
                os.close(fd)
            except OSError:
                pass


def _write_all(fd: int, data: bytes) -> None:
    # os.write is looked up on each call (tests replace it to simulate a failing disk).
    written = os.write(fd, data)
    if written != len(data):  # rare for regular files: finish the batch
        view = memoryview(data)[written:]
        while view:
            view = view[os.write(fd, view) :]
