"""Command line: ``traceml run``, ``traceml report``, ``traceml watch``, ``traceml compare``.

Argument parsing only; the work is in launch / finalize / compare. Errors a user can fix
(:mod:`traceml.errors`) are raised below and turned into one line on stderr and their exit
code here, in :func:`main`, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from traceml._version import __version__
from traceml.errors import EXIT_INTERNAL, EXIT_USAGE, UsageError, UserError
from traceml.guarded_output import guarded_std_streams

__all__ = ["EXIT_USAGE", "UsageError", "build_parser", "main"]

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell shows for a command Ctrl-C stopped


def _threshold_overrides(items: Sequence[str] | None) -> dict[str, float]:
    from traceml.thresholds import ThresholdError, parse_threshold_override

    overrides: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--threshold {item!r}: expected NAME=VALUE, e.g. input_warn=0.2")
        try:
            key, number = parse_threshold_override(name, value)
        except ThresholdError as exc:
            raise UsageError(f"--threshold: {exc}") from None
        overrides[key] = number
    return overrides


def _thresholds(args: argparse.Namespace) -> dict[str, float]:
    """``report`` and ``watch``: the TRACEML_THRESHOLD_* variables, as a traced process and
    ``traceml run`` read them, with each --threshold given on top."""
    import os

    from traceml.settings import SettingsError, parse_threshold_env, threshold_variables

    given = _threshold_overrides(args.threshold)
    replaced = threshold_variables(given)  # not read, as in run
    try:
        from_env = parse_threshold_env({k: v for k, v in os.environ.items() if k not in replaced})
    except SettingsError as exc:
        raise UsageError(str(exc)) from None
    return {**from_env, **given}


def _add_threshold_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threshold",
        action="append",
        metavar="NAME=VALUE",
        help="override a diagnosis threshold (the table: docs/diagnosis.md); repeatable",
    )


def _add_run(commands: Any) -> None:
    """``traceml run SCRIPT [options] [--args ...]``."""
    run = commands.add_parser(
        "run",
        help="run a training script traced, then print the diagnosis",
        description=(
            "Run SCRIPT (or -m MODULE) exactly as python would, with tracing on. Everything "
            "after --args goes to the script unchanged. The TRACEML_* variables of a direct "
            "launch apply too; an option given overrides its variable."
        ),
    )
    target = run.add_mutually_exclusive_group(required=True)
    target.add_argument("script", nargs="?", help="the training script")
    target.add_argument("-m", dest="module", metavar="MODULE", help="run a module, like python -m")
    # No defaults here: an option not given leaves its TRACEML_* variable to decide.
    run.add_argument(
        "--logs-dir", help="where run directories go (env TRACEML_LOGS_DIR, else ./logs)"
    )
    run.add_argument(
        "--run-name", help="run directory name (env TRACEML_RUN_NAME, else script name + time)"
    )
    run.add_argument(
        "--trace-max-steps", type=int, metavar="N", help="record only the first N steps"
    )
    _add_topology(run)
    run.add_argument("--no-report", action="store_true", help="do not print the final report")
    run.add_argument("--html", action="store_true", help="also write report.html")
    run.add_argument(
        "--no-live", action="store_true", help="no live view on stderr while the script runs"
    )
    run.add_argument(
        "--live-interval",
        type=float,
        metavar="SECONDS",
        help="when stderr is not a terminal (or one of unknown or zero size): one live line "
        "every SECONDS (30; env TRACEML_LIVE_INTERVAL_S)",
    )
    run.add_argument(
        "--report-wait",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="multi-node: how long node 0 waits for other nodes' rank files (30)",
    )
    _add_threshold_option(run)
    run.add_argument(
        "--args",
        dest="args_marker",
        action="store_true",
        help="everything after --args goes to the script verbatim (put it last)",
    )


def _add_topology(run: argparse.ArgumentParser) -> None:
    """torchrun's topology options, passed on to it."""
    run.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="processes (ranks) on this node; over 1, the script runs under torchrun (1)",
    )
    run.add_argument(
        "--nnodes", type=int, default=1, metavar="N", help="nodes in the job, as torchrun (1)"
    )
    run.add_argument(
        "--node-rank",
        type=int,
        default=0,
        metavar="R",
        help="this node's index, 0 .. nnodes-1; node 0 writes the report (0)",
    )
    run.add_argument(
        "--master-addr",
        default=None,
        metavar="HOST",
        help="address of node 0 for the ranks' rendezvous, as torchrun (127.0.0.1)",
    )
    run.add_argument(
        "--master-port",
        type=int,
        default=None,
        metavar="PORT",
        help="port on node 0 for the rendezvous, as torchrun (29500)",
    )


