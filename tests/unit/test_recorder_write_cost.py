"""The rank file's writes (on the sink's flusher thread) count in the steps' traceml_us."""

from types import SimpleNamespace

import orjson

from traceml import schema
from traceml.capture.recorder import RankRecorder
from traceml.step_record import STEP_KEYS, StepRecord

COST = STEP_KEYS[schema.TRACEML_COST_US]


def test_the_writes_cost_is_added_to_the_next_step(tmp_path):
    settings = SimpleNamespace(run_dir=tmp_path, trace_max_steps=None)
    recorder = RankRecorder(settings, {schema.RANK: 0})
    assert recorder.open() is None
    recorder.write_header({schema.KIND: schema.KIND_HEADER})
    header_ns = recorder.write_ns
    assert header_ns > 0
    first = StepRecord({schema.KIND: schema.KIND_STEP, COST: 1.0})
    assert recorder.step(first)
    assert first[schema.TRACEML_COST_US] == round(1.0 + header_ns / 1000.0, 1)
    recorder.sink.flush()  # as the flusher thread would
    flushed_ns = recorder.write_ns - header_ns
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
