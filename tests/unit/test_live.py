"""The live view without torch: incremental reading, the view's numbers, its text, the CLI."""

from __future__ import annotations

import fcntl
import os
import struct
import termios
import time
from pathlib import Path

import orjson
import pytest

from traceml import schema
from traceml.analysis.diagnose import diagnose
from traceml.analysis.reduce import RankRecords, reduce_records
from traceml.cli import main
from traceml.present import live
from traceml.present.live import (
    COLLECTING,
    FINAL,
    PROVISIONAL,
    WAITING,
    RankTail,
    RunFollower,
    build_view,
    render_line,
    render_panel,
    window_summary,
)

from rankfiles import footer, header, step, synthetic_run, write_rank


def line(record: dict) -> bytes:
    return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)


def steps_bytes(start: int, count: int, step_ms: float = 100.0, **phases: float) -> bytes:
    """``count`` step lines from index ``start``, back to back on the rank's clock."""
    phases = phases or {"input": 10.0, "forward": 45.0, "backward": 45.0}
    scale = step_ms / sum(phases.values())
    scaled = {key: value * scale for key, value in phases.items()}
    return b"".join(
        line(step(index, t_ms=index * (step_ms + 0.5), **scaled))
        for index in range(start, start + count)
    )


def rank_path(run_dir: Path, rank: int) -> Path:
    path = run_dir / schema.RANKS_DIR / schema.rank_file_name(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as handle:
        handle.write(data)


# ----------------------------------------------------------------------------------------------
# Reading


def test_feed_keeps_a_half_written_line_until_its_newline_arrives():
    tail = RankTail(rank=0, path=Path("rank_0.jsonl"))
    data = line(header()) + steps_bytes(0, 3)
    cut = len(data) - 25  # the last step line is half written
    assert tail.feed(data[:cut]) == 3  # header + two complete steps
    assert tail.steps == 2 and tail.bad_lines == 0 and tail.pending
    assert tail.feed(data[cut:]) == 1
    assert tail.steps == 3 and tail.bad_lines == 0 and tail.pending == b""


def test_damaged_lines_are_counted_and_skipped():
    tail = RankTail(rank=0, path=Path("rank_0.jsonl"))
    tail.feed(line(header()) + b'{"kind": "st\n' + steps_bytes(0, 2) + b"[1, 2]\n")
    assert tail.steps == 2 and tail.bad_lines == 2


def test_follower_reads_only_the_appended_bytes(tmp_path):
    path = rank_path(tmp_path, 0)
    path.write_bytes(line(header()) + steps_bytes(0, 10))
    follower = RunFollower(tmp_path)
    assert follower.poll()
    assert follower.bytes_read == path.stat().st_size
    assert follower.ranks[0].steps == 10

    before = follower.bytes_read
    assert not follower.poll()  # nothing new: nothing read
    assert follower.bytes_read == before

    more = steps_bytes(10, 5)
    append(path, more)
    assert follower.poll()
    assert follower.bytes_read - before == len(more)
    assert follower.ranks[0].steps == 15


def test_half_written_last_line_in_a_file_is_read_once_complete(tmp_path):
    path = rank_path(tmp_path, 0)
    whole = line(header()) + steps_bytes(0, 12)
    path.write_bytes(whole[:-40])
    follower = RunFollower(tmp_path)
    follower.poll()
    assert follower.ranks[0].steps == 11 and follower.ranks[0].bad_lines == 0
    append(path, whole[-40:])
    follower.poll()
    assert follower.ranks[0].steps == 12 and follower.ranks[0].bad_lines == 0


def test_a_long_backlog_costs_a_head_and_a_tail_not_the_whole_file(tmp_path):
    path = rank_path(tmp_path, 0)
    total = 20_000
    path.write_bytes(line(header()) + steps_bytes(0, total) + line(footer(total)))
    size = path.stat().st_size
    assert size > 4 * (live._HEAD_BYTES + 2 * live._TAIL_BYTES)  # the test means something
    follower = RunFollower(tmp_path, window=50)
    follower.poll()
    tail = follower.ranks[0]
    assert follower.bytes_read <= live._HEAD_BYTES + live._TAIL_BYTES
    assert tail.steps == total  # from the records' own step index, not from counting lines
    assert tail.first_t_ms == 0.0  # the head was read
    assert tail.header is not None and tail.closed
    assert len(tail.recent) == 50  # memory: the window
    assert [r[schema.STEP_INDEX] for r in tail.recent] == list(range(total - 50, total))


def test_window_is_bounded_while_following(tmp_path):
    path = rank_path(tmp_path, 0)
    path.write_bytes(line(header()))
    follower = RunFollower(tmp_path, window=30)
    for start in range(0, 300, 50):
        append(path, steps_bytes(start, 50))
        follower.poll()
    assert follower.ranks[0].steps == 300 and len(follower.ranks[0].recent) == 30


def test_rank_file_appearing_late(tmp_path):
    rank_path(tmp_path, 0).write_bytes(line(header(0, 2)) + steps_bytes(0, 20))
    follower = RunFollower(tmp_path)
    follower.poll()
    view = build_view(follower.ranks, run="r", collect_s=0)
    assert view.world_size == 2 and view.missing_ranks == [1]
    assert view.state == COLLECTING and "rank 1" in view.collecting
    assert "no file yet: r1" in render_line(view)
    assert not follower.finished()

    rank_path(tmp_path, 1).write_bytes(line(header(1, 2)) + steps_bytes(0, 20))
    assert follower.poll()
    view = build_view(follower.ranks, run="r", collect_s=0)
    assert view.missing_ranks == [] and view.rank_steps == {0: 20, 1: 20}
    assert view.state == PROVISIONAL


def test_finished_when_every_rank_has_a_footer_or_the_launcher_ended(tmp_path):
    rank_path(tmp_path, 0).write_bytes(line(header(0, 2)) + steps_bytes(0, 3) + line(footer(3)))
    rank_path(tmp_path, 1).write_bytes(line(header(1, 2)) + steps_bytes(0, 3))
    follower = RunFollower(tmp_path)
    follower.poll()
    assert not follower.finished()
    (tmp_path / schema.MANIFEST_JSON).write_bytes(orjson.dumps({"ended_at": None}))
    follower.poll()
    assert not follower.finished()
    (tmp_path / schema.MANIFEST_JSON).write_bytes(orjson.dumps({"ended_at": "now", "x": 1}))
    follower.poll()
    assert follower.finished()


def test_a_rank_whose_process_is_gone_counts_as_dead(tmp_path):
    rank_path(tmp_path, 0).write_bytes(line(header(0, 1)) + steps_bytes(0, 3))
    now = [100.0]
    gone = {"answer": False}
    follower = RunFollower(
        tmp_path, clock=lambda: now[0], is_process_gone=lambda _header: gone["answer"]
    )
    follower.poll()
    now[0] += 60
    follower.poll()
    assert not follower.ranks[0].dead  # silent, but its process is alive: a slow step
    gone["answer"] = True
    follower.poll()
    assert follower.ranks[0].dead and follower.finished()
    view = build_view(follower.ranks, run="r")
    assert view.dead_ranks == [0] and "died: r0" in render_line(view)


def test_process_gone_checks_the_pid_on_this_host_only():
    import socket
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    here = socket.gethostname()
    assert live.process_gone({schema.PID: child.pid, schema.HOST: here})
    assert not live.process_gone({schema.PID: os.getpid(), schema.HOST: here})
    assert not live.process_gone({schema.PID: child.pid, schema.HOST: here + "-elsewhere"})


# ----------------------------------------------------------------------------------------------
# The view


def follow(run_dir: Path, window: int = live.DEFAULT_WINDOW) -> RunFollower:
    follower = RunFollower(run_dir, window=window)
    follower.poll()
    return follower


def test_collecting_until_warmup_plus_min_steps(tmp_path):
    path = rank_path(tmp_path, 0)
    path.write_bytes(line(header()) + steps_bytes(0, 11))  # warm-up 2 + min 10 = 12 needed
    follower = follow(tmp_path)
    view = build_view(follower.ranks, run="r", collect_s=0)
    assert view.state == COLLECTING and view.verdict_kind is None
    assert "11/12 steps" in view.collecting
    assert "collecting" in render_line(view)
    append(path, steps_bytes(11, 1))
    follower.poll()
    assert build_view(follower.ranks, run="r", collect_s=0).state == PROVISIONAL


def test_collecting_until_the_run_has_trained_collect_s(tmp_path):
    # 100 steps of 100.5 ms on the rank's clock: ~10 s of training.
    rank_path(tmp_path, 0).write_bytes(line(header()) + steps_bytes(0, 100))
    follower = follow(tmp_path)
    assert build_view(follower.ranks, run="r", collect_s=11).state == COLLECTING
    assert build_view(follower.ranks, run="r", collect_s=9).state == PROVISIONAL
    # The default is 10 s (issue 25: 60 s hid the verdict on every run under a minute).
    assert build_view(follower.ranks, run="r", collect_s=60).collecting == "10/60 s of training"
    assert build_view(follower.ranks, run="r").state == PROVISIONAL


def test_waiting_before_any_rank_file_or_step(tmp_path):
    (tmp_path / schema.RANKS_DIR).mkdir()
    follower = follow(tmp_path)
    view = build_view(follower.ranks, run="r")
    assert view.state == WAITING and "first rank file" in render_line(view)
    rank_path(tmp_path, 0).write_bytes(line(header()))
    follower.poll()
    view = build_view(follower.ranks, run="r")
    assert view.state == WAITING and "first step" in render_line(view)


def test_provisional_verdict_is_diagnose_on_the_recent_window_only(tmp_path):
    # The first 150 steps are input-bound, the last 100 compute-bound: the window (100 steps)
    # sees only the latter, the whole run would say INPUT-BOUND.
    path = rank_path(tmp_path, 0)
    path.write_bytes(
        line(header())
        + steps_bytes(0, 150, input=70.0, forward=15.0, backward=15.0)
        + steps_bytes(150, 100, input=5.0, forward=50.0, backward=45.0)
    )
    follower = follow(tmp_path, window=100)
    view = build_view(follower.ranks, run="r", collect_s=0)
    assert view.state == PROVISIONAL and view.window_steps == 100
    assert view.verdict_kind == "COMPUTE_BOUND"
    assert "provisional verdict (last 100 steps/rank): COMPUTE-BOUND" in render_line(view)

    # Exactly what diagnose says about reduce_records of those 100 steps.
    data = RankRecords(rank=0, path=path, header=header())
    for name, column in data.columns.items():
        column.extend(r.get(name) for r in follower.ranks[0].recent)
    expected = diagnose(reduce_records([data], thresholds={"warmup_steps": 0}))
    assert view.verdict_kind == expected[0]["kind"] and view.verdict_why == expected[0]["why"]
    assert view.shares[schema.INPUT_WAIT] == pytest.approx(0.05)


def test_window_leaves_the_warmup_steps_out(tmp_path):
    # Two slow warm-up steps then twelve fast ones: the window's median is the fast one.
    path = rank_path(tmp_path, 0)
    path.write_bytes(line(header()) + steps_bytes(0, 2, step_ms=5000) + steps_bytes(2, 12))
    follower = follow(tmp_path)
    summary = window_summary(follower.ranks)
    assert summary[schema.SUMMARY_STEPS_ANALYSED] == 12
    view = build_view(follower.ranks, run="r", collect_s=0)
    assert view.median_step_ms == pytest.approx(100.0)
    assert view.steps_per_s == pytest.approx(1000 / 100.5, rel=1e-3)


def test_slowest_rank_and_by_how_much(tmp_path):
    # Rank 2 spends 30 ms more in Input Wait each step; Backward is the same everywhere.
    for rank in range(3):
        extra = 30.0 if rank == 2 else 0.0
        rank_path(tmp_path, rank).write_bytes(
            line(header(rank, 3))
            + steps_bytes(0, 40, step_ms=100 + extra, input=10 + extra, forward=45, backward=45)
        )
    view = build_view(follow(tmp_path).ranks, run="r", collect_s=0)
    assert view.slowest_rank == 2
    # Own time = step minus Backward: 85 ms on rank 2 against 55 ms on the others.
    assert view.slowest_ratio == pytest.approx(85 / 55)
    assert "slowest rank 2 +55%" in render_line(view)
    assert view.verdict_kind == "STRAGGLER"


def test_final_view_shows_the_whole_run(tmp_path):
    synthetic_run(tmp_path, steps=60, input=60, forward=20, backward=20)
    follower = follow(tmp_path)
    from traceml.analysis.reduce import reduce_run

    summary = reduce_run(tmp_path)
    summary[schema.SUMMARY_VERDICTS] = diagnose(summary)
    view = build_view(follower.ranks, run="r", final_summary=summary)
    assert view.state == FINAL and view.verdict_kind == "INPUT_BOUND"
    assert "verdict (whole run): INPUT-BOUND" in render_line(view)
    assert "(whole run)" in render_panel(view, 200)[0]


def test_plain_line_has_no_terminal_codes_and_the_panel_fits_the_width(tmp_path):
    for rank in range(8):  # many ranks: the steps column is a range, not a list
        rank_path(tmp_path, rank).write_bytes(line(header(rank, 8)) + steps_bytes(0, 20 + rank))
    view = build_view(follow(tmp_path).ranks, run="a-rather-long-run-name-20261130", collect_s=0)
    text = render_line(view)
    assert "\x1b" not in text and "\n" not in text and "\r" not in text
    assert "8 ranks 20-27 (fewest r0)" in text
    for width in (40, 80, 200):
        panel = render_panel(view, width)
        assert len(panel) == 3 and all(len(row) <= width for row in panel)
    assert render_panel(view, 40)[2].endswith("...")


# ----------------------------------------------------------------------------------------------
# Terminal panel


def test_terminal_panel_pins_itself_under_a_scroll_region():
    master, slave = os.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        panel = live.TerminalPanel(slave, height=3)
        panel.open()
        panel.draw(["first " * 30, "second", "third"])
        panel.close()
        written = b""
        while True:
            try:
                os.set_blocking(master, False)
                chunk = os.read(master, 65536)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            written += chunk
    finally:
        os.close(master)
        os.close(slave)
    text = written.decode()
    assert "\x1b[1;21r" in text  # scrolling confined to rows 1-21
    assert "\x1b[22;1H\x1b[2Kfirst" in text and "\x1b[24;1H\x1b[2Kthird" in text
    drawn = text.split("\x1b[22;1H\x1b[2K", 1)[1].split("\x1b", 1)[0]
    assert len(drawn) <= 79  # never the last column: no wrap, no scroll
    assert text.count("\x1b7") == text.count("\x1b8")  # every cursor save is restored
    assert text.endswith("\x1b8") and "\x1b[r" in text  # closed: whole screen scrolls again


def test_terminal_mode_is_plain_for_a_pipe():
    read_end, write_end = os.pipe()
    try:
        assert live.terminal_mode(write_end) == "plain"
    finally:
        os.close(read_end)
        os.close(write_end)


# ----------------------------------------------------------------------------------------------
# Settings, announcements, CLI


def test_interval_and_collect_from_env():
    assert live.interval_from_env({}) is None
    assert live.interval_from_env({live.ENV_INTERVAL: "5"}) == 5.0
    assert live.collect_from_env({live.ENV_COLLECT: "0"}) == 0.0
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(live.LiveError, match=live.ENV_INTERVAL):
            live.interval_from_env({live.ENV_INTERVAL: bad})


def test_announce_direct_launch_is_one_line_on_stderr(tmp_path, capsys, monkeypatch):
    from traceml import console
    from traceml.capture import run_end

    console.reset_for_tests()
    monkeypatch.chdir(tmp_path)
    run_end.announce_direct_launch(tmp_path / "logs" / "run-1")
    run_end.announce_direct_launch(tmp_path / "logs" / "run-1")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "traceml: tracing into logs/run-1; to watch it live: traceml watch logs/run-1\n"
    )
    console.reset_for_tests()


