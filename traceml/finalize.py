"""End of a run: wait for the ranks' files, reduce, diagnose, write the summary files, print.

Shared by the launcher (``traceml run``) and ``traceml report`` (which global rank 0 of a direct
launch runs in a child process at exit). Files are written whole and renamed into place, so a
reader never sees half a summary.

The pipeline, each stage entered once: rank files (or the per-node partials standing in for
them) -> per-rank reduction -> run reduction (:func:`reduce_run`) -> diagnosis
(:func:`diagnose`) -> rendering (:func:`render_text`, :func:`render_html`). On a multi-node
run every node can first reduce its own rank files (:func:`reduce_node`, or ``python -m
traceml.finalize node-partial RUN_DIR --node N``); the summary then merges those partials.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import orjson

from traceml import schema
from traceml.analysis.diagnose import diagnose
from traceml.analysis.partials import partial_path, usable_cpu_count
from traceml.analysis.partials import reduce_node as _reduce_node
from traceml.analysis.reduce import list_rank_files, reduce_run
from traceml.errors import OutputError
from traceml.files import write_atomically
from traceml.present.report import render_text
from traceml.present.report_html import render_html
from traceml.thresholds import resolve_thresholds

_JSON_OPTIONS = orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE
_SIGNAL_NAME = re.compile(r"SIG[A-Z0-9]{1,12}")  # manifest.json's "signal"


def summarise(
    run_dir: Path,
    *,
    thresholds: dict[str, float] | None = None,
    notes: list[str] | None = None,
    html: bool = False,
    write: bool = True,
    jobs: int | None = None,
    status: str | None = None,
    exit_code: int = 0,
) -> tuple[dict[str, Any], str]:
    """Reduce + diagnose ``run_dir``; write final_summary.json/.txt (and report.html).

    ``status`` overrides the run status the rank files suggest, for a caller that knows better
    (the launcher that stopped the run with a signal). ``exit_code``: the script's, where the
    caller knows it: a failure the rank files cannot see (``sys.exit(3)`` after the loop) makes
    a completed or partial run ``failed``. ``jobs``: rank files reduced at once in worker
    processes (default: the cores this process may use).
    """
    summary = reduce_run(run_dir, thresholds=thresholds, jobs=jobs or usable_cpu_count())
    if status is not None:
        summary[schema.SUMMARY_STATUS] = status
    elif exit_code and summary[schema.SUMMARY_STATUS] in (schema.RUN_COMPLETED, schema.RUN_PARTIAL):
        summary[schema.SUMMARY_STATUS] = schema.RUN_FAILED
    if notes:
        summary[schema.SUMMARY_NOTES] = list(notes) + summary[schema.SUMMARY_NOTES]
    summary[schema.SUMMARY_VERDICTS] = diagnose(summary)
    text = render_text(summary)
    if write:
        _write_results(Path(run_dir), summary, text, html=html)
    return summary, text


def reduce_node(
    run_dir: Path,
    node: int,
    *,
    thresholds: dict[str, float] | None = None,
    jobs: int | None = None,
) -> Path | None:
    """Reduce the rank files node ``node`` wrote into its partial (``partials/node_<N>.json``)
    for the report to merge; None when that node wrote no rank file. Run it on each node at
    the end of a multi-node run, with the thresholds the report will use."""
    warmup = int(resolve_thresholds(thresholds)["warmup_steps"])
    return _reduce_node(Path(run_dir), node, warmup, jobs or usable_cpu_count())


def wait_for_partials(run_dir: Path, nodes: int, timeout_s: float, poll_s: float = 0.2) -> bool:
    """Wait (bounded) until nodes 1..nodes-1 have written their partials (node 0 makes its own
    while they make theirs). Returns whether they all did; the report reads the rank files of
    any node that did not, with a note."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    wanted = [partial_path(Path(run_dir), node) for node in range(1, nodes)]
    while True:
        if all(path.exists() for path in wanted):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def summarise_nodes(
    run_dir: Path, nodes: int, wait_s: float, **options: Any
) -> tuple[dict[str, Any], str]:
    """Node 0's end of a multi-node run: reduce its own rank files into its partial (while the
    other nodes reduce theirs), wait up to ``wait_s`` for theirs, then :func:`summarise` (which
    merges the partials and reads the rank files of any node that left none)."""
    reduce_node(run_dir, 0, thresholds=options.get("thresholds"), jobs=options.get("jobs"))
    wait_for_partials(run_dir, nodes, wait_s)
    return summarise(run_dir, **options)


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


