"""``traceml run``: run the user's script traced, as ``python`` or ``torchrun`` would, then report.

The child runs in its own process group when the launcher is a shell's job, with the
terminal's foreground when the launcher has it (else in the launcher's group, so that a
caller's loop stops on Ctrl-C): Ctrl-C, Ctrl-Z, ``input()`` and ``pdb`` work as with plain
``python``, and the exit status is the script's (its code, or death by the signal that killed
it): ``traceml.launch_child``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson

from traceml import schema
from traceml.errors import LaunchError
from traceml.launch_child import die_like, run_child
from traceml.settings import (
    ENV_ENABLE,
    ENV_HTML,
    ENV_LAUNCHER,
    ENV_LOGS_DIR,
    ENV_REPORT,
    ENV_REPORT_WAIT_S,
    ENV_RUN_NAME,
    ENV_TRACE_MAX_STEPS,
    Settings,
    SettingsError,
    is_valid_run_name,
    load_settings,
    make_launch_stamp,
    settings_to_env,
    stamped_run_name,
    threshold_variables,
)
from traceml.versions import package_versions


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def build_child_command(args: argparse.Namespace, python: str = sys.executable) -> list[str]:
    target = ["-m", args.module] if args.module else [args.script]
    if args.nproc_per_node == 1 and args.nnodes == 1:
        return [python, *target, *args.script_args]
    command = [
        python,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={args.nproc_per_node}",
        f"--nnodes={args.nnodes}",
    ]
    if args.nnodes > 1:
        command.append(f"--node-rank={args.node_rank}")
    if args.master_addr or args.master_port or args.nnodes > 1:
        command.append(f"--master-addr={args.master_addr or '127.0.0.1'}")
        command.append(f"--master-port={args.master_port or 29500}")
    else:
        command.append("--standalone")
    if args.module:
        command.append("--module")
        target = [args.module]
    return [*command, *target, *args.script_args]


def validate(args: argparse.Namespace) -> None:
    script = Path(args.script) if args.script is not None else None
    if script is not None and script.is_dir() and not (script / "__main__.py").is_file():
        raise LaunchError(f"{args.script} is a directory without a __main__.py to run")
    if script is not None and not (script.is_file() or script.is_dir()):  # (python runs both)
        raise LaunchError(f"no such script: {args.script}")
    for name in ("nproc_per_node", "nnodes"):
        if getattr(args, name) < 1:
            raise LaunchError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.node_rank < args.nnodes:
        raise LaunchError(f"--node-rank must be between 0 and {args.nnodes - 1}")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise LaunchError("--master-port must be between 1 and 65535")
    if args.trace_max_steps is not None and args.trace_max_steps < 1:
        raise LaunchError("--trace-max-steps must be at least 1")
    if args.logs_dir is not None and not args.logs_dir.strip():
        raise LaunchError("--logs-dir needs a directory (the default is ./logs)")
    if args.run_name is not None and not is_valid_run_name(args.run_name):
        raise LaunchError(
            f"--run-name {args.run_name!r} is not a safe run name "
            "(letters, digits, '.', '_' and '-' only, starting with a letter or digit, "
            "at most 128 characters)"
        )


def _check_environment(settings: Settings) -> None:
    """The script's TRACEML_* variables (the user's, with the launcher's on top) as its
    tracing will read them: a bad one is this command's one-line error, before anything
    runs, not a warning from inside the training followed by an empty report."""
    try:
        load_settings({**os.environ, **settings_to_env(settings)})
    except SettingsError as exc:
        raise LaunchError(str(exc)) from None


def make_settings(args: argparse.Namespace, thresholds: dict[str, float]) -> Settings:
    """The options given, over the user's TRACEML_* variables (read as a direct launch reads
    them), over the defaults: TRACEML_LOGS_DIR=/scratch traceml run ... writes to /scratch."""
    # Variables an option or the launcher replaces are not read: a bad one is no error then.
    given = {
        ENV_LOGS_DIR: args.logs_dir is not None,
        ENV_RUN_NAME: args.run_name is not None,
        ENV_TRACE_MAX_STEPS: args.trace_max_steps is not None,
        ENV_REPORT: args.no_report,
        ENV_HTML: args.html,
    }
    # (TRACEML_REPORT_WAIT_S: a direct launch's; the launcher reports itself, --report-wait)
    replaced = {name for name, option in given.items() if option}
    replaced.update((ENV_ENABLE, ENV_LAUNCHER, ENV_REPORT_WAIT_S))  # (the launcher sets TRACEML)
    replaced.update(threshold_variables(thresholds))
    environ = {key: value for key, value in os.environ.items() if key not in replaced}
    try:
        env = load_settings(environ, argv=[sys.executable])
    except SettingsError as exc:
        raise LaunchError(str(exc)) from None
    stem = args.module.rsplit(".", 1)[-1] if args.module else Path(args.script).stem
    explicit = args.run_name is not None or env.run_name_explicit
    run_name = args.run_name or (
        env.run_name if env.run_name_explicit else stamped_run_name(stem, make_launch_stamp())
    )
    # os.path.expanduser, as for TRACEML_LOGS_DIR: an unknown ~user stays a plain name
    # (Path.expanduser raises RuntimeError on it).
    logs_dir = env.logs_dir if args.logs_dir is None else os.path.expanduser(args.logs_dir)
    return Settings(
        logs_dir=Path(logs_dir).resolve(),
        run_name=run_name,
        trace_max_steps=(
            env.trace_max_steps if args.trace_max_steps is None else args.trace_max_steps
        ),
        report=env.report and not args.no_report,
        html=env.html or args.html,
        launcher_managed=True,
        thresholds={**env.thresholds, **thresholds},  # --threshold on top of the variables
        run_name_explicit=explicit,
    )


def run_command(args: argparse.Namespace, *, thresholds: dict[str, float]) -> int:
    validate(args)
    live_interval_s, live_collect_s = live_timing(args)
    settings = make_settings(args, thresholds)
    _check_environment(settings)
    run_dir = settings.run_dir
    is_node_zero = args.node_rank == 0
    if is_node_zero:
        settings = _create_run_dir(settings)
        run_dir = settings.run_dir
    command = build_child_command(args)
    env = dict(os.environ)
    env.update(settings_to_env(settings))
    manifest = _start_manifest(args, settings, command)
    if is_node_zero:
        _write_manifest(run_dir, manifest)

    monitor = start_live_view(args, settings, interval_s=live_interval_s, collect_s=live_collect_s)
    launched_at = time.time()
    try:
        returncode, received = run_child(command, env)
    finally:
        if monitor is not None:
            monitor.stop()  # before anything else is printed: the panel gives its rows back
    exit_code = exit_code_for(returncode)

    manifest.update(
        ended_at=_utc_now(),
        exit_code=exit_code,
        signal=signal.Signals(received).name if received else None,
        script_signal=died_of(returncode),
    )
    if not is_node_zero:
        from traceml.launch_report import reduce_this_node

        reduce_this_node(args, settings, launched_at)
        print(
            f"traceml: node {args.node_rank} finished (exit code {exit_code}); "
            "node 0 writes the report",
            file=sys.stderr,
        )
        die_like(returncode)
        return exit_code
    _write_manifest(run_dir, manifest)
    from traceml.launch_report import report_run

    exit_code = report_run(args, settings, received, exit_code, manifest["script_signal"])
    die_like(returncode)
    return exit_code


def _create_run_dir(settings: Settings) -> Settings:
    """Create the run's directory; a derived name taken already (two launches in the same
    second) gets the first free suffix (``-2``, ``-3``...): only a chosen --run-name is
    refused when its directory exists."""
    try:
        settings.logs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(f"cannot create {settings.logs_dir}: {exc.strerror or exc}") from None
    for attempt in range(1, 1000 if not settings.run_name_explicit else 2):
        name = settings.run_name if attempt == 1 else f"{settings.run_name}-{attempt}"
        candidate = settings.replace(run_name=name)
        try:
            candidate.run_dir.mkdir()  # atomic: of two launches, one creates it (and its ranks/)
            (candidate.run_dir / schema.RANKS_DIR).mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise LaunchError(f"cannot create {candidate.run_dir}: {exc.strerror or exc}") from None
        return candidate
    raise LaunchError(f"run directory {settings.run_dir} already exists; choose another --run-name")


def _start_manifest(
    args: argparse.Namespace, settings: Settings, command: list[str]
) -> dict[str, Any]:
    """manifest.json as the run starts: what ran, where, on which topology; the end to come."""
    return {
        schema.SCHEMA: schema.MANIFEST_SCHEMA,
        "run": settings.run_name,
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "child_command": command,
        "cwd": os.getcwd(),
        "started_at": _utc_now(),
        "ended_at": None,
        "exit_code": None,
        "signal": None,
        "versions": package_versions(),
        "topology": {
            "nnodes": args.nnodes,
            "nproc_per_node": args.nproc_per_node,
            "node_rank": args.node_rank,
            "world_size": args.nnodes * args.nproc_per_node,
            "master_addr": args.master_addr,
            "master_port": args.master_port,
        },
    }


def live_timing(args: argparse.Namespace) -> tuple[float, float]:
    """The live view's line interval (--live-interval, else the env var, else 30 s) and the
    least training time before its first provisional verdict."""
    from traceml.present import live

    if args.live_interval is not None and not args.live_interval > 0:  # NaN too
        raise LaunchError("--live-interval must be a positive number of seconds")
    try:
        interval = args.live_interval or live.interval_from_env() or live.DEFAULT_INTERVAL_S
        collect = live.collect_from_env()
    except live.LiveError as exc:
        raise LaunchError(str(exc)) from None
    return interval, live.DEFAULT_COLLECT_S if collect is None else collect


def start_live_view(
    args: argparse.Namespace, settings: Settings, *, interval_s: float, collect_s: float
) -> Any:
    """Say where the run goes; start the live view (a thread of this process, reading the rank
    files: the training processes do nothing for it). Returns the monitor, or None."""
    from traceml.present import live

    if args.node_rank and not settings.run_name_explicit:
        # The ranks take global rank 0's derived name, which this node's launcher never
        # learns: a directory named here would never exist (helper review).
        from traceml.files import display_path

        print(
            f"traceml: node {args.node_rank}: the ranks write into node 0's run directory "
            f"(under {display_path(settings.logs_dir)}); node 0 shows the live view and "
            "writes the report (--run-name names it on every node)",
            file=sys.stderr,
        )
        return None
    world_size = args.nnodes * args.nproc_per_node
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        fd = None
    mode = "off" if args.no_live or fd is None else live.terminal_mode(fd)
    print(live.start_line(settings.run_dir, world_size, mode, interval_s), file=sys.stderr)
    sys.stderr.flush()
    if mode == "off" or fd is None:
        return None
    monitor = live.LiveMonitor(
        settings.run_dir,
        mode=mode,
        fd=fd,
        world_size=world_size,
        thresholds=settings.thresholds,
        interval_s=interval_s,
        collect_s=collect_s,
    )
    monitor.start()
    return monitor


def _write_manifest(run_dir: Path, manifest: dict[str, Any]) -> None:
    from traceml.files import write_atomically

    with contextlib.suppress(OSError):
        write_atomically(
            run_dir / schema.MANIFEST_JSON,
            orjson.dumps(manifest, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE),
        )


def died_of(returncode: int) -> str | None:
    """The name of the signal the script was killed by (a negative return code), else None."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:  # a number the signal module has no name for
        return None


def exit_code_for(returncode: int) -> int:
    """The script's exit code; 128 + N for a script killed by signal N (as a shell shows it,
    for the manifest and the report: the launcher itself then ends by that signal)."""
    return 128 - returncode if returncode < 0 else returncode
