"""The rank-file writer: one complete line per record, batched, fail-open on a full disk."""

import os
import threading
import time

import orjson
import pytest

from traceml import console
from traceml.capture.sink import MAX_QUEUED, RankSink, SinkError


@pytest.fixture(autouse=True)
def clean_console():
    console.reset_for_tests()
    yield
    console.reset_for_tests()


def test_lines_and_exclusive_create(tmp_path):
    sink = RankSink(tmp_path / "ranks" / "rank_0.jsonl")
    sink.open()
    assert sink.write({"kind": "header", "x": 1})
    assert sink.write({"kind": "step", "step": 0})
    sink.close()
    lines = (tmp_path / "ranks" / "rank_0.jsonl").read_bytes().splitlines()
    assert [orjson.loads(line)["kind"] for line in lines] == ["header", "step"]
    with pytest.raises(SinkError, match="already exists"):
        RankSink(tmp_path / "ranks" / "rank_0.jsonl").open()


def test_unwritable_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SinkError, match="cannot create"):
        RankSink(blocker / "rank_0.jsonl").open()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_disk_turns_the_sink_off_with_one_warning(tmp_path, capsys):
    sink = RankSink(tmp_path / "rank_0.jsonl")
    sink._fd = os.open("/dev/full", os.O_WRONLY)  # every write fails with ENOSPC
    assert sink.write({"kind": "step"}) is False
    assert sink.write({"kind": "step"}) is False  # off now: no second warning
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "No space left on device" in err and "training continues" in err


def lines_of(path):
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_steps_are_queued_then_written_in_order_by_the_flusher(tmp_path):
    path = tmp_path / "rank_0.jsonl"
    sink = RankSink(path, flush_interval_s=0.05)
    sink.open()
    assert sink.write({"kind": "header"})  # written at once
    for index in range(100):
        assert sink.append({"kind": "step", "step": index})
    assert [r["kind"] for r in lines_of(path)] == ["header"]  # queued, not yet written
    deadline = time.monotonic() + 5
    while len(lines_of(path)) < 101 and time.monotonic() < deadline:
        time.sleep(0.01)
    records = lines_of(path)
    assert [r["step"] for r in records[1:]] == list(range(100))
    assert sink.writes == 2  # the header, then one write for the 100 queued steps
    sink.close()


def test_a_written_record_goes_out_after_everything_queued(tmp_path):
    path = tmp_path / "rank_0.jsonl"
    sink = RankSink(path, flush_interval_s=60)  # the flusher never runs in this test
    sink.open()
    sink.append({"kind": "step", "step": 0})
    sink.append({"kind": "step", "step": 1})
    sink.write({"kind": "event"})
    sink.append({"kind": "step", "step": 2})
    sink.close()  # writes the rest and stops the flusher
    assert [r["kind"] for r in lines_of(path)] == ["step", "step", "event", "step"]
    assert not sink.is_open and not sink.append({"kind": "step"})
    assert not any(t.name == "traceml-sink" for t in threading.enumerate())


def test_a_long_queue_is_written_by_the_caller(tmp_path):
    path = tmp_path / "rank_0.jsonl"
    sink = RankSink(path, flush_interval_s=60)
    sink.open()
    for index in range(MAX_QUEUED):
        sink.append({"kind": "step", "step": index})
    assert len(lines_of(path)) == MAX_QUEUED
    sink.close()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_found_by_the_flusher_turns_the_sink_off_once(tmp_path, capsys):
    sink = RankSink(tmp_path / "rank_0.jsonl", flush_interval_s=0.01)
    sink.open()
    os.close(sink._fd)
    sink._fd = os.open("/dev/full", os.O_WRONLY)
    assert sink.append({"kind": "step"})  # queued: the failure is found by the flusher
    deadline = time.monotonic() + 5
    while sink.is_open and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sink.is_open and sink.failed == "No space left on device"
    assert sink.append({"kind": "step"}) is False  # the caller learns it at its next call
    sink.close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "training continues" in err


def test_a_forked_child_never_writes_the_parents_queue(tmp_path):
    path = tmp_path / "rank_0.jsonl"
    sink = RankSink(path, flush_interval_s=60)
    sink.open()
    sink.append({"kind": "step", "step": 0})
    sink._lock.acquire()  # as if the flusher were writing at the moment of the fork
    pid = os.fork()
    if pid == 0:  # the child (a DataLoader worker, say) ends through its own exit path
        sink.close()  # must neither write nor wait for the lock
        os._exit(0)
    sink._lock.release()
    deadline = time.monotonic() + 20
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in close()")
        time.sleep(0.01)
    sink.close()
    assert [r["step"] for r in lines_of(path)] == [0]  # once, by the parent


