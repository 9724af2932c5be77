"""The two things a direct launch (``TRACEML=1 python|torchrun train.py``) says on global rank 0.

At the start, where the run directory is; at interpreter exit, the report. The report is
built by ``python -m traceml report`` in a child process, waited for, with its output on this
process's terminal: the training process (which may still hold the model and device memory)
never loads the reducer, the diagnosis or the renderers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from traceml import console
from traceml.files import display_path


def announce_direct_launch(run_dir: Any) -> None:
    """One line on stderr: the run directory and how to watch it (no live view in training)."""
    where = display_path(run_dir)
    console.warn(
        f"tracing into {where}; to watch it live: traceml watch {where}",
        key="live-announce",
    )


def report_command(settings: Any) -> list[str]:
    """The ``traceml report`` command line that reports this direct launch."""
    command = [sys.executable, "-m", "traceml", "report", str(settings.run_dir)]
    command += ["--wait", f"{settings.report_wait_s:g}", "--after-direct-launch"]
    if settings.html:
        command.append("--html")
    for name, value in sorted(settings.thresholds.items()):
        command += ["--threshold", f"{name}={value!r}"]
    return command


def node_partial_command(settings: Any, node: int) -> list[str]:
    """The command that reduces node ``node``'s rank files into its partial (issue 24)."""
    run_dir = str(settings.run_dir)
    command = [sys.executable, "-m", "traceml.finalize", "node-partial", run_dir]
    command += ["--node", str(node)]
    warmup = (getattr(settings, "thresholds", None) or {}).get("warmup_steps")
    if warmup is not None:  # the report only merges partials made with its own warm-up
        command += ["--warmup-steps", f"{int(warmup)}"]
    return command


def report_in_child(settings: Any, *, through_sys_stderr: bool = False) -> None:
    """Run the report in a child process and wait for it; its failures are its own lines.
    ``through_sys_stderr``: its text goes through ``sys.stderr``'s ``write`` rather than to
    the descriptor behind it (a notebook's kernel shows what the stream is written, while its
    ``fileno()`` is the terminal that started the kernel)."""
    failure = "could not write the final report (traceml report"
    _run_child(report_command(settings), failure, through_sys_stderr=through_sys_stderr)


def node_partial_in_child(settings: Any, node: int) -> None:
    """On a node other than 0, its local rank 0 reduces the node's rank files in a child
    process (the training process never loads the reducer) for node 0's report to merge."""
    _run_child(
        node_partial_command(settings, node),
        f"could not reduce node {node}'s rank files (node-partial",
    )


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced sys.stderr: the process's own
        return 2


def _run_child(command: list[str], failure: str, *, through_sys_stderr: bool = False) -> None:
    """Run ``command`` (its stdout on this process's stderr), wait; one warning line when it
    fails, with the child's own one-line error in it (never two lines for one failure)."""
    env = dict(os.environ)
    env["TRACEML"] = "0"  # the child only reads files: the report itself is not traced
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    # The report on this process's stderr: the script's stdout stays its own. In a session
    # of its own: torchrun ends a failed job by signalling each rank's process group, and a
    # rank 0 whose training had ended, waiting here for another rank's file, lost its report
    # with it (the child then ends on its own, after its --wait at most).
    stdout = subprocess.PIPE if through_sys_stderr else _stderr_fd()
    try:
        completed = subprocess.run(
            command, env=env, stdin=subprocess.DEVNULL, stdout=stdout,
            stderr=subprocess.PIPE, text=True, check=False, start_new_session=True,
        )  # fmt: skip
    except KeyboardInterrupt:  # Ctrl-C while it ran (subprocess.run ended it): one line
        console.warn(f"{failure.split(' (')[0]}: interrupted (Ctrl-C)")
        if through_sys_stderr:  # inside the user's training call (a notebook): theirs
            raise
        return
    if completed.stdout:
        sys.stderr.write(completed.stdout)
        sys.stderr.flush()
    if completed.returncode == 0:
        if completed.stderr:
            sys.stderr.write(completed.stderr)
            sys.stderr.flush()
        return
    lines = [line for line in completed.stderr.splitlines() if line.strip()]
    reason = lines[-1].removeprefix("traceml: error: ") if lines else "no message"
    console.warn(f"{failure} exited {completed.returncode}: {reason})")
