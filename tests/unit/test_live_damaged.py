"""The live view (``traceml watch``) on damaged, hostile or odd input, and its way out: damaged
step lines, escape codes in a run name, a rewritten rank file, Ctrl-C at any point, a quiet run,
a reader that went away, a rank that never came, an absurd world size, a run without steps."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from traceml import schema
from traceml.cli import main
from traceml.present import live, live_follow
from traceml.present.live import FINAL, RankTail, RunFollower, build_view, render_line, render_panel

from rankfiles import footer, header, step, write_rank


def line(record: dict) -> bytes:
    return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)


def steps(count: int, start: int = 0, step_ms: float = 100.0) -> list[dict]:
    return [
        step(i, t_ms=i * (step_ms + 1.0), forward=step_ms / 2, backward=step_ms / 2)
        for i in range(start, start + count)
    ]


def rank_file(run_dir: Path) -> Path:
    return run_dir / schema.RANKS_DIR / schema.rank_file_name(0)


# ----------------------------------------------------------------------------------------------
# 1. A damaged step line


@pytest.mark.parametrize(
    "damage",
    [{schema.STEP: "n/a"}, {schema.STEP: [1]}, {schema.STEP: True}, {schema.T_START_MS: "0"}],
)
def test_a_step_with_a_damaged_time_is_a_bad_line_not_a_crash(tmp_path, capsys, damage):
    records = steps(20)
    records[15].update(damage)
    write_rank(tmp_path, 0, [header(), *records, footer(20)])
    tail = RunFollower(tmp_path)
    tail.poll()
    assert tail.ranks[0].bad_lines == 1 and len(tail.ranks[0].recent) == 19
    # It crashed `traceml watch` with exit code 70 (internal error); `traceml report` copes.
    assert main(["watch", str(tmp_path)]) == 0
    assert "the run has ended" in capsys.readouterr().out


def test_the_window_rate_ignores_a_damaged_step_length():
    tail = RankTail(rank=0, path=Path("rank_0.jsonl"))
    tail.feed(line(header()) + b"".join(line(record) for record in steps(20)))
    tail.recent[-1] = {**tail.recent[-1], schema.STEP: "n/a"}  # as if read before a check
    view = build_view({0: tail}, run="r", collect_s=0)
    # Steps 2-19 (after the warm-up); the last one's length unknown, so counted as 0 ms.
    assert view.steps_per_s == pytest.approx(18 * 1000.0 / (17 * 101.0))


# ----------------------------------------------------------------------------------------------
# 2. Escape codes from the run


def test_text_from_the_run_cannot_drive_the_terminal(tmp_path):
    evil = "evil\x1b]0;PWNED\x07\x1b[2J\x9b2J\nnext"
    write_rank(tmp_path, 0, [header(run=evil), *steps(20)])
    follower = RunFollower(tmp_path)
    follower.poll()
    view = build_view(follower.ranks, run="r", collect_s=0)
    hostile = replace(view, state=FINAL, verdict_kind="INPUT_BOUND", verdict_why="why\x1b[2J")
    for text in [render_line(view), *render_panel(hostile, 10_000)]:
        assert not any(char in text for char in "\x1b\x07\x9b\n\r"), repr(text)
    assert "evil\\x1b]0;PWNED\\x07" in render_line(view)
    assert "why\\x1b[2J" in render_panel(hostile, 10_000)[2]


# ----------------------------------------------------------------------------------------------
# 3. A rank file truncated or replaced


def test_a_truncated_rank_file_is_read_again_from_the_start(tmp_path):
    write_rank(tmp_path, 0, [header(run="first"), *steps(40)])
    follower = RunFollower(tmp_path)
    follower.poll()
    assert follower.ranks[0].steps == 40
    write_rank(tmp_path, 0, [header(run="second"), *steps(5, step_ms=500.0)])  # shorter
    assert follower.poll()
    tail = follower.ranks[0]
    assert tail.steps == 5 and tail.header[schema.RUN] == "second"
    assert [r[schema.STEP_INDEX] for r in tail.recent] == list(range(5))
    with open(rank_file(tmp_path), "ab") as handle:
        handle.write(b"".join(line(record) for record in steps(3, start=5, step_ms=500.0)))
    follower.poll()
    assert tail.steps == 8 and tail.bad_lines == 0


def test_a_replaced_rank_file_is_read_again_from_the_start(tmp_path):
    write_rank(tmp_path, 0, [header(run="first"), *steps(10)])
    follower = RunFollower(tmp_path)
    follower.poll()
    # A new run written beside it and renamed over it: another inode, and longer.
    new = tmp_path / "new.jsonl"
    new.write_bytes(b"".join(line(r) for r in [header(run="second"), *steps(30, step_ms=7.0)]))
    os.replace(new, rank_file(tmp_path))
    assert follower.poll()
    tail = follower.ranks[0]
    assert tail.header[schema.RUN] == "second" and tail.steps == 30 and tail.bad_lines == 0
    assert build_view(follower.ranks, run="r", collect_s=0).median_step_ms == pytest.approx(7.0)


def written_header(pid: int, steps_ms: float) -> dict:
    """A header in recorder.build_header's key order: the run's step keys (~800 bytes, the same
    for every run of a version) come before its pid and start time."""
    from traceml.step_record import STEP_FIELD_OF_KEY

    theirs = header(run="same-name")
    ours = {key: theirs[key] for key in (schema.KIND, schema.SCHEMA)}
    ours[schema.HEADER_STEP_KEYS] = STEP_FIELD_OF_KEY
    ours.update(theirs)
    ours[schema.PID] = pid
    ours[schema.STARTED_AT] = f"2026-01-01T00:00:{int(steps_ms):02d}+00:00"
    return ours


def test_a_rank_file_rewritten_in_place_past_the_old_offset_is_read_from_the_start(tmp_path):
    # A run restarted into the same directory truncates the file (same inode) and, by the next
    # poll, has written more than was read of the old one: size and inode look like growth.
    # Only the header's pid and start time differ, ~850 bytes in (found by review).
    write_rank(tmp_path, 0, [written_header(1, 5.0), *steps(10)])
    follower = RunFollower(tmp_path)
    follower.poll()
    inode = os.stat(rank_file(tmp_path)).st_ino
    with open(rank_file(tmp_path), "r+b") as handle:
        handle.truncate(0)
        handle.write(b"".join(line(r) for r in [written_header(2, 7.0), *steps(30, step_ms=7.0)]))
    assert os.stat(rank_file(tmp_path)).st_ino == inode
    assert follower.poll()
    tail = follower.ranks[0]
    assert tail.header[schema.PID] == 2 and tail.steps == 30 and tail.bad_lines == 0
    assert build_view(follower.ranks, run="r", collect_s=0).median_step_ms == pytest.approx(7.0)
    with open(rank_file(tmp_path), "ab") as handle:  # and then it grows as any other
        handle.write(b"".join(line(record) for record in steps(2, start=30, step_ms=7.0)))
    follower.poll()
    assert follower.ranks[0] is tail and tail.steps == 32 and tail.bad_lines == 0


# ----------------------------------------------------------------------------------------------
# 4-6. Ways out of watch: Ctrl-C anywhere, a quiet run's panel, a reader that went away


def _interrupt(*_args, **_kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["first read", "final report"])
def test_ctrl_c_anywhere_in_watch_is_one_line_not_a_traceback(tmp_path, monkeypatch, where):
    write_rank(tmp_path, 0, [header(), *steps(20), footer(20)])
    if where == "first read":
        monkeypatch.setattr(live.RunFollower, "poll", _interrupt)
    else:
        monkeypatch.setattr(live, "_print_final", _interrupt)
    out = _Output()
    try:
        code = live.watch(tmp_path, out=out)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped watch() as a traceback")
    assert code == 0
    assert out.text == "traceml: stopped watching (the run goes on)\n"


class _Output:
    """A stand-in for the guarded stdout; ``broken`` once ``break_after`` writes were made."""

    def __init__(self, break_after: int | None = None) -> None:
        self.text = ""
        self.writes = 0
        self.break_after = break_after

    @property
    def broken(self) -> bool:
        return self.break_after is not None and self.writes >= self.break_after

    def write(self, text: str) -> int:
        self.text += "" if self.broken else text
        self.writes += 1
        return len(text)

    def flush(self) -> None:
        pass


class _Panel:
    def __init__(self) -> None:
        self.drawn: list[list[str]] = []

    def draw(self, lines: list[str]) -> None:
        self.drawn.append(lines)


class _QuietFollower(RunFollower):
    """A run that writes nothing more for ``polls`` polls, then is over."""

    def __init__(self, run_dir: Path, polls: int) -> None:
        super().__init__(run_dir)
        self.polls_left = polls

    def poll(self) -> bool:
        self.polls_left -= 1
        return super().poll()

    def finished(self, world_size: int | None = None) -> bool:
        return self.polls_left < 0


def test_the_panel_is_drawn_at_once_on_a_quiet_run(tmp_path):
    write_rank(tmp_path, 0, [header(), *steps(20)])
    follower = _QuietFollower(tmp_path, polls=3)
    follower.poll()  # watch() reads once before it follows
    panel = _Panel()
    live._follow(follower, panel, _Output(), None, 30.0, 0.0, None, 0.0)
    assert len(panel.drawn) == 1 and "r0=20" in panel.drawn[0][0]


def _sleeps(monkeypatch: pytest.MonkeyPatch, most: int) -> list[float]:
    """Count watch's sleeps (no real waiting); more than ``most`` means it would poll forever."""
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) > most:
            raise _PolledOn

    monkeypatch.setattr(live.time, "sleep", sleep)
    return slept


