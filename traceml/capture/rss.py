"""The process's resident set size, read cheaply enough for a step's end."""

from __future__ import annotations

# RSS (a procfs read, rss_reader: ~20 us on a cold cache here) at most this often at a step's end
# (null between): at 10 ms it cost ~1.3 us a step on the stress loop, at 50 ms ~0.3 (stop 46).
RSS_EVERY_NS = 50_000_000


def rss_reader():
    """A callable returning this process's resident set size in bytes, cheaply.

    Once per step matters: psutil's memory_info() opens and parses /proc/self/status (about
    40 us); one pread of /proc/self/statm on a descriptor kept open costs a few. Falls back to
    psutil where /proc does not exist, and to None when neither works.
    """
    import os

    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        page = os.sysconf("SC_PAGE_SIZE")
        pid = os.getpid()

        def read_statm() -> int | None:
            if os.getpid() != pid:  # a forked child must not read its parent's descriptor
                return None
            return int(os.pread(fd, 128, 0).split()[1]) * page

        read_statm()
        return read_statm
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        memory_info = psutil.Process().memory_info
        return lambda: memory_info().rss
    except Exception:
        return lambda: None
