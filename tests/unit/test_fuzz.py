"""Fuzz: random and mutated rank files and summaries through `traceml report` and `compare`.

Whatever the files hold, the CLI answers with exit 0 (notes say what was wrong) or exit 2 with
one line (`traceml: error: ...`), never a traceback, and writes only its own result files,
inside the run directory (compare: only its --output). Seeded (derandomized) and bounded for
CI; for a longer local run:

    TRACEML_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest tests/unit/test_fuzz.py -q
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from traceml import schema
from traceml.cli import main
from traceml.finalize import summarise

from rankfiles import footer, header, step

EXAMPLES = int(os.environ.get("TRACEML_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,  # a fixed seed: CI sees the same cases every run
    database=None,  # nothing written into the work tree
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Any JSON value, weighted towards the troublesome ones.
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([-1.0, 0.0, 1e300, -1e300, 2**53 + 1, 10**18]),
    st.text(max_size=20),
    st.sampled_from(["12.5", "NaN", "inf", "", "rank", "../../x"]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)

STEP_FIELDS = [*schema.TIMED_FIELDS, schema.T_START_MS, schema.GAP_MS, schema.RSS,
               schema.STEP_INDEX, schema.MICROBATCHES, schema.COMM, schema.KIND]  # fmt: skip
HEADER_FIELDS = [schema.SCHEMA, schema.RUN, schema.RANK, schema.WORLD_SIZE,
                 schema.LOCAL_WORLD_SIZE, schema.NODE_RANK, schema.HOST, schema.DEVICE,
                 schema.VERSIONS, schema.BATCH_SIZE, schema.ACCUMULATE_GRAD_BATCHES,
                 schema.CLOCK_ORIGIN_UNIX, schema.SETTINGS, "num_workers"]  # fmt: skip
FOOTER_FIELDS = [schema.STATUS, schema.ERROR, schema.ERROR_TYPE, schema.ENDED_AT, schema.STEPS]


@st.composite
def rank_file(draw: Any, rank: int) -> bytes:
    """A plausible rank file, then damaged: fields replaced, lines dropped, duplicated,
    reordered, replaced by bytes, the file cut short."""
    world = draw(st.sampled_from([1, 2, 4, 10**9, 0, -3, "2"]))
    count = draw(st.integers(min_value=0, max_value=30))
    records: list[dict[str, Any]] = [header(rank=rank, world_size=world)]
    for index in range(count):
        phases = {k: draw(st.floats(0, 200)) for k in ("input", "forward", "backward")}
        records.append(step(index, t_ms=index * 300.0, **phases))
    if draw(st.booleans()):
        status = draw(st.sampled_from(["completed", "exception", "interrupted", "bogus"]))
        records.append(footer(count, status=status))
    for _ in range(draw(st.integers(0, 6))):
        target = draw(st.sampled_from(range(len(records))))
        kind = records[target].get(schema.KIND)
        kind = kind if isinstance(kind, str) else None
        names = {schema.KIND_HEADER: HEADER_FIELDS, schema.KIND_FOOTER: FOOTER_FIELDS}.get(
            kind, STEP_FIELDS
        )
        records[target] = {**records[target], draw(st.sampled_from(names)): draw(json_values)}
    if draw(st.booleans()):
        records.append({schema.KIND: schema.KIND_EVENT, schema.CODE: draw(json_values),
                        schema.MESSAGE: draw(json_values)})  # fmt: skip
    lines = [orjson.dumps(record) for record in records]
    operation = draw(st.sampled_from(["none", "drop", "duplicate", "shuffle", "binary", "cut"]))
    if operation == "drop" and lines:
        del lines[draw(st.integers(0, len(lines) - 1))]
    elif operation == "duplicate" and lines:
        lines.insert(0, lines[draw(st.integers(0, len(lines) - 1))])
    elif operation == "shuffle":
        lines = draw(st.permutations(lines))
    elif operation == "binary":
        lines.insert(draw(st.integers(0, len(lines))), draw(st.binary(max_size=40)))
    data = b"\n".join(lines) + b"\n"
    if operation == "cut":
        data = data[: draw(st.integers(0, len(data)))]
    return data


@st.composite
def run_dir_contents(draw: Any) -> dict[str, bytes | None]:
    """File name -> content under ranks/ (None: a directory of that name)."""
    ranks = draw(st.lists(st.sampled_from([0, 1, 2, 3, 7, 1_000_000_000, 2**20]), max_size=4,
                          unique=True))  # fmt: skip
    files: dict[str, bytes | None] = {
        schema.rank_file_name(rank): draw(rank_file(rank)) for rank in ranks
    }
    odd = draw(st.sampled_from(["", "rank_01.jsonl", "rank_-1.jsonl", "rank_x.jsonl",
                                "rank_5.jsonl/"]))  # fmt: skip
    if odd.endswith("/"):
        files[odd[:-1]] = None
    elif odd:
        files[odd] = draw(rank_file(1))
    return files


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and not path.is_symlink()
    }


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def _assert_clean_exit(code: int, err: str, allowed: tuple[int, ...] = (0, 2)) -> None:
    assert code in allowed, (code, err)
    assert "Traceback" not in err
    if code == 2:
        assert err.startswith("traceml: error: ") and err.count("\n") == 1, err


RESULTS = {schema.SUMMARY_JSON, schema.SUMMARY_TXT, schema.REPORT_HTML}


@FUZZ
@given(contents=run_dir_contents(), planted=st.sampled_from(["none", "symlinks", "directory"]))
def test_report_survives_any_rank_files(contents, planted):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        outside = root / "outside"
        outside.mkdir()
        (outside / "victim.txt").write_text("precious")
        run_dir = root / "run"
        ranks = run_dir / schema.RANKS_DIR
        ranks.mkdir(parents=True)
        for name, data in contents.items():
            if data is None:
                (ranks / name).mkdir()
            else:
                (ranks / name).write_bytes(data)
        if planted == "symlinks":
            # Result names and predictable temporary names point outside the run directory.
            for name in RESULTS:
                (run_dir / name).symlink_to(outside / "victim.txt")
                (run_dir / f".{name}.{os.getpid()}.tmp").symlink_to(outside / f"{name}.tmp")
            (ranks / "rank_9.jsonl").symlink_to(outside / "victim.txt")
        elif planted == "directory":
            (run_dir / schema.SUMMARY_TXT).mkdir()
        before_outside = _snapshot(outside)
        before_ranks = _snapshot(ranks)

        code, out, err = _cli("report", str(run_dir), "--html")

        _assert_clean_exit(code, err)
        assert _snapshot(outside) == before_outside
        assert not any(outside.glob("*.tmp"))
        assert _snapshot(ranks) == before_ranks  # the rank files are only read
        made = {p.name for p in run_dir.iterdir()} - {schema.RANKS_DIR, *RESULTS}
        made -= {f".{name}.{os.getpid()}.tmp" for name in RESULTS}
        assert made == set(), made  # no temporary file left behind
        if code == 0:
            assert out.strip()
            for name in RESULTS:
                assert (run_dir / name).is_file() and not (run_dir / name).is_symlink()
            summary = orjson.loads((run_dir / schema.SUMMARY_JSON).read_bytes())
            assert summary[schema.SUMMARY_VERDICTS]
            assert len(summary[schema.SUMMARY_RANKS_EXPECTED]) <= schema.MAX_WORLD_SIZE


def _good_summary(root: Path, name: str) -> dict[str, Any]:
    run_dir = root / name
    for rank in range(2):
        records = [header(rank=rank, world_size=2)]
        records += [step(i, t_ms=i * 100.0, forward=30 + rank, backward=60) for i in range(30)]
        records.append(footer(30))
        path = run_dir / schema.RANKS_DIR / schema.rank_file_name(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    summary, _text = summarise(run_dir)
    return summary


def _mutate(value: Any, path: list[Any], replacement: Any) -> Any:
    if not path:
        return replacement
    head, rest = path[0], path[1:]
    if isinstance(value, dict) and head in value:
        return {**value, head: _mutate(value[head], rest, replacement)}
    if isinstance(value, list) and isinstance(head, int) and value:
        index = head % len(value)
        return [*value[:index], _mutate(value[index], rest, replacement), *value[index + 1 :]]
    return value


def _paths(value: Any, prefix: tuple = (), depth: int = 0) -> list[tuple]:
    found = [prefix]
    if depth >= 5:
        return found
    if isinstance(value, dict):
        for key in list(value)[:40]:
            found += _paths(value[key], (*prefix, key), depth + 1)
    elif isinstance(value, list) and value:
        found += _paths(value[0], (*prefix, 0), depth + 1)
    return found


_BASE: dict[str, Any] = {}


def _base_summary() -> dict[str, Any]:
    if not _BASE:
        with tempfile.TemporaryDirectory() as tmp:
            _BASE["summary"] = _good_summary(Path(tmp), "base")
            _BASE["paths"] = _paths(_BASE["summary"])
    return _BASE["summary"]


@FUZZ
@given(data=st.data())
def test_compare_survives_mutated_summaries(data):
    base = _base_summary()
    mutated = base
    for _ in range(data.draw(st.integers(1, 4))):
        where = data.draw(st.sampled_from(_BASE["paths"]))
        mutated = _mutate(mutated, list(where), data.draw(json_values))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        a, b = root / "a.json", root / "b.json"
        a.write_bytes(orjson.dumps(base))
        b.write_bytes(
            data.draw(st.sampled_from([orjson.dumps(mutated), orjson.dumps(mutated)[:-7], b"\x00"]))
        )
        output = root / "out" / "cmp"
        code, _out, err = _cli("compare", str(a), str(b), "--output", str(output))
        _assert_clean_exit(code, err, allowed=(0, 1, 2, 3))
        written = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
        assert written <= {"a.json", "b.json", "out/cmp.json", "out/cmp.txt"}