class _PolledOn(Exception):
    pass


def test_watch_stops_once_nobody_reads_its_output(tmp_path, monkeypatch):
    # `traceml watch RUN | head -1`: the guarded stdout drops every write once head has gone.
    write_rank(tmp_path, 0, [header(0, 1), *steps(20)])  # no footer: the run goes on
    slept = _sleeps(monkeypatch, most=20)
    out = _Output(break_after=1)
    assert live.watch(tmp_path, out=out, poll_s=0, collect_s=0) == 0
    assert len(slept) <= 2 and out.text.startswith("traceml: watching")


def test_watch_keeps_writing_the_html_page_when_nobody_reads_its_output(tmp_path, monkeypatch):
    write_rank(tmp_path / "run", 0, [header(0, 1), *steps(20)])
    _sleeps(monkeypatch, most=5)
    page = tmp_path / "live.html"
    with pytest.raises(_PolledOn):
        live.watch(tmp_path / "run", out=_Output(break_after=1), poll_s=0, html=page)
    assert page.is_file()


# ----------------------------------------------------------------------------------------------
# 7-8. The ranks a header promises


def test_watch_ends_when_a_promised_rank_never_creates_its_file(tmp_path):
    write_rank(tmp_path, 0, [header(0, 2), *steps(30), footer(30)])  # rank 1 never came
    now = [100.0]
    follower = RunFollower(tmp_path, clock=lambda: now[0])
    follower.poll()
    assert not follower.finished()  # rank 1 may still be starting
    now[0] += live_follow._DEAD_AFTER_S - 1
    follower.poll()
    assert not follower.finished()
    now[0] += 2
    assert not follower.poll()
    assert follower.finished()