def _add_report(commands: Any) -> None:
    """``traceml report RUN_DIR``."""
    report = commands.add_parser(
        "report",
        help="(re)build the summary and report of a run directory",
        description="Read a run directory's rank files, write final_summary.json and "
        "final_summary.txt (and report.html with --html) into it, and print the report. Works "
        "on any run, however it was launched, also one that crashed or is still running.",
    )
    report.add_argument("run_dir", help="a run directory (logs/<run-name>)")
    report.add_argument("--json", action="store_true", help="print the summary JSON instead")
    report.add_argument("--html", action="store_true", help="also write report.html")
    report.add_argument(
        "--jobs",
        type=int,
        default=0,
        metavar="N",
        help="reduce N rank files at once in worker processes (memory: N ranks' steps; "
        "default: the cores this process may use)",
    )
    report.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for every rank to finish its file first (a run still ending)",
    )
    # Set by the training process of a direct launch, which reports through this command in a
    # child process so that it never loads the analysis side itself: the run-end banner.
    report.add_argument("--after-direct-launch", action="store_true", help=argparse.SUPPRESS)
    _add_threshold_option(report)


def _add_watch(commands: Any) -> None:
    """``traceml watch RUN_DIR``."""
    watch = commands.add_parser(
        "watch",
        help="follow a run in progress (any launch) until its ranks finish",
        description="Show a run's live view from another terminal: steps, step time, phase "
        "shares, slowest rank and a provisional verdict, until every rank's file is closed "
        "(or Ctrl-C). On a finished run, print its final state.",
    )
    watch.add_argument("run_dir", help="a run directory (logs/<run-name>)")
    watch.add_argument(
        "--interval",
        type=float,
        metavar="SECONDS",
        help="when stdout is not a terminal (or one of unknown or zero size): one line every "
        "SECONDS (30; env TRACEML_LIVE_INTERVAL_S)",
    )
    watch.add_argument(
        "--html", metavar="FILE", help="keep FILE, a self-refreshing report.html, up to date"
    )
    _add_threshold_option(watch)


