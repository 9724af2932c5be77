"""The process's resident set size, read cheaply enough for a step's end."""

from __future__ import annotations

# RSS (a procfs read, rss_reader: ~20 us on a cold cache here) at most this often at a step's end
# (null between): at 10 ms it cost ~1.3 us a step on the stress loop, at 50 ms ~0.3 (stop 46).
RSS_EVERY_NS = 50_000_000


def rss_high_water_mark() -> int | None:
    """The most RSS this process's memory ever held (bytes), read once (the footer's): what
    a step allocates and frees between two step-end readings (activations) counts. The
    kernel's VmHWM, which an exec starts afresh (getrusage's ru_maxrss keeps the parent's
    peak across it: a training started by a big process would read its parent's). Null where
    /proc cannot say."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_reader():
    """A callable returning this process's resident set size in bytes, cheaply.

    Once per step matters: psutil's memory_info() opens and parses /proc/self/status (about
    40 us); one pread of /proc/self/statm on a descriptor kept open costs a few. Falls back to
    psutil where /proc does not exist, and to None when neither works.
    """
    import os

    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
    except (OSError, AttributeError):
        pass
    else:
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            pid = os.getpid()
            open_fd = [fd]  # emptied by close(): the number may then name another file

            def read_statm() -> int | None:
                if os.getpid() != pid or not open_fd:  # (a forked child: its parent's)
                    return None
                return int(os.pread(fd, 128, 0).split()[1]) * page

            def close() -> None:
                """The descriptor closed at the training's end (nothing left open)."""
                if open_fd and os.getpid() == pid:
                    os.close(open_fd.pop())

            read_statm()
            read_statm.close = close  # type: ignore[attr-defined]
            return read_statm
        except (OSError, ValueError, IndexError, AttributeError):
            os.close(fd)
    try:
        import psutil

        memory_info = psutil.Process().memory_info
        return lambda: memory_info().rss
    except Exception:
        return lambda: None
