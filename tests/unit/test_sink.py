"""The rank-file writer: one complete line per record, fail-open on a full disk."""

import os

import orjson
import pytest

from traceml import console
from traceml.capture.sink import RankSink, SinkError


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