def _add_compare(commands: Any) -> None:
    """``traceml compare A B`` / ``A1 A2 A3 --vs B1 B2 B3`` / ``--noise-floor-from R1 R2 R3``."""
    compare = commands.add_parser(
        "compare",
        help="compare runs' final_summary.json, before vs after a change (for people and CI)",
        description=(
            "traceml compare A B, or with several runs a side: traceml compare A1 A2 A3 --vs "
            "B1 B2 B3 (then run-to-run noise is measured, not assumed). Each is a "
            "final_summary.json or its run directory."
        ),
    )
    compare.add_argument(
        "runs", nargs="*", metavar="RUN", help="A then B; or, with --vs, all the A runs"
    )
    compare.add_argument(
        "--vs", nargs="+", metavar="RUN", help="the B runs (after the change); put it last"
    )
    compare.add_argument(
        "--output",
        help="write <OUTPUT>.json and <OUTPUT>.txt (parent dirs are created; existing files "
        "are replaced, with a line saying so)",
    )
    compare.add_argument(
        "--fail-on-regression",
        type=float,
        metavar="PCT",
        help="exit 1 when step time got significantly slower by more than PCT %%; "
        "exit 3 when the comparison is inconclusive",
    )
    compare.add_argument(
        "--noise-floor",
        type=float,
        default=None,
        metavar="PCT",
        help="one run a side: smallest change called real, since run-to-run noise is unknown "
        "(default 5, a guess: under --fail-on-regression a regression then exits 3, not 1)",
    )
    compare.add_argument(
        "--noise-floor-from",
        nargs="+",
        metavar="RUN",
        help="measure the noise floor from identical runs (3 or more) of this machine; alone: "
        "print it; with A B: use it",
    )
    compare.add_argument(
        "--equivalence-margin",
        type=float,
        default=5.0,
        metavar="PCT",
        help="EQUIVALENT only when the whole 90%% interval lies within +-PCT %% (5)",
    )
    compare.add_argument(
        "--allow-setup-change",
        action="store_true",
        help="compare across a world-size, device or timing-method change (else INCONCLUSIVE)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="traceml",
        description="Why is my training slow, and did my change make it faster?",
    )
    parser.add_argument("--version", action="version", version=f"traceml {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    _add_run(commands)
    _add_report(commands)
    _add_watch(commands)

    _add_compare(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code holds whatever happens to stdout and stderr."""
    with guarded_std_streams():
        try:
            return _main(argv)
        except Exception:  # a bug in traceml: its own exit code, never a verdict's
            traceback.print_exc()
            print(
                f"traceml: internal error (exit code {EXIT_INTERNAL}); please report it with "
                "the lines above",
                file=sys.stderr,
            )
            return EXIT_INTERNAL


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args_list = list(sys.argv[1:] if argv is None else argv)
    head, script_args = _split_script_args(args_list)
    args = parser.parse_args(head)
    args.script_args = script_args
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "run":
            from traceml.launch import run_command

            return run_command(args, thresholds=_threshold_overrides(args.threshold))
        if args.command in ("report", "compare"):
            return _interruptible(args)
        if args.command == "watch":
            return _watch(args)  # says its own line on Ctrl-C: the run goes on
    except UserError as exc:
        # The one place user errors become a line and an exit code (traceml/errors.py).
        print(f"traceml: error: {exc}", file=sys.stderr)
        return exc.exit_code
    parser.error(f"unknown command {args.command}")
    return EXIT_USAGE


def _interruptible(args: argparse.Namespace) -> int:
    """``report`` or ``compare``; Ctrl-C is one line and the shell's 128 + SIGINT, as the user
    asked for it: no traceback (their files are written whole or not at all). Not ``run``:
    there Ctrl-C goes to the script, and traceml.launch_child decides what follows."""
    try:
        if args.command == "report":
            return _report(args)
        from traceml.compare_command import compare_command

        return compare_command(args)
    except KeyboardInterrupt:
        print(f"traceml: {args.command} interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Everything after the first ``--args`` belongs to the script, untouched by argparse
    (which would otherwise read the script's own ``--flags`` as traceml's)."""
    if "--args" not in argv:
        return argv, []
    index = argv.index("--args")
    return argv[:index], argv[index + 1 :]


def _report(args: argparse.Namespace) -> int:
    import orjson

    from traceml.finalize import summarise, unfinished_ranks_note

    thresholds = _thresholds(args)
    run_dir = Path(args.run_dir)
    notes = unfinished_ranks_note(run_dir, args.wait) if args.wait > 0 else []
    # ReduceError (nothing to summarise) and OutputError (cannot write) reach main().
    summary, text = summarise(
        run_dir,
        thresholds=thresholds,
        notes=notes,
        html=args.html,
        jobs=args.jobs if args.jobs > 0 else None,
    )
    if args.after_direct_launch:
        from traceml.present.report import for_terminal

        text = for_terminal(text)
    if args.json:
        sys.stdout.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(text)
    if args.html:
        from traceml import schema
        from traceml.files import display_path

        sys.stdout.flush()
        print(f"traceml: wrote {display_path(run_dir / schema.REPORT_HTML)}", file=sys.stderr)
    return 0


def _watch(args: argparse.Namespace) -> int:
    from traceml.present.live import watch

    if args.interval is not None and not args.interval > 0:
        raise UsageError("--interval must be a positive number of seconds")
    return watch(  # its LiveError is a UsageError: one line, exit 2
        Path(args.run_dir),
        thresholds=_thresholds(args),
        interval_s=args.interval,
        html=Path(args.html) if args.html else None,
    )
