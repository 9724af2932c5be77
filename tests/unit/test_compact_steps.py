"""Compact step records (rank schema 1.3, issue 24): a line carries what was measured; what it
leaves out reads back as its default or as null, never 0; older files read as before. Rank
schema 2.0 spells a step line's fields with short keys (STEP_KEYS)."""

import orjson
import pytest

from traceml import schema
from traceml.analysis.rankfile import read_rank_file, read_records
from traceml.analysis.reduce import reduce_run
from traceml.capture.step_clock import StepClock
from traceml.step_record import STEP_KEYS, STEP_RECORD_FIELDS

from rankfiles import footer, header, synthetic_run, write_rank

MS = 1_000_000
K = STEP_KEYS


def cpu_step(clock: StepClock, t0: int, **context) -> dict:
    clock.fetched(t0, t0 + 1_234_567)
    clock.forward_started(t0 + 2 * MS)
    clock.forward_ended(t0 + 5_555_555)
    clock.backward_started(t0 + 6 * MS)
    if clock.comm_enabled:
        clock.collective(schema.BACKWARD, 1_500_000, nbytes=4096)
    clock.backward_ended(t0 + 9 * MS)
    clock.optimizer_started(t0 + 9 * MS)
    return clock.batch_ended(t0 + 10_000_400, **context)


def test_a_cpu_step_line_carries_only_what_was_measured():
    clock = StepClock(origin_ns=0)
    record = cpu_step(clock, 100 * MS, global_step=1, epoch=0)
    line = orjson.loads(orjson.dumps(record))
    # Only short keys are written (and "kind", which every record has).
    assert set(line) <= {schema.KIND, *K.values()}
    assert {K[schema.STEP_INDEX], K[schema.STEP], K[schema.RESIDUAL]} <= set(line)
    for absent in (schema.H2D, schema.GAP_MS, schema.GPU_STEP, schema.COMM, schema.MICROBATCHES):
        assert K[absent] not in line and absent not in record
    # Whole microseconds, and the phases still add up to the step exactly.
    assert line[K[schema.INPUT_WAIT]] == 1.235 and line[K[schema.FORWARD]] == 3.556
    assert line[K[schema.STEP]] == 10.0
    named = sum(line[K[p]] for p in (schema.INPUT_WAIT, schema.FORWARD, schema.BACKWARD))
    last = line[K[schema.OPTIMIZER]] + line[K[schema.RESIDUAL]]
    assert named + last == pytest.approx(10.0, abs=1e-9)
    # In memory the record still answers every field by name (what the capture side and
    # tests read), through [], get and in.
    assert record[schema.FORWARD] == 3.556 and record.get(schema.FORWARD) == 3.556
    assert schema.FORWARD in record and record.get(schema.H2D, "absent") == "absent"
    assert record[schema.GPU_STEP] is None and record[schema.MICROBATCHES] == 1
    assert record[schema.OPTIMIZER_STEPPED] is True and record[schema.COMM] is None


def test_comm_zeros_are_left_out_and_read_back_as_zero_not_null():
    clock = StepClock(origin_ns=0, comm_enabled=True)
    record = cpu_step(clock, 0)
    line = orjson.loads(orjson.dumps(record))
    assert line[K[schema.COMM]] == 1.5 and line[K[schema.COMM_OF_PHASE[schema.BACKWARD]]] == 1.5
    assert K[schema.COMM_OF_PHASE[schema.FORWARD]] not in line
    assert record[schema.COMM_OF_PHASE[schema.FORWARD]] == 0.0
    assert record[schema.COMM_COUNT] == 1 and K[schema.COMM_BYTES] in line


def _compact_run(tmp_path, comm: bool):
    """Two ranks written by the real StepClock, as a traced run writes them."""
    for rank in range(2):
        clock = StepClock(origin_ns=0, comm_enabled=comm)
        records = [header(rank, 2)]
        for index in range(30):
            record = cpu_step(clock, index * 20 * MS + rank * MS, global_step=index + 1, epoch=0)
            if index % 3 == 0:
                record[K[schema.RSS]] = 1_000_000 + index  # as the session adds it
            records.append(record)
        records.append(footer(30))
        write_rank(tmp_path, rank, records)


def _rewrite_run(source, target, version: str, step) -> None:
    """``source``'s two rank files read back (field names), written again under ``target`` as
    rank schema ``version`` would have: its header's version, no key map, ``step(record)``
    for each step record."""
    for rank in range(2):
        rewritten = []
        for record in read_records(source / "ranks" / f"rank_{rank}.jsonl"):
            if record[schema.KIND] == schema.KIND_HEADER:
                record = {**record, schema.SCHEMA: version}
                record.pop(schema.HEADER_STEP_KEYS, None)
            elif record[schema.KIND] == schema.KIND_STEP:
                record = step(record)
            rewritten.append(record)
        write_rank(target, rank, rewritten)


def _reduced(run_dir) -> dict:
    """The run's summary without what differs between two directories reduced apart."""
    summary = reduce_run(run_dir)
    summary.pop("generated_at"), summary.pop("run_dir")
    return summary


