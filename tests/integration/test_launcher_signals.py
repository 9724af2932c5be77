"""`traceml run` seen from whoever started it, as `python script.py` would be (rule 1): the
exit status (a script's graceful exit after SIGTERM, death by a signal), every signal a
scheduler sends (SIGUSR1), job control on a terminal (Ctrl-Z stops the job, `fg` continues
it), processes the script leaves running on purpose; and bad TRACEML_* variables refused
before anything runs. Plain Python scripts: no training is needed for the process boundary."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time

import psutil
import pytest

from procs import PYTHON, clean_env, traceml

GRACEFUL = """
import signal, sys, time
def stop(signum, frame):
    print("saving", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGUSR1, lambda s, f: sys.exit(7))
print("ready", flush=True)
time.sleep(60)
"""

# Python's own SIGINT handler set here: a test run from a background job inherits SIGINT
# ignored, and the script would then live through its own SIGINT, traced or not.
SELF_KILL = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
os.kill(os.getpid(), getattr(signal, sys.argv[1]))
"""

LEAVES_A_PROCESS = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c",
    "import time, pathlib; time.sleep(2); pathlib.Path('left_done').touch()"])
"""

SLEEPER = """
import time
print("ready", flush=True)
time.sleep(4)
print("done", flush=True)
"""


def _launch(tmp_path, script: str, *args: str) -> list[str]:
    path = tmp_path / "script.py"
    path.write_text(script)
    logs = tmp_path / "logs"
    return [*traceml("run", "--logs-dir", str(logs), "--no-live", str(path)), *args]


def _plain(tmp_path, script: str, *args: str) -> list[str]:
    path = tmp_path / "script.py"
    path.write_text(script)
    return [PYTHON, str(path), *args]


def _signalled(command: list[str], cwd, sig: signal.Signals) -> tuple[int, str]:
    process = subprocess.Popen(
        command, cwd=cwd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout.readline().strip() == b"ready"
    process.send_signal(sig)
    out, _err = process.communicate(timeout=60)
    return process.returncode, out.decode()


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 0), (signal.SIGUSR1, 7)])
def test_a_signal_reaches_the_script_and_its_exit_code_is_the_launchers(tmp_path, sig, code):
    untraced = _signalled(_plain(tmp_path, GRACEFUL), tmp_path, sig)
    traced = _signalled(_launch(tmp_path, GRACEFUL), tmp_path, sig)
    assert untraced[0] == code
    assert traced[0] == untraced[0]
    assert ("saving" in traced[1]) == ("saving" in untraced[1])


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT", "SIGABRT"])
def test_a_script_killed_by_a_signal_kills_the_launcher_by_it(tmp_path, name):
    untraced = subprocess.run(_plain(tmp_path, SELF_KILL, name), env=clean_env(), cwd=tmp_path)
    traced = subprocess.run(
        _launch(tmp_path, SELF_KILL, "--args", name),
        env=clean_env(),
        cwd=tmp_path,
        capture_output=True,
    )
    assert untraced.returncode == -getattr(signal, name)
    assert traced.returncode == untraced.returncode


def test_what_the_script_leaves_running_lives_on(tmp_path):
    result = subprocess.run(
        _launch(tmp_path, LEAVES_A_PROCESS), env=clean_env(), cwd=tmp_path, capture_output=True
    )
    assert result.returncode == 0
    deadline = time.monotonic() + 30
    while not (tmp_path / "left_done").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (tmp_path / "left_done").exists()


def _job_on_a_terminal(command: list[str], cwd) -> list[str]:
    """Run ``command`` as an interactive shell's foreground job on a new terminal; press
    Ctrl-Z once it says "ready", then `fg` it; what the shell saw, in order."""
    pid, master = pty.fork()
    if pid == 0:  # the "shell": session leader on the pty
        try:
            os.chdir(cwd)
            signal.signal(signal.SIGTTOU, signal.SIG_IGN)
            job = os.fork()
            if job == 0:
                os.setpgid(0, 0)
                os.tcsetpgrp(0, os.getpgrp())
                signal.signal(signal.SIGTTOU, signal.SIG_DFL)
                os.execve(command[0], command, clean_env())
            os.setpgid(job, job)
            seen = []
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                done, status = os.waitpid(job, os.WUNTRACED | os.WNOHANG)
                if not done:
                    time.sleep(0.05)
                    continue
                if os.WIFSTOPPED(status):
                    seen.append("stopped")
                    os.tcsetpgrp(0, job)  # fg
                    os.killpg(job, signal.SIGCONT)
                    continue
                seen.append(f"exit {os.waitstatus_to_exitcode(status)}")
                break
            else:  # the job never ended: leave nothing behind (the script has a group of its own)
                for process in [*psutil.Process(job).children(recursive=True), psutil.Process(job)]:
                    process.kill()
            os.write(1, ("SHELL " + json.dumps(seen) + "\n").encode())  # fd 1: the pty
        finally:
            os._exit(0)
    out, pressed, started = b"", False, time.monotonic()
    while time.monotonic() - started < 90:
        ready, _, _ = select.select([master], [], [], 0.1)
        if not ready:
            continue
        try:
            data = os.read(master, 4096)
        except OSError:
            break
        if not data:
            break
        out += data
        if not pressed and b"ready" in out:
            os.write(master, b"\x1a")  # Ctrl-Z
            pressed = True
    os.waitpid(pid, 0)
    [line] = [x for x in out.decode(errors="replace").splitlines() if x.startswith("SHELL ")]
    return json.loads(line[len("SHELL ") :])


@pytest.mark.skipif(sys.platform != "linux", reason="a pseudo-terminal's job control")
def test_ctrl_z_stops_the_job_and_fg_continues_it(tmp_path):
    untraced = _job_on_a_terminal(_plain(tmp_path, SLEEPER), tmp_path)
    traced = _job_on_a_terminal(_launch(tmp_path, SLEEPER), tmp_path)
    assert untraced == ["stopped", "exit 0"]
    assert traced == untraced


@pytest.mark.parametrize(
    ("env", "args", "words"),
    [
        ({"TRACEML_TRACE_MAX_STEPS": "abc"}, [], "TRACEML_TRACE_MAX_STEPS"),
        ({}, ["--master-port", "99999", "--nproc-per-node", "2"], "--master-port"),
    ],
)
def test_bad_settings_are_refused_before_the_script_runs(tmp_path, env, args, words):
    script = tmp_path / "script.py"
    script.write_text("open('ran', 'w').close()\n")
    result = subprocess.run(
        traceml("run", *args, "--logs-dir", str(tmp_path / "logs"), str(script)),
        env=clean_env(**env),
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert words in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "ran").exists()
