"""Reading rank files: ``<run_dir>/ranks/rank_*.jsonl`` -> :class:`RankRecords` per rank.

The first stage of the pipeline (read -> clean -> per-rank reduction -> run reduction ->
diagnosis -> rendering). One rank at a time (memory is bounded by the largest rank), in chunks
of lines; a damaged line is counted, never raised. Only a rank file of a newer schema than
this traceml understands is an error. Nothing here writes.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any

import orjson

from traceml import schema
from traceml.errors import ReduceError
from traceml.files import display_path, newest_run
from traceml.step_record import STEP_FIELD_OF_KEY, STEP_KEYS, step_field_default
from traceml.step_rows import row_records

# Only the spelling traceml writes: "rank_01.jsonl" next to "rank_1.jsonl" would be two files
# for one rank.
_RANK_FILE = re.compile(r"^rank_(0|[1-9][0-9]*)\.jsonl$")
_ANY_RANK_FILE = re.compile(r"^rank_.*\.jsonl$")
_CHUNK_LINES = 8192
_FIELD_OF_KEY = STEP_FIELD_OF_KEY
_KEY = STEP_KEYS
_STEP_KEY = _KEY[schema.STEP]

# Step fields the reducer keeps per step (the rest of a record is not needed after reading).
_COLUMNS: tuple[str, ...] = (
    schema.STEP_INDEX,
    schema.GLOBAL_STEP,
    *schema.TIMED_FIELDS,
    *schema.GPU_FIELDS,
    schema.GAP_MS,
    schema.T_START_MS,
    schema.MEM_PEAK_ALLOCATED,
    schema.MEM_PEAK_RESERVED,
    schema.RSS,
    schema.MICROBATCHES,
    schema.OPTIMIZER_STEPPED,  # set aside by unstepped.set_aside before any statistic
    *schema.COMM_FIELDS,
    *schema.GPU_COMM_FIELDS,
    schema.TRACEML_COST_US,
)


@dataclass
class RankRecords:
    """Everything read from one rank file."""

    rank: int
    path: Path
    header: dict[str, Any] | None = None
    footer: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    columns: dict[str, list[Any]] = field(default_factory=lambda: {c: [] for c in _COLUMNS})
    bad_lines: int = 0
    truncated_tail: bool = False
    # Set by clean_records: step values and header fields that were not what traceml writes.
    bad_values: int = 0
    bad_header_fields: list[str] = field(default_factory=list)
    unreadable: str | None = None  # why the file could not be read at all
    # A header whose schema is not traceml's (repr): a run none of whose files has a good
    # header is refused (not traceml's files); otherwise this rank reads as headerless.
    bad_schema: str | None = None
    # Steps written compact (rank schema 1.3+: absent fields are defaults or null); a file
    # without a readable header is read as the current writer writes.
    compact: bool = True
    inputs: list[dict[str, Any]] = field(default_factory=list)  # KIND_INPUT records
    samples: list[dict[str, Any]] = field(default_factory=list)  # telemetry (KIND_SAMPLE)
    # Set by unstepped.set_aside: windows written as steps that had no optimizer step.
    unstepped: int = 0
    unstepped_ms: float = 0.0

    @property
    def step_count(self) -> int:
        return len(self.columns[schema.STEP])


def list_rank_files(run_dir: Path) -> dict[int, Path]:
    """The rank files of ``run_dir`` by rank (regular files with traceml's names only)."""
    return scan_rank_files(run_dir)[0]


def run_rank_files(run_dir: Path) -> tuple[dict[int, Path], list[str]]:
    """:func:`scan_rank_files` of a run directory; :class:`ReduceError` when there is nothing
    to report on, with the way out where ``run_dir`` is the logs folder."""
    if not run_dir.is_dir():
        gone = not run_dir.exists() and not run_dir.is_symlink()
        raise ReduceError(f"{run_dir} {'does not exist' if gone else 'is not a directory'}")
    files, skipped = scan_rank_files(run_dir)
    if not files:
        newest = newest_run(run_dir)
        if newest is not None:  # the logs folder, not a run in it
            raise ReduceError(
                f"{run_dir} is not a run directory but holds runs; the newest: "
                f"traceml report {display_path(newest)}"
            )
        raise ReduceError(f"{run_dir} has no {schema.RANKS_DIR}/rank_*.jsonl files to report on")
    return files, skipped


def scan_rank_files(run_dir: Path) -> tuple[dict[int, Path], list[str]]:
    """The rank files by rank, and a note for each file that looks like one but is skipped."""
    ranks_dir = Path(run_dir) / schema.RANKS_DIR
    found: dict[int, Path] = {}
    skipped: list[str] = []
    try:
        entries = list(ranks_dir.iterdir()) if ranks_dir.is_dir() else []
    except OSError:
        entries = []
    for path in entries:
        match = _RANK_FILE.match(path.name)
        if match is None:
            if _ANY_RANK_FILE.match(path.name):
                skipped.append(f"{path.name}: not a rank file name traceml writes; skipped")
            continue
        rank = int(match.group(1))
        if rank >= schema.MAX_WORLD_SIZE:
            skipped.append(
                f"{path.name}: rank {rank} is beyond any real job "
                f"({schema.MAX_WORLD_SIZE} ranks at most); skipped"
            )
        elif not path.is_file():
            skipped.append(f"{path.name}: not a regular file; skipped")
        else:
            found[rank] = path
    return dict(sorted(found.items())), sorted(skipped)


def parse_lines(lines: list[bytes]) -> list[dict[str, Any] | None]:
    """JSON lines to dicts (None for a damaged line), step records as :class:`StepView` (an
    absent field reads as its default or null, through ``[]`` and ``get`` alike). The live
    view's parser."""
    return [
        StepView({_FIELD_OF_KEY.get(key, key): value for key, value in record.items()})
        if record is not None and record.get(schema.KIND) == schema.KIND_STEP
        else record
        for record in _with_rows_expanded(_parse_chunk(lines))
    ]


def _with_rows_expanded(records: list[dict[str, Any] | None]) -> list[dict[str, Any] | None]:
    """Rows lines (rank schema 3.0) replaced by their step records; a damaged one by None."""
    if not any(r is not None and r.get(schema.KIND) == schema.KIND_STEP_ROWS for r in records):
        return records
    expanded: list[dict[str, Any] | None] = []
    for record in records:
        if record is not None and record.get(schema.KIND) == schema.KIND_STEP_ROWS:
            steps = _row_steps(record)
            if steps is None:
                expanded.append(None)
            else:
                expanded.extend(steps)
        else:
            expanded.append(record)
    return expanded


def _row_steps(record: dict[str, Any]) -> list[Any] | None:
    """A rows line's step records; None for one that is not as traceml writes it."""
    try:
        return row_records(record)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


class StepView(dict):
    """A step record read back, under the schema's field names: every field readable, by
    ``[]`` or ``get`` (compact records of rank schema 1.3+ leave unmeasured fields and
    defaults out; 2.0's short keys are spelled out)."""

    __slots__ = ()

    def __missing__(self, fieldname: str) -> Any:
        return step_field_default(self, fieldname)

    def get(self, fieldname: str, default: Any = None) -> Any:  # type: ignore[override]
        if fieldname in self:
            return self[fieldname]
        value = step_field_default(self, fieldname)
        return default if value is None else value


def read_records(path: Path) -> list[dict[str, Any] | None]:
    """Every record of a rank file, in order, steps as :class:`StepView` (for tools and
    tests that look at single records; the reducer reads columns instead)."""
    return parse_lines([line for line in Path(path).read_bytes().split(b"\n") if line])


def _parse_chunk(lines: list[bytes]) -> list[dict[str, Any] | None]:
    """JSON lines to dicts (None for a damaged line); one orjson call for the whole chunk in
    the common case."""
    if not lines:
        return []
    try:
        records = orjson.loads(b"[" + b",".join(lines) + b"]")
        if all(type(record) is dict for record in records):
            return records
    except orjson.JSONDecodeError:
        pass
    parsed: list[dict[str, Any] | None] = []
    for line in lines:
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            record = None
        parsed.append(record if isinstance(record, dict) else None)
    return parsed


def read_rank_file(path: Path, rank: int) -> RankRecords:
    data = RankRecords(rank=rank, path=path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        data.unreadable = exc.strerror or type(exc).__name__
        return data
    ends_cleanly = raw.endswith(b"\n") or not raw
    lines = [line for line in raw.split(b"\n") if line]
    del raw
    columns = data.columns
    total = len(lines)
    for start in range(0, total, _CHUNK_LINES):
        parsed = _parse_chunk(lines[start : start + _CHUNK_LINES])
        # Nearly every line is a well-formed step: take those in one pass, look at the rest.
        steps = [
            record
            for record in parsed
            if record is not None
            and record.get(schema.KIND) == schema.KIND_STEP
            and (record.get(_STEP_KEY) is not None or record.get(schema.STEP) is not None)
        ]
        if len(steps) == len(parsed):
            _append_columns(columns, steps, data.compact)
            continue
        # Telemetry samples come about once a second, so most chunks hold a few: keep those
        # chunks on the fast path too.
        samples = [r for r in parsed if r is not None and r.get(schema.KIND) == schema.KIND_SAMPLE]
        if samples and len(steps) + len(samples) == len(parsed):
            _append_columns(columns, steps, data.compact)
            data.samples.extend(samples)
            continue
        steps = _sort_records(data, parsed, start == total - len(parsed) and not ends_cleanly)
        _append_columns(columns, steps, data.compact)
    return data


def _sort_records(data: RankRecords, parsed: list[dict[str, Any] | None], cut_tail: bool) -> list:
    """A chunk's records put where they go in ``data``; its step records returned.
    ``cut_tail``: the chunk holds the file's last line, which ends without a newline."""
    steps = []
    for index, record in enumerate(parsed):
        if record is None:
            if cut_tail and index == len(parsed) - 1:
                data.truncated_tail = True
            else:
                data.bad_lines += 1
            continue
        kind = record.get(schema.KIND)
        if kind == schema.KIND_STEP:
            if record.get(_STEP_KEY) is None and record.get(schema.STEP) is None:
                data.bad_lines += 1
                continue
            steps.append(record)
        elif kind == schema.KIND_STEP_ROWS:
            rows = _row_steps(record)
            if rows is None:
                data.bad_lines += 1
            else:
                steps.extend(rows)
        elif kind == schema.KIND_HEADER and data.header is None:
            compact = _check_rank_schema(record, data.path)
            if compact is None:  # a damaged header: its steps are read as if it were absent
                data.bad_schema = repr(record.get(schema.SCHEMA))
                continue
            data.compact, data.header = compact, record
        elif kind == schema.KIND_EVENT:
            if record.get(schema.CODE) == schema.EVENT_INTEGRATION and data.header is not None:
                data.header = {**data.header, schema.INTEGRATION: record.get(schema.INTEGRATION)}
            data.events.append(record)
        elif kind == schema.KIND_FOOTER:
            data.footer = record
        elif kind == schema.KIND_INPUT:
            data.inputs.append({**record, schema.RANK: data.rank})
        elif kind == schema.KIND_SAMPLE:
            data.samples.append(record)
    return steps


_pick_columns = operator.itemgetter(*_COLUMNS)


def _append_columns(
    columns: dict[str, list[Any]], steps: list[dict[str, Any]], compact: bool = True
) -> None:
    """Transpose step records into columns: C-speed for files that spell every field (rank
    schema before 1.3); for compact records, only the fields the chunk carries are looked up
    (by their short key, rank schema 2.0, or their name, 1.3), and absent ones read as their
    defaults (schema.STEP_DEFAULTS, ZERO_WHEN_MEASURED) or null."""
    if not steps:
        return
    if not compact:
        try:
            rows = [_pick_columns(record) for record in steps]
        except KeyError:
            rows = None
        if rows is not None:
            for column, values in zip(_COLUMNS, zip(*rows, strict=True), strict=True):
                columns[column].extend(values)
            return
    present = set().union(*steps)
    count = len(steps)
    for column in _COLUMNS:
        default = schema.STEP_DEFAULTS.get(column) if compact else None
        key = _KEY.get(column, column)
        if key not in present:
            key = column
        if key in present:  # dict.get through map: no Python frame per record
            columns[column].extend(map(dict.get, steps, repeat(key), repeat(default)))
        else:
            columns[column].extend([default] * count)
    if compact:
        for marker, fields in schema.ZERO_WHEN_MEASURED.items():
            if marker in present or _KEY[marker] in present:
                _zero_where_measured(columns, marker, fields, count)


def _zero_where_measured(
    columns: dict[str, list[Any]], marker: str, fields: tuple[str, ...], count: int
) -> None:
    """In the last ``count`` rows: an absent field of a measured group is 0, not null."""
    measured = [value is not None for value in columns[marker][-count:]]
    for fieldname in fields:
        column = columns.get(fieldname)
        if column is None:
            continue
        zero = 0 if fieldname in (schema.COMM_COUNT, schema.COMM_BYTES) else 0.0
        column[-count:] = [
            zero if value is None and was else value
            for value, was in zip(column[-count:], measured, strict=True)
        ]


def _check_rank_schema(header: dict[str, Any], path: Path) -> bool | None:
    """Refuse a file a newer traceml wrote; whether its steps are compact (schema 1.3+);
    None for a header whose schema is damaged or never existed (one rank's damaged header
    leaves the other ranks' report whole: the reducer notes the bad line)."""
    family, supported_major = schema.family_and_major(schema.RANK_SCHEMA)
    major = schema.schema_major(header.get(schema.SCHEMA), family)
    if major is None or major < 1:
        return None
    if major > supported_major:
        raise ReduceError(
            f"{path} has schema {header.get(schema.SCHEMA)}; this traceml reads "
            f"{family}/{supported_major}.x and older (install the traceml version that "
            "wrote it)"
        )
    if major > 1:
        return True
    minor = str(header.get(schema.SCHEMA)).rpartition(".")[2]
    return not minor.isdigit() or int(minor) >= schema.COMPACT_STEPS_SINCE_MINOR