def test_a_record_that_cannot_be_encoded_is_dropped_alone_and_the_file_stays_open(tmp_path, capsys):
    # Records are encoded by the flusher (or at close), not by append: the failure is found
    # there. A traceml bug, not the disk: that record only is dropped, the lines around it are
    # written, and append says False from then on so that the session turns tracing off and
    # still writes its note and footer.
    path = tmp_path / "rank_0.jsonl"
    sink = RankSink(path, flush_interval_s=60)
    sink.open()
    assert sink.write({"kind": "header"})
    assert sink.append({"kind": "step", "i": 0})
    assert sink.append({"kind": "step", "bad": object()})
    assert sink.append({"kind": "step", "i": 2})
    assert sink.flush() is True
    assert sink.is_open and "TypeError" in sink.bad_record
    assert sink.append({"kind": "step", "i": 3}) is False
    assert sink.write({"kind": "footer"})
    sink.close()
    assert [r.get("i", r["kind"]) for r in lines_of(path)] == ["header", 0, 2, 3, "footer"]
    assert capsys.readouterr().err == ""  # the session warns, once


def closed_steps(clock, count: int) -> list:
    """``count`` steps closed by a real StepClock (a collective in each), records not built."""
    from traceml import schema

    steps = []
    for i in range(count):
        t0 = i * 10_000_000
        clock.fetched(t0, t0 + 1_000_000)
        clock.forward_started(t0 + 2_000_000)
        clock.forward_ended(t0 + 4_000_000)
        clock.backward_started(t0 + 4_500_000)
        clock.collective(schema.BACKWARD, 700_000, nbytes=64)
        clock.backward_ended(t0 + 7_000_000)
        clock.optimizer_started(t0 + 7_100_000)
        steps.append(clock.batch_closed(t0 + 9_000_000 + i, global_step=i + 1, epoch=0))
    return steps


def test_closed_steps_are_built_by_the_flusher_as_the_clock_would_build_them(tmp_path):
    from traceml.capture.step_clock import StepClock

    path = tmp_path / "rank_0.jsonl"
    sink = RankSink(path, flush_interval_s=0.01)
    sink.open()
    queued = closed_steps(StepClock(origin_ns=0, comm_enabled=True), 5)
    queued[2].extra["tu"] = 12.5  # the session's own fields ride along
    for closed in queued:
        assert sink.append(closed)
    deadline = time.monotonic() + 10
    while sink.writes == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.writes >= 1  # the flusher, not the caller, wrote them
    sink.close()
    eager = [c.record() for c in closed_steps(StepClock(origin_ns=0, comm_enabled=True), 5)]
    eager[2]["tu"] = 12.5
    written = lines_of(path)
    assert written == [orjson.loads(orjson.dumps(r)) for r in eager]
    # The numbers themselves (closed_steps: fetch 1 ms, forward 2, backward 2.5 with 0.7 of
    # waiting, optimizer 1.9, steps 10 ms apart and 9 ms long).
    first, second = written[0], written[1]
    assert (first["st"], first["in"], first["fw"], first["bw"], first["op"]) == (
        9.0, 1.0, 2.0, 2.5, 1.9
    )  # fmt: skip
    assert first["rs"] == 1.6 and first["c"] == 0.7 and first["cbw"] == 0.7
    assert (first["cn"], first["cb"], first["g"], first["i"]) == (1, 64, 1, 0)
    assert "gap" not in first and second["gap"] == 1.0 and second["t"] == 10.0
    assert written[2]["tu"] == 12.5


def test_a_closed_step_that_cannot_be_built_is_dropped_alone(tmp_path, capsys):
    class Broken:
        def record(self):
            raise ZeroDivisionError("a bug in the record")

    path = tmp_path / "rank_0.jsonl"
    sink = RankSink(path, flush_interval_s=60)
    sink.open()
    assert sink.write({"kind": "header"})
    assert sink.append(Broken())
    assert sink.flush() is True  # no traceback, no warning: the session says it
    assert sink.bad_record == "ZeroDivisionError: a bug in the record"
    assert sink.append({"kind": "step"}) is False
    sink.close()
    assert [r["kind"] for r in lines_of(path)] == ["header", "step"]
    assert capsys.readouterr().err == ""


def test_a_steps_door_events_are_replayed_in_file_order_and_a_failure_halts(tmp_path):
    # replay_with: a tuple queued is a step's door events; on_event turns it into nothing, a
    # record, or several, written where the tuple stood among the other records.
    seen = []

    def on_event(events, queue):
        seen.append(events)
        if events[0] == "none":
            return None
        if events[0] == "many":
            return [{"kind": "sample", "n": 1}, {"kind": "step", "n": 2}]
        return {"kind": "step", "n": events[1]}

    sink = RankSink(tmp_path / "rank_0.jsonl", flush_interval_s=60)
    sink.open()
    queue = sink.replay_with(on_event)
    queue.append(("one", 7))
    sink.append({"kind": "sample", "n": 0})
    queue.append(("none",))
    queue.append(("many",))
    assert len(queue) == 4 and not seen  # nothing replayed before a flush
    assert sink.write({"kind": "event"})
    assert [(r["kind"], r.get("n")) for r in lines_of(tmp_path / "rank_0.jsonl")] == [
        ("step", 7),
        ("sample", 0),
        ("sample", 1),
        ("step", 2),
        ("event", None),
    ]
    assert seen == [("one", 7), ("none",), ("many",)] and not sink.halted
    queue.append(("many",))
    sink._fail("disk gone")
    assert sink.halted and len(queue) == 0  # the owner acts at its next step's end
    sink.close()
