"""`traceml run` seen from whoever started it, as `python script.py` would be (rule 1): the
exit status (a script's graceful exit after SIGTERM, death by a signal), every signal a
scheduler sends (SIGUSR1), job control on a terminal (Ctrl-Z stops the job, `fg` continues
it), Ctrl-C reaching a caller that runs `traceml run` in a loop, signals the caller ignores,
processes the script leaves running on purpose (and none left by a launcher killed by
SIGKILL), the script's core dump the only one; and bad TRACEML_* variables refused before
anything runs. Plain Python scripts: no training is needed for the process boundary."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import resource
import select
import signal
import subprocess
import sys
import time

import psutil
import pytest

from procs import PYTHON, clean_env, only_run_dir, traceml

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

# Counts its SIGINTs: a second one (the terminal's, then the launcher's) would show.
COUNTS_INTERRUPTS = """
import signal, sys, time
got = []
signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
print("ready", flush=True)
deadline = time.monotonic() + 30
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(1)  # room for a second SIGINT, were one sent
print("script got", len(got), flush=True)
sys.exit(3)
"""

# A caller that is not a shell (a sweep, a supervisor): runs its argv, waits for it, and says
# whether the terminal's Ctrl-C reached it too.
CALLER = """
import subprocess, sys
child = subprocess.Popen(sys.argv[1:])
interrupted = False
while child.returncode is None:
    try:
        child.wait()
    except KeyboardInterrupt:
        interrupted = True
print("caller interrupted" if interrupted else "caller went on", child.returncode, flush=True)
"""

PRINTS_ITS_PID = """
import os, time
print(os.getpid(), flush=True)
time.sleep(60)
"""

# Says, once the test has sent the signal, whether it still ignores it.
IGNORES = """
import signal, sys, time
sig = getattr(signal, sys.argv[1])
print("ready", flush=True)
time.sleep(2)
print("ignored" if signal.getsignal(sig) == signal.SIG_IGN else "handled", flush=True)
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


def _job_on_a_terminal(
    command: list[str], cwd, key: bytes = b"\x1a"
) -> tuple[list[str], list[str]]:
    """Run ``command`` as an interactive shell's foreground job on a new terminal; press
    ``key`` (Ctrl-Z unless told) once it says "ready", and `fg` the job each time it stops;
    what the shell saw, in order, and the lines the job printed."""
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
                signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background test run ignores it
                os.execve(command[0], command, clean_env())
            # As a shell does, on both sides: EACCES here means the job ran its own setpgid
            # and exec'd already.
            with contextlib.suppress(PermissionError):
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
        # The whole line: the key flushes what the terminal has not passed on yet, and a
        # "ready" read before its "\r\n" would lose the line's end, joining it to the next.
        if not pressed and b"ready\r\n" in out:
            os.write(master, key)
            pressed = True
    os.waitpid(pid, 0)
    # Without the terminal's echo of the key (^C, ^Z), which may land on any line.
    echo = "^" + chr(key[0] + 64)
    lines = [x.replace(echo, "").strip() for x in out.decode(errors="replace").splitlines()]
    [line] = [x for x in lines if x.startswith("SHELL ")]
    return json.loads(line[len("SHELL ") :]), lines


@pytest.mark.skipif(sys.platform != "linux", reason="a pseudo-terminal's job control")
def test_ctrl_z_stops_the_job_and_fg_continues_it(tmp_path):
    untraced, _lines = _job_on_a_terminal(_plain(tmp_path, SLEEPER), tmp_path)
    traced, _lines = _job_on_a_terminal(_launch(tmp_path, SLEEPER), tmp_path)
    assert untraced == ["stopped", "exit 0"]
    assert traced == untraced


