"""End of a run: wait for the ranks' files, reduce, diagnose, write the summary files, print.

Shared by the launcher (``traceml run``), global rank 0 of a direct launch (at exit) and
``traceml report``. Files are written whole and renamed into place, so a reader never sees half
a summary.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from traceml import schema
from traceml.diagnose import diagnose
from traceml.errors import OutputError
from traceml.reduce import list_rank_files, reduce_run
from traceml.report import for_terminal, render_html, render_text

_JSON_OPTIONS = orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``path`` whole: a reader sees the old file or the new one, never half of one.

    The temporary file has an unpredictable name and is created with O_EXCL (and O_NOFOLLOW),
    so a file or symlink planted next to the target cannot redirect the write elsewhere; the
    rename then replaces ``path`` itself, even when ``path`` is a symlink, never its target.
    """
    path = Path(path)
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


def summarise(
    run_dir: Path,
    *,
    thresholds: dict[str, float] | None = None,
    notes: list[str] | None = None,
    html: bool = False,
    write: bool = True,
    jobs: int = 1,
    status: str | None = None,
) -> tuple[dict[str, Any], str]:
    """Reduce + diagnose ``run_dir``; write final_summary.json/.txt (and report.html).

    ``status`` overrides the run status the rank files suggest, for a caller that knows better
    (the launcher that stopped the run with a signal).
    """
    summary = reduce_run(run_dir, thresholds=thresholds, jobs=jobs)
    if status is not None:
        summary[schema.SUMMARY_STATUS] = status
    if notes:
        summary[schema.SUMMARY_NOTES] = list(notes) + summary[schema.SUMMARY_NOTES]
    summary[schema.SUMMARY_VERDICTS] = diagnose(summary)
    text = render_text(summary)
    if write:
        _write_results(Path(run_dir), summary, text, html=html)
    return summary, text


def _write_results(run_dir: Path, summary: dict[str, Any], text: str, *, html: bool) -> None:
    outputs = [
        (schema.SUMMARY_JSON, orjson.dumps(summary, option=_JSON_OPTIONS)),
        (schema.SUMMARY_TXT, text.encode()),
    ]
    if html:
        outputs.append((schema.REPORT_HTML, render_html(summary).encode()))
    for name, data in outputs:
        try:
            write_atomically(run_dir / name, data)
        except OSError as exc:
            raise OutputError(f"cannot write {run_dir / name}: {exc.strerror or exc}") from None


def _has_footer(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 4096))
            tail = handle.read()
    except OSError:
        return False
    last = tail.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    return b'"kind":"footer"' in last


def expected_world_size(run_dir: Path) -> int | None:
    for path in list_rank_files(run_dir).values():
        try:
            with open(path, "rb") as handle:
                first = handle.readline()
            header = orjson.loads(first)
        except (OSError, orjson.JSONDecodeError):
            continue
        if isinstance(header, dict) and isinstance(header.get(schema.WORLD_SIZE), int):
            return header[schema.WORLD_SIZE]
    return None


def wait_for_ranks(
    run_dir: Path, world_size: int | None, timeout_s: float, poll_s: float = 0.2
) -> bool:
    """Wait (bounded) until every rank's file ends with a footer. Returns whether they all do."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        files = list_rank_files(run_dir)
        size = world_size or expected_world_size(run_dir) or len(files) or 1
        done = all(rank in files and _has_footer(files[rank]) for rank in range(size))
        if done or time.monotonic() >= deadline:
            return done
        time.sleep(poll_s)


def report_after_direct_launch(settings: Any) -> None:
    """Global rank 0 of ``TRACEML=1 python|torchrun train.py``: report once the ranks are done."""
    run_dir = Path(settings.run_dir)
    complete = wait_for_ranks(run_dir, None, settings.report_wait_s)
    notes = []
    if not complete:
        notes.append(
            f"some ranks had not finished their files after {settings.report_wait_s:g} s; "
            f"run `traceml report {run_dir}` later for the full picture"
        )
    _summary, text = summarise(
        run_dir, thresholds=settings.thresholds, notes=notes, html=settings.html
    )
    sys.stdout.flush()
    print(for_terminal(text), end="", flush=True)
