"""The live view with real processes: `traceml run` in a real terminal (tmux) and piped,
`traceml watch` on a run in progress, on a finished run, and on files written by hand."""

from __future__ import annotations

import os
import queue
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import orjson
import pytest

from traceml import schema

from procs import PYTHON, TINY, clean_env, only_run_dir, rank_records, run, steps_of, traceml
from rankfiles import footer, header, step

# Generous bounds on waiting, never assertions about how long anything took.
DEADLINE_S = 240

PANEL_FIRST = re.compile(r"^traceml (\S+) \[[^\]]*\] \| steps r0=(\d+)")
# One write a line: print() writes the text and its newline apart, and Lightning's own stderr
# lines (another thread) can land between the two, untraced too ("CHATTY line 11TPU available").
CHATTY_SCRIPT = """
import runpy, sys, threading, time

def chatter():
    index = 0
    while True:
        sys.stdout.write(f"CHATTY line {index}\\n")
        sys.stdout.flush()
        index += 1
        time.sleep(0.3)

threading.Thread(target=chatter, daemon=True).start()
runpy.run_path("tiny_lightning.py", run_name="__main__")
"""


@pytest.fixture
def tiny(tmp_path):
    target = tmp_path / "tiny_lightning.py"
    shutil.copy(TINY, target)
    return target


def live_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("traceml live ")]


def steps_in(line: str, rank: int = 0) -> int:
    match = re.search(rf"\br{rank}=(\d+)", line)
    assert match, line
    return int(match.group(1))


# ----------------------------------------------------------------------------------------------
# traceml run


