"""End of a run: wait for the ranks' files, reduce, diagnose, write the summary files, print.

Shared by the launcher (``traceml run``) and ``traceml report`` (which global rank 0 of a direct
launch runs in a child process at exit). Files are written whole and renamed into place, so a
reader never sees half a summary.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import orjson

from traceml import schema
from traceml.analysis.diagnose import diagnose
from traceml.analysis.reduce import list_rank_files, reduce_run
from traceml.errors import OutputError
from traceml.files import write_atomically
from traceml.present.report import render_text
from traceml.present.report_html import render_html

_JSON_OPTIONS = orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE


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


def unfinished_ranks_note(run_dir: Path, wait_s: float) -> list[str]:
    """Wait up to ``wait_s`` for every rank's footer; a note for the report when some lack one."""
    if wait_for_ranks(run_dir, None, wait_s):
        return []
    return [
        f"some ranks had not finished their files after {wait_s:g} s; "
        f"run `traceml report {run_dir}` later for the full picture"
    ]
