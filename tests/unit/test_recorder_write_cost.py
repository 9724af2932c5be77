"""The rank file's writes (on the sink's flusher thread) count in the steps' traceml_us."""

import time
from types import SimpleNamespace

import orjson

from traceml import schema
from traceml.capture.recorder import RankRecorder
from traceml.step_record import STEP_KEYS, StepRecord

COST = STEP_KEYS[schema.TRACEML_COST_US]


def wait_for_the_flusher(recorder: RankRecorder) -> int:
    deadline = time.monotonic() + 10
    while recorder.write_ns == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert recorder.write_ns > 0, "the flusher never wrote"
    return recorder.write_ns


def test_the_flushers_time_is_added_to_the_next_step_and_a_callers_is_not(tmp_path):
    settings = SimpleNamespace(run_dir=tmp_path, trace_max_steps=None)
    recorder = RankRecorder(settings, {schema.RANK: 0})
    assert recorder.open() is None
    # Written by the caller at once: in real use inside an entry point, timed there already.
    recorder.write_header({schema.KIND: schema.KIND_HEADER})
    assert recorder.write_ns == 0
    first = StepRecord({schema.KIND: schema.KIND_STEP, COST: 1.0})
    assert recorder.step(first)
    assert first[schema.TRACEML_COST_US] == 1.0
    flushed_ns = wait_for_the_flusher(recorder)  # the flusher wrote `first`
    second = StepRecord({schema.KIND: schema.KIND_STEP, COST: 1.0})
    unmeasured = StepRecord({schema.KIND: schema.KIND_STEP, COST: None})
    assert recorder.step(second) and recorder.step(unmeasured)
    assert second[schema.TRACEML_COST_US] == round(1.0 + flushed_ns / 1000.0, 1)
    assert unmeasured[schema.TRACEML_COST_US] is None  # unmeasured stays null
    recorder.finish()
    lines = (tmp_path / schema.RANKS_DIR / schema.rank_file_name(0)).read_bytes().splitlines()
    assert [orjson.loads(line)[schema.KIND] for line in lines] == [
        "header", "step", "step", "step", "footer"
    ]
