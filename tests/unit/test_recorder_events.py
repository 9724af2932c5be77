"""A rank file's events: its first line is always the header, and a note is said once."""

from types import SimpleNamespace

import orjson

from traceml import schema
from traceml.capture.recorder import RankRecorder


def test_a_note_before_the_header_follows_it_and_a_repeated_note_is_written_once(tmp_path):
    # Lightning's input-timing door ran before the session started (its note was line 1, and
    # readers that take line 1 as the header found none), then again at the start.
    recorder = RankRecorder(SimpleNamespace(run_dir=tmp_path, trace_max_steps=None), {"rank": 0})
    assert recorder.open() is None
    recorder.event("info", schema.EVENT_NOTE, "input pipeline not timed: an iterable dataset")
    recorder.write_header({schema.KIND: schema.KIND_HEADER})
    recorder.event("info", schema.EVENT_NOTE, "input pipeline not timed: an iterable dataset")
    recorder.event("info", schema.EVENT_NOTE, "another note")
    recorder.finish()
    path = tmp_path / schema.RANKS_DIR / schema.rank_file_name(0)
    records = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert [r[schema.KIND] for r in records] == ["header", "event", "event", "footer"]
    assert [r[schema.MESSAGE] for r in records[1:3]] == [
        "input pipeline not timed: an iterable dataset",
        "another note",
    ]
