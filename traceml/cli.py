"""Command line: ``traceml run``, ``traceml report``, ``traceml watch``, ``traceml compare``.

Argument parsing only; the work is in launch / finalize / compare. Errors a user can fix
(:mod:`traceml.errors`) are raised below and turned into one line on stderr and their exit
code here, in :func:`main`, never a traceback.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from traceml.cli_parser import build_parser
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
    # Only `run` has a script to pass arguments to: elsewhere --args is an unknown option.
    head, script_args = (
        _split_script_args(args_list) if args_list[:1] == ["run"] else (args_list, [])
    )
    args, unknown = parser.parse_known_args(head)
    launcher = _launcher_named(args)
    if launcher:
        parser.error(
            f"traceml run starts the script itself, not a {launcher} command line: "
            "traceml run train.py --args ARGS...; several ranks: traceml run "
            "--nproc-per-node 2 train.py (it runs torchrun)"
        )
    if unknown:  # (argparse's own message, with the way out for `run`: a script's options)
        script = getattr(args, "script", None)
        after = head[head.index(script) + 1 :] if script in head else []
        hint = f"; the script's own go after --args: ... --args {shlex.join(unknown)}"
        mine = args.command == "run" and all(token in after for token in unknown)
        parser.error(f"unrecognized arguments: {shlex.join(unknown)}" + (hint if mine else ""))
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


def _launcher_named(args: argparse.Namespace) -> str | None:
    """``traceml run python train.py`` (or torchrun, accelerate): the first thing a newcomer
    types, which otherwise met a hint that led to "no such script: python"."""
    script = getattr(args, "script", None) if args.command == "run" else None
    name = Path(script).name if script else ""
    if not name or name.endswith(".py"):  # (an interpreter's path is a file too)
        return None
    if name in ("torchrun", "accelerate", "deepspeed") or name.rstrip("0123456789.") == "python":
        return name
    return None


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

    from traceml.finalize import launch_ending, summarise, unfinished_ranks_note

    thresholds = _thresholds(args)
    run_dir = Path(args.run_dir)
    notes = unfinished_ranks_note(run_dir, args.wait) if args.wait > 0 else []
    # A run of `traceml run`: how it ended (exit code, signal) as the launcher's report said.
    ending = launch_ending(run_dir)
    # ReduceError (nothing to summarise) and OutputError (cannot write) reach main().
    summary, text = summarise(
        run_dir,
        thresholds=thresholds,
        notes=ending.pop("notes", []) + notes,
        html=args.html,
        jobs=args.jobs if args.jobs > 0 else None,
        **ending,
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