def test_a_rank_still_running_keeps_the_watch_going_whatever_is_missing(tmp_path):
    write_rank(tmp_path, 0, [header(0, 3), *steps(30), footer(30)])
    write_rank(tmp_path, 1, [header(1, 3), *steps(30)])  # alive, no footer yet
    now = [100.0]
    follower = RunFollower(tmp_path, clock=lambda: now[0], is_process_gone=lambda _h: False)
    follower.poll()
    now[0] += 60
    follower.poll()
    assert not follower.finished()


def test_an_unbelievable_world_size_is_ignored(tmp_path):
    too_many = schema.MAX_WORLD_SIZE + 1
    write_rank(tmp_path, 0, [header(0, too_many), *steps(20), footer(20)])
    follower = RunFollower(tmp_path)
    follower.poll()
    view = build_view(follower.ranks, run="r", collect_s=0)
    assert view.world_size == 1 and view.missing_ranks == []
    assert follower.finished()  # the rank files there are the run
    assert len(render_line(view)) < 300


def test_missing_ranks_are_shown_as_ranges(tmp_path):
    for rank in (0, 3):
        write_rank(tmp_path, rank, [header(rank, schema.MAX_WORLD_SIZE), *steps(20)])
    follower = RunFollower(tmp_path)
    follower.poll()
    text = render_line(build_view(follower.ranks, run="r", collect_s=0))
    assert f"no file yet: r1-r2, r4-r{schema.MAX_WORLD_SIZE - 1} |" in text
    assert len(text) < 300


# ----------------------------------------------------------------------------------------------
# A run that ended without a step


def test_watch_on_a_run_without_steps_shows_the_verdict(tmp_path, capsys):
    write_rank(tmp_path, 0, [header(), footer(0, status=schema.STATUS_EXCEPTION)])
    assert main(["watch", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "verdict (whole run): INSUFFICIENT-DATA" in out
    assert "\n\n" not in out
