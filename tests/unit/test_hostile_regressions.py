"""Damaged and hostile inputs found by reading the code and by the fuzz suite, one test each:
`traceml report` gives exit 0 with a note or exit 2 with one line, and writes only its own
files, inside the run directory."""

from __future__ import annotations

import os
import sys
import types

import orjson
import pytest

from traceml import schema
from traceml.analysis.reduce import RankRecords, reduce_records, reduce_run
from traceml.cli import main
from traceml.files import write_atomically
from traceml.finalize import summarise
from traceml.settings import Settings

from rankfiles import footer, header, step, synthetic_run, write_rank


def report(run_dir, capsys, *extra):
    code = main(["report", str(run_dir), *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code, err):
    assert code == 2
    assert err.startswith("traceml: error: ") and err.count("\n") == 1


def steps(count, **phases):
    return [step(i, t_ms=i * 100.0, **phases) for i in range(count)]


def test_string_where_a_number_belongs_is_a_note_not_a_traceback(tmp_path, capsys):
    # Was: TypeError ('<' not supported between 'str' and 'float') in the field statistics.
    records = [header(), *steps(20, forward=30, backward=60)]
    records[5][schema.STEP] = "12.5"
    records[6][schema.FORWARD] = {"ms": 3}
    records[7][schema.BACKWARD] = True
    records[8][schema.T_START_MS] = "late"
    write_rank(tmp_path, 0, [*records, footer(20)])
    code, out, _err = report(tmp_path, capsys)
    assert code == 0
    summary = orjson.loads((tmp_path / schema.SUMMARY_JSON).read_bytes())
    assert "rank 0: 4 step values of the wrong type or out of range" in " ".join(summary["notes"])
    assert summary["overall"]["phases"][schema.STEP]["count"] == 17  # 20 - 2 warm-up - 1
    assert "Verdict: COMPUTE-BOUND" in out


def test_negative_and_huge_times_are_unmeasured(tmp_path):
    records = [header(), *steps(20, forward=30, backward=60)]
    records[10][schema.FORWARD] = -5.0
    records[11][schema.BACKWARD] = 1e300
    write_rank(tmp_path, 0, [*records, footer(20)])
    summary = reduce_run(tmp_path)
    forward = summary["overall"]["phases"][schema.FORWARD]
    assert forward["min"] >= 0 and forward["count"] == 17
    assert summary["overall"]["phases"][schema.BACKWARD]["max"] < 1e6


def test_nan_and_inf_from_memory_are_unmeasured():
    # JSON cannot carry them, but the live view hands the reducer records it built itself.
    data = RankRecords(rank=0, path=None, header=header())
    for index, record in enumerate(steps(20, forward=30, backward=60)):
        if index == 9:
            record[schema.FORWARD] = float("nan")
        if index == 10:
            record[schema.STEP] = float("inf")
        for name, column in data.columns.items():
            column.append(record.get(name))
    summary = reduce_records([data])
    forward = summary["overall"]["phases"][schema.FORWARD]
    assert forward["count"] == 17 and forward["mean"] == pytest.approx(30.0)
    assert summary["overall"]["phases"][schema.STEP]["max"] == pytest.approx(90.0)


def test_a_rank_number_beyond_any_job_is_skipped_not_expanded(tmp_path, capsys):
    # Was: world_size = 1000000001, then range(world_size) listed a billion missing ranks.
    synthetic_run(tmp_path, forward=30, backward=60)
    write_rank(tmp_path, 1_000_000_000, [header(rank=1_000_000_000), footer(0)])
    code, out, _err = report(tmp_path, capsys)
    assert code == 0
    summary = orjson.loads((tmp_path / schema.SUMMARY_JSON).read_bytes())
    assert summary["world_size"] == 1 and summary["ranks_missing"] == []
    assert any("rank_1000000000.jsonl: rank 1000000000 is beyond any real job" in n for n in
               summary["notes"])  # fmt: skip
    assert len(out.splitlines()) < 40


def test_only_a_huge_rank_file_is_one_line_exit_2(tmp_path, capsys):
    write_rank(tmp_path, 1_000_000_000, [header(rank=1_000_000_000), footer(0)])
    assert_one_line_error(*report(tmp_path, capsys)[::2])


def test_a_huge_world_size_in_a_header_is_ignored(tmp_path):
    write_rank(tmp_path, 0, [header(world_size=10**12), *steps(20, forward=5), footer(20)])
    summary = reduce_run(tmp_path)
    assert summary["world_size"] == 1
    assert "rank 0: header fields world_size, local_world_size of the wrong type" in " ".join(
        summary["notes"]
    )


def test_many_missing_ranks_are_summarised_as_ranges(tmp_path, capsys):
    write_rank(tmp_path, 0, [header(world_size=5000), *steps(20, forward=5), footer(20)])
    write_rank(tmp_path, 7, [header(rank=7, world_size=5000), *steps(20, forward=5), footer(20)])
    code, out, _err = report(tmp_path, capsys)
    assert code == 0
    summary = orjson.loads((tmp_path / schema.SUMMARY_JSON).read_bytes())
    assert "ranks 1-6, 8-4999 missing: no rank file" in " ".join(summary["notes"])
    assert len(out.splitlines()) < 80  # not one row per missing rank


def test_duplicate_spellings_of_a_rank_count_once(tmp_path):
    synthetic_run(tmp_path, ranks=2, forward=30, backward=60)
    (tmp_path / "ranks" / "rank_01.jsonl").write_bytes(
        (tmp_path / "ranks" / "rank_1.jsonl").read_bytes()
    )
    summary = reduce_run(tmp_path)
    assert summary["ranks_found"] == [0, 1]
    assert "rank_01.jsonl: not a rank file name traceml writes; skipped" in summary["notes"]


def test_a_header_claiming_another_rank_is_noted(tmp_path):
    write_rank(tmp_path, 0, [header(), *steps(20, forward=5), footer(20)])
    write_rank(tmp_path, 1, [header(rank=0, world_size=2), *steps(20, forward=5), footer(20)])
    summary = reduce_run(tmp_path)
    assert summary["ranks_found"] == [0, 1]
    assert "rank 1: its header says rank 0; the file name's rank is used" in summary["notes"]


@pytest.mark.parametrize("version", ["traceml.rank/9.0", "traceml.rank/x", "other/1.0", 7, None])
def test_unknown_schema_is_one_line_exit_2(tmp_path, capsys, version):
    write_rank(tmp_path, 0, [header(schema=version), *steps(20, forward=5), footer(20)])
    code, _out, err = report(tmp_path, capsys)
    assert_one_line_error(code, err)
    assert "schema" in err


def test_binary_and_truncated_lines_are_skipped_with_notes(tmp_path, capsys):
    path = synthetic_run(tmp_path, forward=30, backward=60) / "ranks" / "rank_0.jsonl"
    lines = path.read_bytes().split(b"\n")
    lines.insert(5, bytes(range(11, 256)))  # no newline byte: one binary line
    lines.insert(9, b'{"kind": "step", "step_ms": 1')
    path.write_bytes(b"\n".join(lines)[:-40])  # the footer cut short
    code, _out, _err = report(tmp_path, capsys)
    assert code == 0
    notes = " ".join(orjson.loads((tmp_path / schema.SUMMARY_JSON).read_bytes())["notes"])
    assert "2 unreadable lines skipped" in notes and "the last line was cut short" in notes


def test_header_fields_of_the_wrong_type_are_ignored(tmp_path, capsys):
    bad = header(
        device="gpu",
        batch_size="2",
        accumulate_grad_batches=[1],
        node_rank={"a": 1},
        host=["h"],
        versions=[1, 2],
        settings={"trace_max_steps": "x"},
    )
    write_rank(tmp_path, 0, [bad, *steps(20, forward=30, backward=60), footer(20, error=[1])])
    code, _out, _err = report(tmp_path, capsys, "--html")
    assert code == 0
    summary = orjson.loads((tmp_path / schema.SUMMARY_JSON).read_bytes())
    assert summary["setup"]["batch_size"] is None
    note = next(n for n in summary["notes"] if n.startswith("rank 0: header fields "))
    for name in ("device", "batch_size", "accumulate_grad_batches", "node_rank", "host"):
        assert name in note
    assert "versions" in note and "settings.trace_max_steps" in note
    assert (tmp_path / schema.REPORT_HTML).is_file()


def test_an_unreadable_rank_file_is_a_note(tmp_path, capsys, monkeypatch):
    synthetic_run(tmp_path, ranks=2, forward=30, backward=60)
    real = type(tmp_path).read_bytes

    def read_bytes(path):
        if path.name == "rank_1.jsonl":
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(type(tmp_path), "read_bytes", read_bytes)
    code, _out, _err = report(tmp_path, capsys)
    assert code == 0
    notes = orjson.loads((tmp_path / schema.SUMMARY_JSON).read_bytes())["notes"]
    assert "rank 1: its file cannot be read (Permission denied)" in notes


def test_a_directory_where_a_file_should_be(tmp_path, capsys):
    synthetic_run(tmp_path, forward=30, backward=60)
    (tmp_path / "ranks" / "rank_1.jsonl").mkdir()
    (tmp_path / schema.SUMMARY_JSON).mkdir()
    code, _out, err = report(tmp_path, capsys)
    assert_one_line_error(code, err)
    assert "cannot write" in err and schema.SUMMARY_JSON in err
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    (tmp_path / schema.SUMMARY_JSON).rmdir()
    code, _out, _err = report(tmp_path, capsys)
    assert code == 0
    notes = orjson.loads((tmp_path / schema.SUMMARY_JSON).read_bytes())["notes"]
    assert "rank_1.jsonl: not a regular file; skipped" in notes


def test_ranks_is_a_file_or_the_run_dir_is_a_file(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ranks").write_text("not a directory")
    assert_one_line_error(*report(tmp_path / "run", capsys)[::2])
    (tmp_path / "file").write_text("x")
    assert_one_line_error(*report(tmp_path / "file", capsys)[::2])


def test_write_atomically_uses_an_unpredictable_name_and_never_follows_a_planted_symlink(
    tmp_path, monkeypatch
):
    # Was: the temporary file was ".<name>.<pid>.tmp", written through whatever was there.
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    run_dir = synthetic_run(tmp_path / "run", forward=30, backward=60)
    target = run_dir / schema.SUMMARY_JSON
    for pid in {os.getpid(), *range(os.getpid() - 5, os.getpid() + 5)}:
        (run_dir / f".{schema.SUMMARY_JSON}.{pid}.tmp").symlink_to(outside)
    target.symlink_to(outside)  # the final name planted too: replaced, never written through
    used = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (used.append(a), real_replace(a, b)))
    summarise(run_dir)
    summarise(run_dir)
    assert outside.read_text() == "precious"
    assert target.is_file() and not target.is_symlink()
    assert orjson.loads(target.read_bytes())["schema"] == schema.SUMMARY_SCHEMA
    json_tmps = [os.path.basename(a) for a in used if schema.SUMMARY_JSON in str(a)]
    assert len(json_tmps) == 2 and json_tmps[0] != json_tmps[1]
    assert all(str(os.getpid()) not in name for name in json_tmps)


def test_write_atomically_leaves_no_temporary_file_when_the_rename_fails(tmp_path):
    (tmp_path / "dir").mkdir()
    with pytest.raises(OSError):
        write_atomically(tmp_path / "dir", b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]


class _FakeStore:
    def __init__(self, value: bytes) -> None:
        self.value = value

    def set(self, key, value):  # pragma: no cover - rank 0 only
        self.value = value

    def wait(self, keys, timeout):
        pass

    def get(self, key):
        return self.value


def _fake_torch_distributed(monkeypatch, store):
    c10d = types.SimpleNamespace(_get_default_store=lambda: store)
    dist = types.ModuleType("torch.distributed")
    dist.is_available = lambda: True
    dist.is_initialized = lambda: True
    dist.distributed_c10d = c10d
    torch = types.ModuleType("torch")
    torch.distributed = dist
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    monkeypatch.setitem(sys.modules, "torch.distributed.distributed_c10d", c10d)


@pytest.mark.parametrize(
    "planted", [b"../../etc", b"/tmp/elsewhere", b"", b"a/b", b"\xff\xfe", b".hidden"]
)
def test_run_name_from_rank_zero_is_revalidated(monkeypatch, capsys, tmp_path, planted):
    # Was: a rank adopted whatever the store held, so "../x" moved its files out of logs/.
    from traceml import console
    from traceml.capture.frameworks.lightning import adopt_rank_zero_run_name

    console.reset_for_tests()
    _fake_torch_distributed(monkeypatch, _FakeStore(planted))
    mine = Settings(logs_dir=tmp_path, run_name="train-20260101-000000", run_name_explicit=False)
    assert adopt_rank_zero_run_name(mine, rank=1) == mine
    assert "could not agree on a run name with rank 0" in capsys.readouterr().err


def test_a_safe_run_name_from_rank_zero_is_adopted(monkeypatch, tmp_path):
    _fake_torch_distributed(monkeypatch, _FakeStore(b"train-20260101-000001"))
    from traceml.capture.frameworks.lightning import adopt_rank_zero_run_name

    mine = Settings(logs_dir=tmp_path, run_name="train-20260101-000000", run_name_explicit=False)
    assert adopt_rank_zero_run_name(mine, rank=1).run_name == "train-20260101-000001"


def test_compare_with_a_null_job_series_mean_is_exit_2_or_a_note(tmp_path, capsys):
    for name in ("a", "b"):
        synthetic_run(tmp_path / name, ranks=2, forward=30, backward=60)
        summarise(tmp_path / name)
    path = tmp_path / "b" / schema.SUMMARY_JSON
    summary = orjson.loads(path.read_bytes())
    summary["job_series"]["fields"][schema.BACKWARD]["mean"] = None
    path.write_bytes(orjson.dumps(summary))
    # Found by test_fuzz.py (TRACEML_FUZZ_EXAMPLES=500): the damaged field falls back to the
    # stored distributions and the comparison goes on.
    code = main(["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    captured = capsys.readouterr()
    assert code in (0, 1, 3) and "Traceback" not in captured.err
    assert "Backward" in captured.out


def test_a_damaged_line_in_the_middle_says_how_many_steps_went_with_it(tmp_path, capsys):
    # The footer counts the steps written; a rows line cut in the middle of the file took 20
    # steps with it, and the note said only "1 unreadable lines skipped" (review, stop 59).
    write_rank(tmp_path, 0, [header(), *steps(30, forward=5), footer(30)])
    path = tmp_path / "ranks" / "rank_0.jsonl"
    lines = path.read_bytes().split(b"\n")
    lines[12] = lines[12][: len(lines[12]) // 2]
    path.write_bytes(b"\n".join(lines))
    code, _out, _err = report(tmp_path, capsys)
    assert code == 0
    notes = " ".join(orjson.loads((tmp_path / schema.SUMMARY_JSON).read_bytes())["notes"])
    assert "1 unreadable lines skipped, with 1 of the 30 steps the rank wrote" in notes, notes


class _KeyedStore:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def wait(self, keys, timeout):
        missing = [key for key in keys if key not in self.values]
        if missing:
            raise TimeoutError(f"no {missing}")

    def get(self, key):
        return self.values[key]


def test_a_restarted_attempt_never_adopts_the_last_attempts_run_name(monkeypatch, tmp_path):
    # torchrun keeps its store across restarts: rank 1 read the first attempt's name, found
    # its own old rank file there and ran untraced (review).
    from traceml.capture.run_name import adopt_rank_zero_run_name

    store = _KeyedStore()  # (its wait fails at once where a real one would block)
    _fake_torch_distributed(monkeypatch, store)
    first = Settings(logs_dir=tmp_path, run_name="job", run_name_explicit=False)
    adopt_rank_zero_run_name(first, rank=0)  # the first attempt's rank 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    mine = first.replace(run_name="job-restart1")
    assert adopt_rank_zero_run_name(mine, rank=1).run_name == "job-restart1"  # not "job"
    adopt_rank_zero_run_name(mine.replace(run_name="job-restart1-2"), rank=0)
    assert adopt_rank_zero_run_name(mine, rank=1).run_name == "job-restart1-2"