@pytest.mark.parametrize("comm", [False, True])
def test_compact_files_reduce_like_the_same_steps_spelled_out(tmp_path, comm):
    compact, full = tmp_path / "compact", tmp_path / "full"
    _compact_run(compact, comm)
    # The same records with every field spelled out, as rank schema 1.2 wrote them.
    _rewrite_run(compact, full, "traceml.rank/1.2", lambda r: {n: r[n] for n in STEP_RECORD_FIELDS})
    line = (full / "ranks" / "rank_0.jsonl").read_bytes().splitlines()[1]
    assert b'"gpu_step_ms":null' in line  # really spelled out
    a, b = _reduced(compact), _reduced(full)
    assert a == b
    phases = a["ranks"][0]["phases"]
    assert phases[schema.GPU_STEP] is None and phases[schema.H2D] is None  # null, never 0
    if comm:
        assert phases[schema.OWN_OF_PHASE[schema.FORWARD]]["mean"] == pytest.approx(3.556)


def test_columns_of_a_compact_file(tmp_path):
    _compact_run(tmp_path, comm=True)
    data = read_rank_file(tmp_path / "ranks" / "rank_0.jsonl", 0)
    assert data.compact
    assert set(data.columns[schema.MICROBATCHES]) == {1}
    assert set(data.columns[schema.COMM_OF_PHASE[schema.FORWARD]]) == {0.0}
    assert set(data.columns[schema.GPU_STEP]) == {None}
    assert data.columns[schema.RSS][:4] == [1_000_000, None, None, 1_000_003]


def test_an_older_file_is_read_as_written(tmp_path):
    # An absent MICROBATCHES in a 1.2 file stays null instead of becoming the 1.3 default.
    synthetic_run(tmp_path, steps=5, input=1.0, forward=2.0)
    path = tmp_path / "ranks" / "rank_0.jsonl"
    lines = path.read_bytes().splitlines()
    head = orjson.loads(lines[0])
    head[schema.SCHEMA] = "traceml.rank/1.2"
    steps = []
    for line in lines[1:-1]:
        record = orjson.loads(line)
        del record[schema.MICROBATCHES]
        steps.append(orjson.dumps(record))
    path.write_bytes(b"\n".join([orjson.dumps(head), *steps, lines[-1]]) + b"\n")
    data = read_rank_file(path, 0)
    assert not data.compact and set(data.columns[schema.MICROBATCHES]) == {None}


def test_a_2_0_file_declares_its_keys_and_reads_back_by_name(tmp_path):
    from traceml.capture.recorder import build_header
    from traceml.settings import Settings

    settings = Settings(logs_dir=tmp_path, run_name="keys")
    head = build_header(
        settings,
        {schema.RANK: 0},
        integration="torch",
        device={},
        clock_origin_unix=0.0,
        timing="host",
    )
    assert head[schema.SCHEMA] == "traceml.rank/3.0"
    assert head[schema.HEADER_STEP_KEYS] == {key: name for name, key in K.items()}
    _compact_run(tmp_path, comm=True)
    raw = orjson.loads((tmp_path / "ranks" / "rank_0.jsonl").read_bytes().splitlines()[1])
    assert K[schema.FORWARD] in raw and schema.FORWARD not in raw
    step = read_records(tmp_path / "ranks" / "rank_0.jsonl")[1]
    assert step[schema.FORWARD] == 3.556 and K[schema.FORWARD] not in step
    assert step[schema.RSS] == 1_000_000 and step.get(schema.H2D) is None


def test_a_1_3_file_of_long_names_still_reads(tmp_path):
    short, long = tmp_path / "short", tmp_path / "long"
    _compact_run(short, comm=True)
    _rewrite_run(short, long, "traceml.rank/1.3", dict)
    assert b'"forward_ms":' in (long / "ranks" / "rank_0.jsonl").read_bytes()
    a, b = _reduced(short), _reduced(long)
    assert a == b and a["steps_recorded"] == 60


def _with_schema(tmp_path, version):
    _compact_run(tmp_path, comm=False)
    path = tmp_path / "ranks" / "rank_0.jsonl"
    lines = path.read_bytes().splitlines()
    head = {**orjson.loads(lines[0]), schema.SCHEMA: version}
    path.write_bytes(b"\n".join([orjson.dumps(head), *lines[1:]]) + b"\n")
    return path


def test_a_rank_schema_this_traceml_cannot_read_is_refused(tmp_path):
    from traceml.errors import ReduceError

    path = _with_schema(tmp_path, "traceml.rank/4.0")
    with pytest.raises(ReduceError, match=r"4\.0"):
        read_rank_file(path, 0)


@pytest.mark.parametrize("version", ["traceml.rank/0.9", None, 7])
def test_a_damaged_header_schema_leaves_the_steps_readable(tmp_path, version):
    """One rank's damaged header (a schema that never existed) is a bad line, not a refusal
    of the whole run: its steps are read as a file without a header's."""
    path = _with_schema(tmp_path, version)
    data = read_rank_file(path, 0)
    assert data.header is None
    assert data.bad_schema == repr(version)
    assert data.step_count > 0


def test_the_header_names_the_launch(tmp_path, monkeypatch):
    """Two jobs given one run name at once differ here: torchelastic's run id, the rendezvous."""
    from traceml.capture.recorder import build_header
    from traceml.settings import Settings

    def job() -> object:
        settings = Settings(logs_dir=tmp_path, run_name="job")
        kwargs = dict(integration="torch", device={}, clock_origin_unix=0.0, timing="host")
        return build_header(settings, {schema.RANK: 0}, **kwargs)[schema.JOB]

    for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert job() is None  # one process
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f2a")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert job() == "3f2a|29500"  # (not the address: each node may spell its own)
