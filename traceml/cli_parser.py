"""The command line's grammar: its commands, their options, the options' types and help.
:mod:`traceml.cli` parses with it and runs the command."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from traceml._version import __version__
from traceml.errors import EXIT_USAGE


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
        # argparse would list --args, a flag, before the script: the order it must not have.
        usage="traceml run [options] (SCRIPT | -m MODULE) [--args ARGS...]",
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
        type=_count,
        default=0,
        metavar="N",
        help="reduce N rank files at once in worker processes (memory: N ranks' steps; "
        "default: the cores this process may use)",
    )
    report.add_argument(
        "--wait",
        type=_seconds,
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
        help="measure the noise floor from identical runs (2 or more; 3+ recommended) of this "
        "machine; alone: print it; with A B: use it",
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


def _count(text: str) -> int:
    """A whole number, 0 or more (0: the default)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number, 0 or more, got {text!r}")
    return value


def _seconds(text: str) -> float:
    """A finite number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds, 0 or more, got {text!r}")
    return value


class _OneLineParser(argparse.ArgumentParser):
    """A usage error is one line and exit 2, as every other bad input (argparse's own prints
    the usage block first); ``--help`` still shows it."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
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
