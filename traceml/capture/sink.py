"""Per-rank JSONL writer: one ``os.write`` per record, straight to the kernel.

Records are written with O_APPEND and no user-space buffer, so a rank killed with SIGKILL
leaves every record it finished on disk, and at worst one partial last line (which the
reducer tolerates). Fail-open: an unwritable directory or a full disk turns the sink off with
one warning; callers keep training.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from traceml import console


class SinkError(OSError):
    """The rank file could not be created (exists already, unwritable directory...)."""


class RankSink:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self.failed: str | None = None

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

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def write(self, record: dict[str, Any]) -> bool:
        """Append one record as one line. Returns False (after one warning) when it failed."""
        if self._fd is None:
            return False
        try:
            data = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
            written = os.write(self._fd, data)
            if written != len(data):  # rare for regular files: finish the line
                view = memoryview(data)[written:]
                while view:
                    view = view[os.write(self._fd, view) :]
            return True
        except (OSError, TypeError, ValueError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            self.failed = reason
            self._close_quietly()
            console.warn(
                f"cannot write {self.path} ({reason}); tracing disabled, training continues",
                all_ranks=True,
            )
            return False

    def close(self) -> None:
        self._close_quietly()

    def _close_quietly(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