def test_run_with_stderr_piped_prints_plain_periodic_lines(tmp_path, tiny):
    env = clean_env(
        TINY_BATCHES=50, TINY_STEP_SLEEP_MS=100, TINY_VALIDATE=0, TRACEML_LIVE_COLLECT_S=1
    )
    result = run(
        traceml("run", tiny, "--logs-dir", tmp_path / "logs", "--live-interval", "1"),
        env,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stderr and "\x1b" not in result.stdout
    first = result.stderr.splitlines()[0]
    assert first.startswith("traceml: run directory logs/tiny_lightning-")
    assert "traceml watch logs/tiny_lightning-" in first
    lines = live_lines(result.stderr)
    with_steps = [line for line in lines if "r0=" in line]
    assert len(with_steps) >= 2, result.stderr
    counts = [steps_in(line) for line in with_steps]
    assert counts == sorted(counts) and counts[-1] > counts[0]  # the lines follow the run
    assert any("provisional verdict (last " in line for line in lines), result.stderr
    # The end-of-run report is untouched: the last thing on stderr, after the live lines.
    assert result.stderr.rstrip().splitlines()[-1].startswith("Summary: ")
    assert "Verdict: RESIDUAL-HEAVY" in result.stderr


def test_no_live_prints_no_live_lines(tmp_path, tiny):
    env = clean_env(TINY_BATCHES=14, TINY_STEP_SLEEP_MS=100, TINY_VALIDATE=0)
    result = run(
        traceml("run", tiny, "--logs-dir", tmp_path / "logs", "--no-live", "--live-interval", "1"),
        env,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "live view off" in result.stderr and live_lines(result.stderr) == []
    records = rank_records(only_run_dir(tmp_path / "logs"))  # traced, with no live line
    assert records[-1]["status"] == schema.STATUS_COMPLETED and len(steps_of(records)) == 14


def in_script_pty(command: list, tmp_path: Path, env: dict[str, str], size: str | None) -> str:
    """``command`` in a real pseudo-terminal made by ``script`` (util-linux) started from a
    non-terminal, as CI runners and ``docker exec`` without ``-t`` do: the terminal is 0x0
    unless ``size`` ("ROWS COLS") is set with stty first. Returns everything it printed."""
    shell = " ".join(f"'{a}'" for a in command)
    if size is not None:
        rows, cols = size.split()
        shell = f"stty rows {rows} cols {cols}; {shell}"
    else:
        shell = f"stty size; {shell}"  # shows the 0x0 the test relies on
    done = subprocess.run(
        ["script", "-q", "-e", "-c", shell, "/dev/null"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        errors="replace",
        env={**env, "TERM": "xterm"},
        cwd=tmp_path,
        timeout=DEADLINE_S,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    return done.stdout.replace("\r\n", "\n")


def test_run_in_a_zero_sized_pty_falls_back_to_plain_lines_early(tmp_path, tiny):
    # Issue 25: a 0x0 pseudo-terminal said "live view below" and then showed nothing at all.
    # Default interval (30 s) and collect time: a ~15 s run still gets its numbers as soon as
    # the warm-up is over and its provisional verdict when the window allows it.
    if shutil.which("script") is None:
        pytest.skip("script (util-linux) is not installed")
    env = clean_env(TINY_BATCHES=150, TINY_STEP_SLEEP_MS=100, TINY_VALIDATE=0)
    out = in_script_pty(traceml("run", tiny, "--logs-dir", tmp_path / "logs"), tmp_path, env, None)
    assert out.splitlines()[0].strip() == "0 0", out[:200]
    assert "live lines once warmed up, then every 30 s" in out and "live view below" not in out
    assert "\x1b[1;" not in out  # no scroll region: no panel
    lines = live_lines(out)
    numbers = [line for line in lines if "median step" in line]
    assert numbers, out[-3000:]
    assert any("provisional verdict (last " in line for line in lines), out[-3000:]
    assert "Verdict: RESIDUAL-HEAVY" in out


def test_run_in_a_sized_pty_draws_the_panel(tmp_path, tiny):
    if shutil.which("script") is None:
        pytest.skip("script (util-linux) is not installed")
    env = clean_env(TINY_BATCHES=30, TINY_STEP_SLEEP_MS=100, TINY_VALIDATE=0)
    out = in_script_pty(
        traceml("run", tiny, "--logs-dir", tmp_path / "logs"), tmp_path, env, "40 120"
    )
    assert "live view below" in out
    assert "\x1b[1;37r" in out  # the scroll region above a 3-line panel on 40 rows
    assert live_lines(out) == []  # a panel, not plain lines
    assert "Verdict: " in out


class Tmux:
    """A private tmux server (its own socket) with one pane of a fixed size."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        self.socket = f"traceml-test-{os.getpid()}-{tmp_path.name}"
        self.env = env

    def __call__(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-L", self.socket, *args],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout

    def screen(self) -> list[str]:
        return self("capture-pane", "-p", "-t", "live").splitlines()

    def history(self) -> str:
        return self("capture-pane", "-p", "-J", "-S", "-2000", "-t", "live")

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], env=self.env, timeout=30)


def test_run_in_a_terminal_redraws_a_panel_below_the_scripts_output(tmp_path, tiny):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (scripts/env.sh installs it)")
    (tmp_path / "chatty.py").write_text(CHATTY_SCRIPT)
    env = clean_env(
        TINY_BATCHES=60, TINY_STEP_SLEEP_MS=100, TINY_VALIDATE=0, TRACEML_LIVE_COLLECT_S=1
    )
    env.pop("TMUX", None)
    command = (
        f"cd {tmp_path} && {traceml('run')[0]} run chatty.py --logs-dir logs; "
        "echo TRACEML_DONE=$?; sleep 600"
    )
    tmux = Tmux(tmp_path, env)
    rows = 30
    try:
        tmux("new-session", "-d", "-s", "live", "-x", "110", "-y", str(rows), command)
        seen_counts: list[int] = []
        mid_screens = []
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            screen = tmux.screen()
            if any(line.startswith("TRACEML_DONE=") for line in screen):
                break
            panel = [PANEL_FIRST.match(line) for line in screen]
            where = [index for index, match in enumerate(panel) if match]
            if where:
                mid_screens.append(screen)
                count = int(panel[where[0]].group(2))
                if not seen_counts or count != seen_counts[-1]:
                    seen_counts.append(count)
            time.sleep(0.3)
        else:
            pytest.fail("traceml run did not finish:\n" + tmux.history())
        history = tmux.history()
    finally:
        tmux.kill()

    # The panel appeared and was redrawn with the run's progress.
    assert len(seen_counts) >= 2, history
    assert seen_counts == sorted(seen_counts)
    for screen in mid_screens:
        # Pinned to the bottom three rows, the script's lines above it, none of them garbled.
        assert len(screen) == rows
        assert PANEL_FIRST.match(screen[rows - 3]), screen
        for line in screen[: rows - 3]:
            assert not PANEL_FIRST.match(line), screen
            if "CHATTY" in line:
                assert re.fullmatch(r"CHATTY line \d+", line.rstrip()), screen
    assert any(any("CHATTY line" in line for line in screen) for screen in mid_screens), (
        "the script's own output did not show while the panel was up"
    )
    assert any("provisional verdict (last" in "\n".join(screen) for screen in mid_screens), (
        mid_screens[-1]
    )

    # Afterwards: the panel is gone and the report follows the script's output intact.
    lines = history.splitlines()
    done = max(i for i, line in enumerate(lines) if line.startswith("TRACEML_DONE="))
    assert lines[done] == "TRACEML_DONE=0"
    report = "\n".join(lines[:done])
    assert "TINY_RESULT global_step=60 traceml_callbacks=1" in report, history
    assert "Phase breakdown per optimizer step (after warm-up)" in report
    assert lines[done - 1].startswith("Summary: ")
    after_panel = report[report.index("Verdict: ") :]
    assert not any(PANEL_FIRST.match(line) for line in after_panel.splitlines())


# ----------------------------------------------------------------------------------------------
# traceml watch


class Lines:
    """A process's stdout, line by line, read in a thread so a test can wait with a bound."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, predicate, what: str) -> str:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            self.seen.append(line)
            if predicate(line):
                return line
        pytest.fail(f"never saw {what}; output so far:\n" + "\n".join(self.seen))

    def rest(self) -> list[str]:
        assert self.process.wait(timeout=DEADLINE_S) == 0, "\n".join(self.seen)
        while (line := self._queue.get(timeout=DEADLINE_S)) is not None:
            self.seen.append(line)
        return self.seen


def start_watch(run_dir: Path, cwd: Path, env: dict[str, str], *extra: str) -> Lines:
    process = subprocess.Popen(
        [str(part) for part in traceml("watch", str(run_dir), "--interval", "0.5", *extra)],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return Lines(process)


@pytest.fixture(scope="module")
def direct_run(tmp_path_factory):
    """A direct launch (TRACEML=1 python, no launcher) followed by `traceml watch` from the
    moment its run directory exists."""
    tmp_path = tmp_path_factory.mktemp("direct")
    shutil.copy(TINY, tmp_path / "tiny_lightning.py")
    env = clean_env(TRACEML_LIVE_COLLECT_S=1)
    training = subprocess.Popen(
        [PYTHON, "tiny_lightning.py"],
        env=clean_env(
            TRACEML=1,
            TRACEML_LOGS_DIR=tmp_path / "logs",
            TRACEML_RUN_NAME="direct",
            TINY_BATCHES=60,
            TINY_STEP_SLEEP_MS=100,
            TINY_VALIDATE=0,
        ),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run_dir = tmp_path / "logs" / "direct"
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not (run_dir / "ranks").is_dir():
            assert training.poll() is None, training.stdout.read()
            assert time.monotonic() < deadline, "the run directory never appeared"
            time.sleep(0.1)
        watcher = start_watch(run_dir, tmp_path, env, "--html", "live.html")
        watched = watcher.rest()
        training_output, _ = training.communicate(timeout=DEADLINE_S)
    finally:
        if training.poll() is None:
            training.kill()
    assert training.returncode == 0, training_output
    return {"dir": tmp_path, "run_dir": run_dir, "watched": watched, "env": env}


def test_watch_follows_a_direct_launch_until_its_ranks_finish(direct_run):
    watched = direct_run["watched"]
    text = "\n".join(watched)
    assert watched[0].startswith("traceml: watching logs/direct"), text
    progress = [line for line in live_lines(text) if "r0=" in line]
    assert progress, text  # it saw the run in progress
    assert all(steps_in(line) <= 60 for line in progress)
    assert "steps r0=60" in text and "verdict (whole run): RESIDUAL-HEAVY" in text
    assert watched[-2] == "traceml: the run has ended; full report: traceml report logs/direct"
    assert watched[-1] == "traceml: wrote live.html"
    assert "\x1b" not in text
    page = (direct_run["dir"] / "live.html").read_text()
    assert "RESIDUAL" in page and 'http-equiv="refresh"' not in page


def test_watch_on_a_finished_run_prints_the_final_state_and_exits(direct_run):
    result = run(
        traceml("watch", direct_run["run_dir"], "--interval", "0.5"),
        direct_run["env"],
        direct_run["dir"],
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert live_lines(result.stdout) == []  # no following: the final state straight away
    assert lines[0].startswith("traceml direct [") and "steps r0=60" in lines[0]
    assert "verdict (whole run): RESIDUAL-HEAVY" in lines[2]
    assert lines[-1].startswith("traceml: the run has ended")


def test_watch_reads_a_half_written_line_and_a_rank_1_file_that_appears_late(tmp_path):
    """Files written by hand, step by step, while a real `traceml watch` follows them."""
    ranks = tmp_path / "run" / "ranks"
    ranks.mkdir(parents=True)
    rank0, rank1 = ranks / "rank_0.jsonl", ranks / "rank_1.jsonl"

    def lines_of(rank: int, start: int, count: int) -> bytes:
        return b"".join(
            orjson.dumps(
                step(index, t_ms=index * 101.0, input=50.0, forward=25.0, backward=25.0),
                option=orjson.OPT_APPEND_NEWLINE,
            )
            for index in range(start, start + count)
        )

    def append(path: Path, data: bytes) -> None:
        with open(path, "ab") as handle:
            handle.write(data)
            handle.flush()

    partial = lines_of(0, 12, 1)
    append(rank0, orjson.dumps(header(0, 2), option=orjson.OPT_APPEND_NEWLINE))
    append(rank0, lines_of(0, 0, 12) + partial[:30])  # the 13th step is half written
    watcher = start_watch(tmp_path / "run", tmp_path, clean_env(TRACEML_LIVE_COLLECT_S=0))
    waiting = watcher.wait_for(lambda line: "r0=" in line, "rank 0's steps")
    assert "steps r0=12 | no file yet: r1" in waiting
    assert "collecting" in waiting  # rank 1 has no steps yet: no verdict

    append(rank0, partial[30:] + lines_of(0, 13, 7))
    append(rank1, orjson.dumps(header(1, 2), option=orjson.OPT_APPEND_NEWLINE))
    append(rank1, lines_of(1, 0, 20))
    both = watcher.wait_for(lambda line: "r1=20" in line and "r0=20" in line, "both ranks")
    assert "no file yet" not in both
    assert "provisional verdict (last 18 steps/rank): INPUT-BOUND" in both

    append(rank0, orjson.dumps(footer(20), option=orjson.OPT_APPEND_NEWLINE))
    append(rank1, orjson.dumps(footer(20), option=orjson.OPT_APPEND_NEWLINE))
    seen = watcher.rest()
    assert "verdict (whole run): INPUT-BOUND" in "\n".join(seen)
    assert seen[-1].startswith("traceml: the run has ended")
