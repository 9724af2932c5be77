"""Reading a run directory while it is written: one rank file (:class:`RankTail`: offsets,
only appended bytes, a partly written last line kept for the next read), then the whole run
(:class:`RunFollower`: rank files that appear late, a rank that died, the launcher's end)."""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from traceml import schema
from traceml.analysis.clean import is_number, is_world_size
from traceml.analysis.reduce import list_rank_files, parse_lines
from traceml.present.live_settings import DEFAULT_WINDOW

# A rank file whose backlog is larger than this is not read whole: the reader takes the head
# (header, first step) and the last _TAIL_BYTES, which hold far more lines than a window (a
# step line is ~0.6 KB), so catching up on a day-old run costs the same as on a new one.
_TAIL_BYTES = 512 * 1024
_HEAD_BYTES = 64 * 1024
# A "line" this long without a newline is not a record being written: drop it.
_MAX_PENDING = 1024 * 1024
# A rank file that has not grown for this long, whose process is gone, is a dead rank; a
# rank file still absent this long after every other rank ended will never come.
_DEAD_AFTER_S = 5.0
# A rank whose process this host cannot check (another node's, a file with no header): this
# long without a write to its file, it is taken as ended. A rank writes with its steps, so a
# validation or a checkpoint longer than this ends a watch early (the run goes on); logs
# copied from elsewhere are old at once.
_UNCHECKED_AFTER_S = 600.0


@dataclass
class RankTail:
    """What has been read of one rank file so far, and its most recent steps."""

    rank: int
    path: Path
    window: int = DEFAULT_WINDOW
    offset: int = 0  # bytes of the file consumed (up to the end of the last complete line)
    pending: bytes = b""  # the start of a line whose newline has not been written yet
    header: dict[str, Any] | None = None
    footer: dict[str, Any] | None = None
    steps: int = 0  # steps the rank has recorded (from the records' own step index)
    first_t_ms: float | None = None  # start of the rank's first step, on its own clock
    last_end_ms: float | None = None  # end of its latest step
    bad_lines: int = 0
    recent: deque[dict[str, Any]] = field(default_factory=deque)
    grown_at: float | None = None  # monotonic time the file last grew (set by the follower)
    inode: int | None = None  # the file's identity: another inode is a rewritten file
    # Its first line as first read (the header: a run's own pid and start time): another
    # first line is a file truncated and written again in place, past the old offset by now.
    head: bytes = b""
    dead: bool = False  # its process is gone and it never wrote a footer
    old_at_start: bool = False  # unwritten for _UNCHECKED_AFTER_S when first seen (copied logs)

    def __post_init__(self) -> None:
        self.recent = deque(self.recent, maxlen=self.window)

    @property
    def closed(self) -> bool:
        return self.footer is not None

    def feed(self, data: bytes) -> int:
        """Consume appended bytes; returns how many complete records they finished."""
        if not data:
            return 0
        data = self.pending + data
        cut = data.rfind(b"\n")
        if cut < 0:
            self.pending = data if len(data) <= _MAX_PENDING else b""
            if len(data) > _MAX_PENDING:
                self.bad_lines += 1
            return 0
        self.pending = data[cut + 1 :]
        lines = [line for line in data[:cut].split(b"\n") if line.strip()]
        for record in parse_lines(lines):
            if record is None:
                self.bad_lines += 1
            else:
                self._take(record)
        return len(lines)

    def _take(self, record: dict[str, Any]) -> None:
        kind = record.get(schema.KIND)
        if kind == schema.KIND_STEP:
            self._take_step(record)
        elif kind == schema.KIND_HEADER and self.header is None:
            self.header = record
        elif kind == schema.KIND_FOOTER:
            self.footer = record

    def _take_step(self, record: dict[str, Any]) -> None:
        start, length = record.get(schema.T_START_MS), record.get(schema.STEP)
        # A damaged time would break the clock and rate arithmetic below: skip the line, as
        # `traceml report` does with any value that is not a number.
        if (start is not None and not is_number(start)) or (
            length is not None and not (is_number(length) and length >= 0)
        ):
            self.bad_lines += 1
            return
        index = record.get(schema.STEP_INDEX)
        valid_index = type(index) is int and 0 <= index < 1 << 62
        self.steps = index + 1 if valid_index else self.steps + 1
        if start is not None:
            if self.first_t_ms is None:
                self.first_t_ms = float(start)
            self.last_end_ms = float(start) + float(length or 0.0)
        self.recent.append(record)


