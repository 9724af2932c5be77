"""The input pipeline's counters: one slot per producing process in a small shared map.

Each DataLoader worker (and the main process, slot 0, when ``num_workers=0``) writes its own
slot once per batch; the training process reads every slot once per epoch. Measured
(benchmarks/dataloader_transport.py, 2-core CPU, per batch): the shared map 0.3 us per write,
never blocks and needs nothing read on the other side until the epoch ends; a multiprocessing
queue 0.7 us per put plus a feeder thread in every worker; a per-worker file 0.75 us (a system
call) and files to clean up.

A slot is a sequence lock: the writer makes the sequence number odd, writes the data, then makes
it even again, in three separate writes; a reader accepts a slot only when it read the same even
number before and after the data. (Writing the even number in the same write as the data, first,
let a reader accept a slot whose data was half written.)

Forked workers inherit an anonymous map. Spawned ones (``spawn``, ``forkserver``) inherit
nothing: they open a small file by name, in /dev/shm where it exists. That file is registered
with multiprocessing's resource tracker (the process that spawned workers already run), which
removes it if the training process dies without cleaning up (SIGKILL, the OOM killer); a normal
end removes it at once.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from typing import Any

MAX_WORKERS = 255
SLOT_FIELDS = (
    "pid",
    "samples",
    "batches",
    "getitem_ns",
    "collate_ns",
    "busy_ns",
    "first_start_ns",
    "first_end_ns",
    "last_end_ns",
)
_SEQ = struct.Struct("<q")
_DATA = struct.Struct(f"<{len(SLOT_FIELDS)}q")
_SLOT_SIZE = _SEQ.size + _DATA.size
MAP_SIZE = _SLOT_SIZE * (MAX_WORKERS + 1)
FILE_PREFIX = "traceml-input-"


class ProcessCounters:
    """What this process (a worker, or the main process) has made so far."""

    __slots__ = (
        "batches",
        "collate_ns",
        "first_end_ns",
        "first_start_ns",
        "getitem_ns",
        "last_end_ns",
        "pid",
        "samples",
        "seq",
        "slot",
    )

    def __init__(self, pid: int, slot: int) -> None:
        self.pid, self.slot = pid, slot
        self.samples = self.batches = self.getitem_ns = self.collate_ns = 0
        self.first_start_ns = self.first_end_ns = self.last_end_ns = 0
        self.seq = 0

    def add_batches(self, events: list[tuple[Any, ...]]) -> None:
        """Several batches made in this process at once, each ``(door, start, collate_start,
        end, samples)`` as the batch door logs it (``InputTiming.count`` one by one): the
        replay's rows line counts a flush's batches in one frame."""
        if not events:
            return
        # Columns, summed in C: no bytecode a batch (integer sums: the same totals as count's).
        _, starts, collate_starts, ends, counts = zip(*events, strict=True)
        collated = sum(collate_starts)
        self.samples += sum(counts)
        self.getitem_ns += collated - sum(starts)
        self.collate_ns += sum(ends) - collated
        self.batches += len(events)
        if not self.first_start_ns:
            self.first_start_ns, self.first_end_ns = events[0][1], events[0][3]
        self.last_end_ns = events[-1][3]

    def publish(self, shared: Any) -> None:
        """Write this process's slot (odd sequence, data, even sequence: three writes)."""
        offset = self.slot * _SLOT_SIZE
        self.seq += 1
        _SEQ.pack_into(shared, offset, self.seq)  # odd: a write is in progress
        _DATA.pack_into(
            shared,
            offset + _SEQ.size,
            self.pid,
            self.samples,
            self.batches,
            self.getitem_ns,
            self.collate_ns,
            # busy: the item calls and the collate, back to back (one less add per batch)
            self.getitem_ns + self.collate_ns,
            self.first_start_ns,
            self.first_end_ns,
            self.last_end_ns,
        )
        self.seq += 1
        _SEQ.pack_into(shared, offset, self.seq)  # even again: the slot is whole


def read_slots(shared: Any) -> dict[int, tuple[int, ...]]:
    """slot -> the SLOT_FIELDS of the process writing it (consistent reads only)."""
    slots = {}
    for slot in range(MAX_WORKERS + 1):
        offset = slot * _SLOT_SIZE
        for _attempt in range(100):
            before = _SEQ.unpack_from(shared, offset)[0]
            if before % 2:
                continue
            values = _DATA.unpack_from(shared, offset + _SEQ.size)
            if _SEQ.unpack_from(shared, offset)[0] == before:
                break
        else:
            continue
        if before:
            slots[slot] = values
    return slots


def anonymous_map() -> mmap.mmap:
    """A zeroed map that forked workers inherit."""
    return mmap.mmap(-1, MAP_SIZE)


def file_backed_map() -> tuple[mmap.mmap, str]:
    """A zeroed shared map backed by a small file that spawned workers open by path; the file
    is left to the resource tracker should this process die before :func:`remove_map_file`."""
    import tempfile

    in_shm = os.path.isdir("/dev/shm")
    fd, path = tempfile.mkstemp(
        prefix=f"{FILE_PREFIX}{os.getpid()}-", dir="/dev/shm" if in_shm else None
    )
    try:
        os.ftruncate(fd, MAP_SIZE)
        shared = mmap.mmap(fd, MAP_SIZE)
        if in_shm:
            _tracker("register", path)
        return shared, path
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def remove_map_file(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
    if path.startswith("/dev/shm/"):
        with contextlib.suppress(Exception):
            _tracker("unregister", path)


def _tracker(action: str, path: str) -> None:
    """Tell multiprocessing's resource tracker about the file: POSIX shared memory names are
    the /dev/shm file names, and the tracker unlinks what is still registered when the last
    process holding it ends."""
    from multiprocessing import resource_tracker

    getattr(resource_tracker, action)("/" + os.path.basename(path), "shared_memory")


def open_map_file(path: str) -> mmap.mmap:
    """In a spawned worker: the map the training process made."""
    with open(path, "r+b") as file:
        return mmap.mmap(file.fileno(), MAP_SIZE)
