"""Small file helpers shared by both sides: whole-file writes and paths as a user types them."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shlex
from pathlib import Path

from traceml import schema


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``path`` whole: a reader sees the old file or the new one, never half of one.

    The temporary file has an unpredictable name and is created with O_EXCL (and O_NOFOLLOW),
    so a file or symlink planted next to the target cannot redirect the write elsewhere; the
    rename then replaces ``path`` itself, even when ``path`` is a symlink, never its target.
    """
    path = Path(path)
    if path.name in ("", ".", "..") or path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a file name", str(path))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    for _attempt in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)  # the umask applies, as for any file we write
        except FileExistsError:
            continue
        break
    else:  # pragma: no cover - 100 collisions of 64 random bits
        raise FileExistsError(f"cannot create a temporary file next to {path}")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def text_path(path: str | os.PathLike[str]) -> str:
    """``path`` as text any UTF-8 writer takes (JSON, HTML, a terminal): the bytes of a name
    that are not UTF-8, which Python holds as lone surrogates, as ``\\xNN`` escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def display_path(path: Path) -> str:
    """``path`` relative to the current directory when inside it, quoted for a shell."""
    path = Path(path)
    with contextlib.suppress(ValueError, OSError):
        path = path.resolve().relative_to(Path.cwd().resolve())
    return shlex.quote(str(path))


def newest_run(path: Path) -> Path | None:
    """The most recently changed run directory (one with a ``ranks/`` folder) directly inside
    ``path``: a logs folder given where a run was meant."""
    try:
        runs = [p for p in Path(path).iterdir() if (p / schema.RANKS_DIR).is_dir()]
        return max(runs, key=lambda p: p.stat().st_mtime) if runs else None
    except OSError:
        return None
