"""The launcher's end of a run: node 0 summarises and prints the report; other nodes reduce
their own ranks into a partial for node 0 to merge."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path
from typing import Any

from traceml import schema
from traceml.analysis.reduce import list_rank_files
from traceml.errors import OutputError, ReduceError
from traceml.finalize import (
    ending,
    rank_header,
    reduce_node,
    summarise,
    summarise_nodes,
    wait_for_ranks,
)
from traceml.settings import Settings

# On one node the whole process group has exited: every rank file is final already.
SINGLE_NODE_REPORT_WAIT_S = 0.0


def report_run(
    args: argparse.Namespace,
    settings: Settings,
    received: int | None,
    exit_code: int,
    died_of: str | None = None,
) -> int:
    """Node 0 after the training: wait for the ranks, summarise, print; the exit code to use."""
    run_dir = settings.run_dir
    wait = args.report_wait if args.nnodes > 1 else SINGLE_NODE_REPORT_WAIT_S
    world_size = args.nnodes * args.nproc_per_node
    wait_for_ranks(run_dir, world_size if world_size > 1 else None, wait)
    signal_name = signal.Signals(received).name if received is not None else None
    try:
        # A signal from outside stopped the run, whatever error the ranks died of (DataLoader
        # workers killed by the same signal often surface as a RuntimeError first).
        options: dict[str, Any] = {
            "thresholds": settings.thresholds,
            "html": settings.html,
            **ending(signal_name, exit_code, died_of),
        }
        # Several nodes: each reduces its own ranks into a partial; node 0 merges them.
        _summary, text = (
            summarise_nodes(run_dir, args.nnodes, args.report_wait, **options)
            if args.nnodes > 1
            else summarise(run_dir, **options)
        )
    except ReduceError:
        # A script that failed before training (its own error above) needs no hint about
        # optimizers; one that exited cleanly with no step does.
        why = (
            "did the script step an optimizer, and configure devices from WORLD_SIZE "
            "when launched with --nproc-per-node?"
        )
        if exit_code != 0:
            why = f"the script exited with code {exit_code} before any step"
        if received is not None:
            why = f"traceml run received {signal.Signals(received).name} before any step"
        print(
            f"traceml: no training steps were recorded ({why}); run directory: {run_dir}",
            file=sys.stderr,
        )
        return exit_code
    except OutputError as exc:
        print(f"traceml: could not write the report: {exc}", file=sys.stderr)
        return exit_code
    if settings.report:
        from traceml.present.report import for_terminal

        # On stderr, as time(1) and profilers print theirs: the script's stdout stays its own
        # (`traceml run gen.py > data.csv` holds the script's lines only).
        sys.stdout.flush()
        print(for_terminal(text), end="", file=sys.stderr, flush=True)
    if settings.html:
        from traceml.files import display_path

        print(f"traceml: wrote {display_path(run_dir / schema.REPORT_HTML)}", file=sys.stderr)
    # The script's own exit status, whatever stopped it: a Lightning fit that ends gracefully
    # on Ctrl-C exits 1 untraced, a script that KeyboardInterrupt kills dies of SIGINT.
    return exit_code


def reduce_this_node(args: argparse.Namespace, settings: Settings, launched_at: float) -> None:
    """A node other than 0: reduce this node's rank files into its partial, so node 0 merges a
    small file instead of reading every rank over the shared filesystem. Best effort: node 0
    reads the rank files of a node that left no partial, with a note."""
    try:
        run_dir = this_node_run_dir(settings, args.node_rank, launched_at)
        if run_dir is not None:
            reduce_node(run_dir, args.node_rank, thresholds=settings.thresholds)
    except Exception as exc:  # the report still comes from the rank files
        print(
            f"traceml: node {args.node_rank} could not write its partial summary "
            f"({type(exc).__name__}: {exc}); node 0 reads its rank files instead",
            file=sys.stderr,
        )


def this_node_run_dir(settings: Settings, node: int, launched_at: float) -> Path | None:
    """Where this node's ranks wrote. With a derived run name (no --run-name) the ranks took
    global rank 0's name, which this node's launcher never learnt: find the run directory,
    written since this launch, holding a rank file whose header names this node."""
    if _node_ranks(settings.run_dir, node):
        return settings.run_dir
    candidates = []
    with contextlib.suppress(OSError):
        for run_dir in Path(settings.logs_dir).iterdir():
            ranks = run_dir / "ranks"
            recent = ranks.is_dir() and ranks.stat().st_mtime >= launched_at - 1.0
            if recent and _node_ranks(run_dir, node):
                candidates.append((ranks.stat().st_mtime, run_dir))
    return max(candidates)[1] if candidates else None


def _node_ranks(run_dir: Path, node: int) -> list[int]:
    """The ranks of ``run_dir`` whose header says they ran on node ``node``."""
    return [
        rank
        for rank, path in list_rank_files(run_dir).items()
        if (rank_header(path) or {}).get(schema.NODE_RANK) == node
    ]