class RunFollower:
    """Follows every ``ranks/rank_<R>.jsonl`` of a run directory, reading only what was appended.

    ``poll()`` costs a directory listing plus one ``stat`` per rank, and reads only new bytes
    (at most a head and a tail of a large backlog); memory is the window per rank.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        window: int = DEFAULT_WINDOW,
        clock: Callable[[], float] = time.monotonic,
        is_process_gone: Callable[[dict[str, Any]], bool | None] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.window = window
        self.ranks: dict[int, RankTail] = {}
        self.bytes_read = 0
        self._clock = clock
        self._is_process_gone = is_process_gone or process_gone
        self._manifest_mtime: float | None = None
        self._changed_at = clock()  # when a poll last found anything new
        self.launcher_ended = False

    def poll(self) -> bool:
        """Read what the ranks appended since the last poll. Returns whether anything changed."""
        changed = False
        now = self._clock()
        for rank, path in list_rank_files(self.run_dir).items():
            changed = self._poll_rank(rank, path, now) or changed
        changed = self._check_manifest() or changed
        if changed:
            self._changed_at = now
        return changed

    def _poll_rank(self, rank: int, path: Path, now: float) -> bool:
        tail = self.ranks.get(rank)
        try:
            stat = os.stat(path)
        except OSError:
            stat = None
        rewritten = (
            tail is not None
            and stat is not None
            and (stat.st_size < tail.offset or stat.st_ino != tail.inode)
        )
        if tail is None or rewritten:
            # New, or truncated / replaced (a run restarted into the same directory): what was
            # read belongs to the old file, so start over and let the new header replace it.
            tail = self.ranks[rank] = RankTail(rank=rank, path=path, window=self.window)
            tail.grown_at = now
            tail.old_at_start = stat is not None and _unwritten_for(stat.st_mtime)
            changed = True
        else:
            changed = False
        if stat is None:
            return changed
        tail.inode = stat.st_ino
        if stat.st_size > tail.offset:
            tail.grown_at, tail.dead = now, False  # (one taken as ended that writes again)
            read = self._read(tail, stat.st_size)
            if read is None:  # rewritten in place: start over, as for a replaced file
                tail = self.ranks[rank] = RankTail(rank=rank, path=path, window=self.window)
                tail.grown_at, tail.inode = now, stat.st_ino
                return self._read(tail, stat.st_size) is not False
            return read or changed
        if self._has_died(tail, now, stat.st_mtime):
            tail.dead = True
            return True
        return changed

    def _has_died(self, tail: RankTail, now: float, mtime: float) -> bool:
        """No footer, no growth for a while, and its process is gone (checked only then); or,
        where its process cannot be checked from here (another host's), its file left
        unwritten for _UNCHECKED_AFTER_S (logs copied from a cluster: at once)."""
        if tail.closed or tail.dead:
            return False
        if now - (tail.grown_at or now) < _DEAD_AFTER_S:
            return False
        gone = self._is_process_gone(tail.header) if tail.header is not None else None
        if gone is not None:
            return gone
        # (No header: a rank in its set-up, which may be long, unless the file was old already
        # when first seen.)
        return _unwritten_for(mtime) and (tail.header is not None or tail.old_at_start)

    def _read(self, tail: RankTail, size: int) -> bool | None:
        """Read what the file gained; None where its head is no longer what was read."""
        try:
            with open(tail.path, "rb") as handle:
                if tail.head:
                    if handle.read(len(tail.head)) != tail.head:
                        return None
                else:  # the header line, once written whole (its pid and start time)
                    first = handle.read(_HEAD_BYTES)
                    cut = first.find(b"\n")
                    tail.head = first[: cut + 1] if cut >= 0 else b""
                handle.seek(0)
                backlog = size - tail.offset
                if tail.offset == 0 and backlog > _HEAD_BYTES + 2 * _TAIL_BYTES:
                    # The header and the first step (the start of the rank's clock) are at the
                    # head; the rest of a long backlog is older than any window.
                    head = handle.read(_HEAD_BYTES)
                    self.bytes_read += len(head)
                    tail.feed(head[: head.rfind(b"\n") + 1])
                    tail.offset = _HEAD_BYTES
                    backlog = size - tail.offset
                if backlog > 2 * _TAIL_BYTES:
                    handle.seek(size - _TAIL_BYTES)
                    data = handle.read(_TAIL_BYTES)
                    # The jump lands mid-line: everything up to the first newline is a fragment.
                    data = data[data.find(b"\n") + 1 :]
                    tail.pending = b""
                    tail.offset = size
                    self.bytes_read += _TAIL_BYTES
                else:
                    handle.seek(tail.offset)
                    data = handle.read(backlog)
                    tail.offset += len(data)
                    self.bytes_read += len(data)
        except OSError:
            return False
        tail.feed(data)
        return True

    def _check_manifest(self) -> bool:
        """``traceml run`` records its end in manifest.json: then no rank will write more."""
        path = self.run_dir / schema.MANIFEST_JSON
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            return False
        if mtime == self._manifest_mtime:
            return False
        self._manifest_mtime = mtime
        try:
            manifest = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return False
        ended = isinstance(manifest, dict) and manifest.get("ended_at") is not None
        changed = ended and not self.launcher_ended
        self.launcher_ended = self.launcher_ended or ended
        return changed

    def world_size(self) -> int | None:
        sizes = [
            tail.header.get(schema.WORLD_SIZE)
            for tail in self.ranks.values()
            if tail.header is not None and is_world_size(tail.header.get(schema.WORLD_SIZE))
        ]
        return max(sizes) if sizes else None

    def finished(self, world_size: int | None = None) -> bool:
        """Every expected rank has closed its file (or died), or the launcher has ended, or
        every rank file there has ended and nothing changed for a while (a rank that never
        created its file is not coming: `traceml report` calls such a run partial)."""
        if self.launcher_ended:
            return True
        # No believable world size in any header: the rank files there are the run.
        size = world_size or self.world_size() or (max(self.ranks) + 1 if self.ranks else 0)
        if not size:
            return False
        every_file_ended = all(tail.closed or tail.dead for tail in self.ranks.values())
        if every_file_ended and self._clock() - self._changed_at >= _DEAD_AFTER_S:
            return True
        return all(
            rank in self.ranks and (self.ranks[rank].closed or self.ranks[rank].dead)
            for rank in range(size)
        )


def _unwritten_for(mtime: float) -> bool:
    return time.time() - mtime >= _UNCHECKED_AFTER_S


def process_gone(header: dict[str, Any]) -> bool | None:
    """Whether the process that wrote ``header`` has exited; None where this host cannot tell
    (another host's process, no pid)."""
    pid = header.get(schema.PID)
    if not isinstance(pid, int) or header.get(schema.HOST) != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by someone else
        return False
    return False
