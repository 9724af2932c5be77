"""Standard output and error that cannot change an exit code.

``traceml compare ... | head -20`` closes the pipe after 20 lines; the next write raises
``BrokenPipeError``, and an unguarded ``sys.stdout.write`` would end the command with a
traceback and exit code 1, which a CI gate reads as "regression". Python also sets exit code 120
when flushing stdout fails at interpreter exit. So for the length of a command, ``sys.stdout``
and ``sys.stderr`` are wrapped: a write or flush that fails marks the stream broken, points its
file descriptor at /dev/null (so the interpreter's own final flush succeeds), and every later
write is dropped. The command's exit code is the one it decided.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

# What a write to a reader that went away, a closed descriptor or a closed file raises.
_WRITE_FAILURES = (OSError, ValueError)


class GuardedStream:
    """A text stream whose writes never raise; ``broken`` once one failed."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.broken = stream is None

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except _WRITE_FAILURES:
                self._give_up()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except _WRITE_FAILURES:
                self._give_up()

    def fileno(self) -> int:
        if self._stream is None:
            raise OSError("no stream")
        return self._stream.fileno()

    def isatty(self) -> bool:
        try:
            return not self.broken and bool(self._stream.isatty())
        except _WRITE_FAILURES:
            return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _give_up(self) -> None:
        self.broken = True
        with contextlib.suppress(AttributeError, OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)


@contextlib.contextmanager
def guarded_std_streams() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` guarded for the block; flushed and restored after."""
    saved = sys.stdout, sys.stderr
    out, err = GuardedStream(sys.stdout), GuardedStream(sys.stderr)
    sys.stdout, sys.stderr = out, err  # type: ignore[assignment]
    try:
        yield
    finally:
        out.flush()
        err.flush()
        sys.stdout, sys.stderr = saved