def test_watch_on_a_finished_run_prints_the_final_state(tmp_path, capsys):
    synthetic_run(tmp_path / "run", steps=40, ranks=2, input=60, forward=20, backward=20)
    html = tmp_path / "live.html"
    assert main(["watch", str(tmp_path / "run"), "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "steps r0=40 r1=40" in out
    assert "verdict (whole run): INPUT-BOUND" in out
    assert "the run has ended" in out and "\x1b" not in out
    page = html.read_text()
    assert "INPUT" in page and 'http-equiv="refresh"' not in page


@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_watch_html_that_cannot_be_written_is_an_error_not_wrote(tmp_path, capsys, where):
    # It printed "traceml: wrote ..." and exited 0 with nothing written.
    synthetic_run(tmp_path / "run", steps=10, ranks=1, input=5, forward=20, backward=20)
    (tmp_path / "afile").write_text("x")
    html = tmp_path if where == "a directory" else tmp_path / "afile" / "live.html"
    assert main(["watch", str(tmp_path / "run"), "--html", str(html)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("traceml: error:") and err.count("\n") == 1


def test_watch_user_errors_are_one_line_exit_2(tmp_path, capsys):
    assert main(["watch", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("traceml: error: ") and err.count("\n") == 1 and "does not exist" in err
    synthetic_run(tmp_path / "logs" / "run-a", steps=5, forward=1)
    assert main(["watch", str(tmp_path / "logs")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "traceml watch" in err and "run-a" in err
    assert main(["watch", str(tmp_path / "logs" / "run-a"), "--interval", "0"]) == 2


def test_run_rejects_a_bad_live_interval(tmp_path, capsys, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    assert main(["run", str(script), "--logs-dir", str(tmp_path), "--live-interval", "0"]) == 2
    assert "--live-interval" in capsys.readouterr().err
    monkeypatch.setenv(live.ENV_INTERVAL, "often")
    assert main(["run", str(script), "--logs-dir", str(tmp_path)]) == 2
    assert live.ENV_INTERVAL in capsys.readouterr().err
    assert not any(tmp_path.glob("train-*"))  # refused before a run directory was made


def test_report_html_says_where_it_was_written(tmp_path, capsys):
    synthetic_run(tmp_path, steps=20, forward=20, backward=20)
    assert main(["report", str(tmp_path), "--html"]) == 0
    err = capsys.readouterr().err
    assert "report.html" in err and (tmp_path / "report.html").is_file()


def test_write_rank_helper_round_trips(tmp_path):
    # The hand-made files this module's tests rely on are read the same by the follower.
    write_rank(tmp_path, 0, [header(), step(0, forward=3.0), footer(1)])
    tail = follow(tmp_path).ranks[0]
    assert tail.steps == 1 and tail.closed and tail.recent[0][schema.FORWARD] == 3.0


def test_plain_lines_come_once_warmed_up_on_changes_and_every_interval():
    # Issue 25: a run under a minute never got past "collecting" in plain lines every 30 s.
    from dataclasses import replace

    from traceml.present.live_terminal import LineSchedule

    waiting = build_view({}, run="r")
    schedule = LineSchedule(30.0, now=0.0)
    assert not schedule.due(waiting, 1.0)  # nothing to say yet
    numbers = replace(waiting, state=COLLECTING, median_step_ms=100.0)
    assert schedule.due(numbers, 2.0)  # the warm-up is over: numbers at once
    assert not schedule.due(numbers, 3.0)
    verdict = replace(numbers, state=PROVISIONAL, verdict_kind="INPUT_BOUND")
    assert schedule.due(verdict, 4.0)  # the provisional verdict at once
    assert not schedule.due(verdict, 33.0)
    assert schedule.due(verdict, 34.0)  # then every interval


def test_a_rank_this_host_cannot_check_ends_once_its_file_is_old(tmp_path):
    # Another host's rank (or a file with no header): the watch waited forever on logs copied
    # from a cluster, though `traceml report` read them at once (review, stop 59).
    rank_path(tmp_path, 0).write_bytes(line(header(0, 3)) + steps_bytes(0, 3))
    rank_path(tmp_path, 1).write_bytes(b"")  # no header yet: a rank in its set-up
    rank_path(tmp_path, 2).write_bytes(b"")  # no header, and already old: copied logs
    age(rank_path(tmp_path, 2))
    now = [100.0]
    follower = RunFollower(tmp_path, clock=lambda: now[0])  # testhost: not this host
    follower.poll()
    now[0] += 60
    follower.poll()
    assert [follower.ranks[r].dead for r in range(3)] == [False, False, True]
    assert not follower.finished()  # rank 0 wrote a minute ago: maybe a long validation
    age(rank_path(tmp_path, 0))
    age(rank_path(tmp_path, 1))
    follower.poll()
    # A set-up may be long (a checkpoint restored, a first compile): never taken as ended.
    assert [follower.ranks[r].dead for r in range(3)] == [True, False, True]
    assert not follower.finished()
    with open(rank_path(tmp_path, 0), "ab") as file:  # it writes again: not ended after all
        file.write(steps_bytes(3, 1))
    follower.poll()
    assert not follower.ranks[0].dead


def age(path) -> None:
    old = time.time() - 700
    os.utime(path, (old, old))


def test_watch_makes_the_view_again_only_when_something_changed(tmp_path, monkeypatch):
    # Made every poll, a quiet 256-rank run cost 0.65 s of CPU a second (helper review).
    path = rank_path(tmp_path, 0)
    path.write_bytes(line(header(0, 1)) + steps_bytes(0, 20))
    follower = RunFollower(tmp_path, is_process_gone=lambda _header: False)
    follower.poll()
    made, polls = [], []

    def counted(*args, **kwargs):
        made.append(len(polls))
        return build_view(*args, **kwargs)

    class Out:
        broken = False
        write = flush = staticmethod(lambda *_: None)

    out = Out()

    def tick(_seconds):
        polls.append(1)
        if len(polls) == 5:
            append(path, steps_bytes(20, 3))  # new steps: the view is made again
        out.broken = len(polls) >= 10

    monkeypatch.setattr(live, "build_view", counted)
    monkeypatch.setattr(live.time, "sleep", tick)
    assert live._follow(follower, None, out, None, 5.0, 1.0, None, 0.0) is False
    assert made == [0, 5]