def rank_header(path: Path) -> dict[str, Any] | None:
    """A rank file's first line as a dict, or None when unreadable or not an object."""
    try:
        with open(path, "rb") as handle:
            header = orjson.loads(handle.readline())
    except (OSError, orjson.JSONDecodeError):
        return None
    return header if isinstance(header, dict) else None


def expected_world_size(run_dir: Path) -> int | None:
    for path in list_rank_files(run_dir).values():
        header = rank_header(path)
        if header is not None and isinstance(header.get(schema.WORLD_SIZE), int):
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


def ending(signal_name: str | None, exit_code: int, died_of: str | None = None) -> dict[str, Any]:
    """How a ``traceml run`` training ended, as :func:`summarise`'s options (``status``,
    ``exit_code``, ``notes``): the signal the launcher received and passed on (the run was
    interrupted), else a signal the script died of (``died_of``: sent to it from elsewhere,
    the kernel's OOM killer), else the script's failing exit code (it failed)."""
    notes = []
    if signal_name is not None:
        notes.append(
            f"traceml run received {signal_name} and stopped the training; "
            "this report covers the steps finished before that"
        )
    elif died_of is not None:
        oom = " (the kernel's out-of-memory killer sends SIGKILL)" if died_of == "SIGKILL" else ""
        notes.append(
            f"the script was killed by {died_of} (exit code {exit_code}), not sent by traceml "
            f"run{oom}: this report covers the steps recorded before that"
        )
    elif exit_code != 0:
        notes.append(
            f"the script exited with code {exit_code} (a failure, by its own account): "
            "this report covers the steps recorded before that"
        )
    status = schema.RUN_INTERRUPTED if signal_name is not None else None
    return {"status": status, "exit_code": exit_code, "notes": notes}


def launch_ending(run_dir: Path) -> dict[str, Any]:
    """The ending ``traceml run`` recorded in ``manifest.json`` as :func:`summarise`'s options
    (``status``, ``exit_code``, ``notes``), so that a report made again later says what the
    launcher's did; empty where there is none (a direct launch, a run still going, a
    manifest unreadable or of another shape)."""
    try:
        manifest = orjson.loads((Path(run_dir) / schema.MANIFEST_JSON).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    if not isinstance(manifest, dict):
        return {}
    code, name = manifest.get("exit_code"), manifest.get("signal")
    died_of = manifest.get("script_signal")
    if type(code) is not int or not all(
        value is None or _SIGNAL_NAME.fullmatch(str(value)) for value in (name, died_of)
    ):
        return {}
    return ending(name, code, died_of)


def main(argv: list[str] | None = None) -> int:
    """``python -m traceml.finalize node-partial RUN_DIR --node N [--jobs J]``: the per-node
    step of a multi-node report (the launcher of each node, or a direct launch's node-local
    rank 0 in its report child, runs it; the training process never does)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m traceml.finalize")
    parser.add_argument("command", choices=["node-partial"])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--jobs", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=None)
    args = parser.parse_args(argv)
    thresholds = None if args.warmup_steps is None else {"warmup_steps": args.warmup_steps}
    path = reduce_node(args.run_dir, args.node, thresholds=thresholds, jobs=args.jobs or None)
    if path is None:
        print(f"traceml: node {args.node} wrote no rank file in {args.run_dir}", file=sys.stderr)
        return 1
    print(f"traceml: node {args.node} reduced into {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