# Ctrl-C in a loop, make or a sweep: the caller, not a shell, leads the terminal's job, and the
# script was given the terminal to itself, so only the script was interrupted and the caller
# went on to its next run; the script has it once, as untraced (not also from the launcher).
@pytest.mark.skipif(sys.platform != "linux", reason="a pseudo-terminal's job control")
def test_ctrl_c_reaches_the_caller_of_the_launcher_and_the_script_once(tmp_path):
    caller = [PYTHON, "-c", CALLER]
    _seen, untraced = _job_on_a_terminal(
        [*caller, *_plain(tmp_path, COUNTS_INTERRUPTS)], tmp_path, key=b"\x03"
    )
    _seen, traced = _job_on_a_terminal(
        [*caller, *_launch(tmp_path, COUNTS_INTERRUPTS)], tmp_path, key=b"\x03"
    )
    said = ("script got", "caller")
    expected = ["script got 1", "caller interrupted 3"]
    assert [x for x in untraced if x.startswith(said)] == expected, untraced
    assert [x for x in traced if x.startswith(said)] == expected, traced


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_the_script_dies_with_a_launcher_killed_by_sigkill(tmp_path):
    launcher = subprocess.Popen(
        _launch(tmp_path, PRINTS_ITS_PID),
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    script = psutil.Process(int(launcher.stdout.readline()))
    launcher.kill()
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 30
    try:
        while script.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.1)
        orphaned = script.status() != psutil.STATUS_ZOMBIE
        if orphaned:
            script.kill()  # leave nothing behind
    except psutil.NoSuchProcess:
        orphaned = False
    finally:
        launcher.stdout.close()
    assert not orphaned


def _started_after(before_exec, command: list[str], cwd, stdout) -> subprocess.Popen:
    """``command`` started with ``before_exec()`` run in its process (a limit, a disposition
    the launcher then inherits as from its caller)."""
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=clean_env(),
        stdout=stdout,
        stderr=subprocess.DEVNULL,
        preexec_fn=before_exec,
    )


def _allow_core_dumps() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _core_dumped(command: list[str], cwd) -> tuple[int, bool, int]:
    """The signal that killed ``command``, run with core dumps allowed, whether it dumped its
    core, and how many core files it left in ``cwd`` (none where the kernel's core_pattern
    hands cores to a program)."""
    process = _started_after(_allow_core_dumps, command, cwd, subprocess.DEVNULL)
    _pid, status = os.waitpid(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    cores = list(cwd.glob("core*"))
    for core in cores:
        core.unlink()
    return -process.returncode, os.WCOREDUMP(status), len(cores)


# The launcher ends by the script's signal; a core-dumping one dumped the launcher's core too,
# over the script's ./core.
@pytest.mark.skipif(sys.platform != "linux", reason="core dumps as Linux reports them")
def test_a_script_dumping_its_core_leaves_the_only_core(tmp_path):
    if resource.getrlimit(resource.RLIMIT_CORE)[1] != resource.RLIM_INFINITY:
        pytest.skip("core dumps are limited here")
    untraced = _core_dumped(_plain(tmp_path, SELF_KILL, "SIGSEGV"), tmp_path)
    if untraced[:2] != (signal.SIGSEGV, True):
        pytest.skip(f"no core dump here: {untraced}")
    traced = _core_dumped(_launch(tmp_path, SELF_KILL, "--args", "SIGSEGV"), tmp_path)
    # The launcher dumps none; the script's own core is there as it is untraced.
    assert traced == (signal.SIGSEGV, False, untraced[2])


def _ignoring(sig: signal.Signals):
    def ignore() -> None:
        signal.signal(sig, signal.SIG_IGN)

    return ignore


def _sent_while_ignored(command: list[str], cwd, sig: signal.Signals) -> tuple[int, str]:
    process = _started_after(_ignoring(sig), command, cwd, subprocess.PIPE)
    assert process.stdout.readline().strip() == b"ready"
    process.send_signal(sig)
    out, _err = process.communicate(timeout=60)
    return process.returncode, out.decode().strip()


# nohup's SIGHUP, SIGINT for a non-interactive shell's `&` job: the launcher caught them, passed
# them on and called the run interrupted.
@pytest.mark.parametrize("name", ["SIGHUP", "SIGINT"])
def test_a_signal_the_caller_ignores_stays_ignored(tmp_path, name):
    sig = getattr(signal, name)
    untraced = _sent_while_ignored(_plain(tmp_path, IGNORES, name), tmp_path, sig)
    traced = _sent_while_ignored(_launch(tmp_path, IGNORES, "--args", name), tmp_path, sig)
    assert untraced == (0, "ignored")
    assert traced == untraced
    manifest = json.loads((only_run_dir(tmp_path / "logs") / "manifest.json").read_text())
    assert manifest["signal"] is None


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
