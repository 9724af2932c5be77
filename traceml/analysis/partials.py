"""Per-node partial reductions (issue 24): reduce on every node, merge small partials.

At the end of a run each node reduces its own rank files (those whose header names its node)
into ``<run_dir>/partials/node_<N>.json``: the ranks' parts exactly as a single pass makes
them (per-rank statistics, quantile sketches, notes, telemetry, input records) and the node's
share of the job series (:mod:`node_series`). The report then merges the partials it can
trust and reads the rank files of the rest, so a node that died costs a note, not the report.

A partial is trusted only if it was made with the same warm-up and every rank file it covers
still has the size and modification time it had then; otherwise those files are read again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from traceml import schema
from traceml.analysis.clean import is_count, is_number
from traceml.analysis.job_series import JobSeriesAccumulator
from traceml.analysis.node_series import NodeSeries, node_of
from traceml.analysis.node_sketches import NodeSketches
from traceml.analysis.rankfile import scan_rank_files
from traceml.analysis.reduce_rank import summarise_ranks
from traceml.files import write_atomically

_PART_KEYS = (
    "entry",
    "sketches",
    "share_sums",
    "notes",
    "max_steps_message",
    "status",
    "header",
    "inputs",
)


# What the merge reads from each part's entry: counts it adds, figures it takes the largest of,
# and each field's statistics (reduce_run's _FieldTotals and _overall).
_ENTRY_COUNTS = (
    schema.RANK,
    schema.SUMMARY_STEPS_RECORDED,
    schema.SUMMARY_STEPS_ANALYSED,
    schema.SUMMARY_WARMUP,
)
_ENTRY_FIGURES = (
    schema.STEPS_PER_S,
    schema.PEAK_ALLOCATED,
    schema.PEAK_RESERVED,
    schema.PEAK_RSS,
    schema.BETWEEN_STEPS_MS,
    schema.AFTER_LAST_STEP_MS,
    schema.WALL_MS,
)
_STATISTICS = ("sum", "mean", "min", "median", "p90", "max")


def partial_path(run_dir: Path, node: int) -> Path:
    return Path(run_dir) / schema.PARTIALS_DIR / f"node_{node}.json"


def _file_stamp(path: Path) -> list[int] | None:
    try:
        status = path.stat()
    except OSError:
        return None
    return [status.st_size, status.st_mtime_ns]


def _header_node(path: Path) -> int:
    """The node a rank file's header names (-1 when it has no readable header)."""
    try:
        with open(path, "rb") as handle:
            header = orjson.loads(handle.readline())
    except (OSError, orjson.JSONDecodeError):
        return -1
    return node_of(header) if isinstance(header, dict) else -1


def node_rank_files(run_dir: Path, node: int) -> dict[int, Path]:
    """The rank files written on ``node`` (by their headers: ranks need not be contiguous)."""
    files, _skipped = scan_rank_files(run_dir)
    return {rank: path for rank, path in files.items() if _header_node(path) == node}


def reduce_node(run_dir: Path, node: int, warmup: int, jobs: int = 1) -> Path | None:
    """Reduce ``node``'s rank files into its partial; the partial's path, None when the node
    wrote no rank file here."""
    files = node_rank_files(run_dir, node)
    if not files:
        return None
    stamps = {str(rank): _file_stamp(path) for rank, path in files.items()}
    series = JobSeriesAccumulator()
    sketches: dict[int, NodeSketches] = {}
    parts = []
    for part in summarise_ranks(files, warmup, jobs):
        node_here = node_of(part["header"])
        series.add(part.pop("job_series", None), node_here)
        for fieldname, sketch in part.pop("sketches").items():
            sketches.setdefault(node_here, NodeSketches()).add(fieldname, sketch)
        part["sketches"] = {}  # the node's sketches stand for them (see node_sketches.py)
        parts.append(part)
    for group in sketches.values():
        group.finish()  # as the single pass does when it takes the run's quantiles
    nodes = {node_of(part["header"]) for part in parts}
    states = {
        str(n): series.node(n).to_state() for n in sorted(nodes) if series.node(n) is not None
    }
    partial = {
        schema.SCHEMA: schema.PARTIAL_SCHEMA,
        schema.NODE_RANK: node,
        schema.SUMMARY_WARMUP: warmup,
        "files": stamps,
        "parts": parts,
        "job_series": states,
        "sketches": {str(n): group.to_state() for n, group in sorted(sketches.items())},
    }
    path = partial_path(run_dir, node)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, orjson.dumps(partial))
    return path


class LoadedPartials:
    """What the trusted partials of a run directory hold."""

    def __init__(self) -> None:
        self.parts: list[dict[str, Any]] = []
        self.series: dict[int, NodeSeries] = {}
        self.sketches: dict[int, NodeSketches] = {}
        self.covered: set[int] = set()
        self.nodes: list[int] = []
        self.notes: list[str] = []
        self.seen = False  # some partial exists (trusted or not)


def load_partials(run_dir: Path, files: dict[int, Path], warmup: int) -> LoadedPartials:
    """The partials of ``run_dir`` that can stand in for their rank files, and notes on the
    ones that cannot."""
    loaded = LoadedPartials()
    directory = Path(run_dir) / schema.PARTIALS_DIR
    try:
        paths = sorted(directory.glob("node_*.json")) if directory.is_dir() else []
    except OSError:
        paths = []
    for path in paths:
        loaded.seen = True
        try:
            partial = orjson.loads(path.read_bytes())
            why = _untrusted(partial, files, warmup, loaded.covered)
            if why is None:
                series = {
                    int(n): NodeSeries.from_state(s) for n, s in partial["job_series"].items()
                }
                sketches = {
                    int(n): NodeSketches.from_state(s) for n, s in partial["sketches"].items()
                }
        except (
            OSError,
            orjson.JSONDecodeError,
            KeyError,
            TypeError,
            ValueError,
            AttributeError,
        ) as exc:
            why = f"unreadable ({type(exc).__name__})"
        if why is not None:
            loaded.notes.append(f"{path.name}: {why}; that node's rank files were read instead")
            continue
        loaded.parts.extend(partial["parts"])
        loaded.series.update(series)
        loaded.sketches.update(sketches)
        loaded.covered.update(int(rank) for rank in partial["files"])
        loaded.nodes.append(partial[schema.NODE_RANK])
    return loaded


def _untrusted(partial: Any, files: dict[int, Path], warmup: int, covered: set[int]) -> str | None:
    """Why ``partial`` cannot stand in for its rank files (None: it can)."""
    if not isinstance(partial, dict):
        return "not a partial"
    family, major = schema.family_and_major(schema.PARTIAL_SCHEMA)
    if schema.schema_major(partial.get(schema.SCHEMA), family) != major:
        return f"schema {partial.get(schema.SCHEMA)!r} is not one this traceml reads"
    if partial.get(schema.SUMMARY_WARMUP) != warmup:
        return "made with another warm-up setting"
    stamps = partial["files"]
    ranks = [int(rank) for rank in stamps]
    if any(rank in covered for rank in ranks):
        return "covers ranks another partial covers"
    for rank in ranks:
        path = files.get(rank)
        if path is None or _file_stamp(path) != stamps[str(rank)]:
            return f"rank {rank}'s file changed since it was made"
    parts = partial["parts"]
    if sorted(part["entry"][schema.RANK] for part in parts) != sorted(ranks):
        return "its parts do not match its ranks"
    if any(key not in part for part in parts for key in _PART_KEYS):
        return "a part lacks fields"
    if not all(_numbers_usable(part) for part in parts):
        return "a part's figures are not numbers"
    return None


def _numbers_usable(part: dict[str, Any]) -> bool:
    """Whether the figures the merge adds up are numbers: the partial is not re-checked as
    rank files are (clean.py), so a damaged value would otherwise reach the arithmetic."""
    entry, sums = part["entry"], part["share_sums"]
    described = entry.get(schema.PHASE_STATS) if isinstance(entry, dict) else None
    if not isinstance(described, dict) or not isinstance(sums, dict):
        return False
    return (
        all(is_count(entry.get(key)) for key in _ENTRY_COUNTS)
        and all(key in entry and _optional_number(entry[key]) for key in _ENTRY_FIGURES)
        and all(stats is None or _statistics_usable(stats) for stats in described.values())
        and all(isinstance(pair, list) and len(pair) == 2 for pair in sums.values())
        and all(is_number(value) for pair in sums.values() for value in pair)
        and isinstance(part["sketches"], dict)
        and all(_sketch_usable(sketch) for sketch in part["sketches"].values())
        and _timeline_usable(entry.get(schema.TIMELINE))
        and isinstance(entry.get(schema.TELEMETRY), (dict, type(None)))
        and (part["header"] is None or isinstance(part["header"], dict))
        and isinstance(part["notes"], list)
        and isinstance(part["inputs"] or [], list)
    )


def _sketch_usable(sketch: Any) -> bool:
    return (
        isinstance(sketch, list)
        and len(sketch) == 2
        and isinstance(sketch[0], list)
        and all(is_number(value) for value in sketch[0])
        and is_number(sketch[1])
    )


def _timeline_usable(timeline: Any) -> bool:
    """None, or the per-rank timeline the report draws (``reduce_rank._timeline``)."""
    if timeline is None:
        return True
    bins = timeline.get("bins") if isinstance(timeline, dict) else None
    return (
        isinstance(bins, list)
        and is_count(timeline.get("steps_per_bin"))
        and all(isinstance(b, dict) and all(map(_optional_number, b.values())) for b in bins)
    )


def _optional_number(value: Any) -> bool:
    return value is None or is_number(value)


def _statistics_usable(stats: Any) -> bool:
    return (
        isinstance(stats, dict)
        and is_count(stats.get("count"))
        and all(is_number(stats.get(key)) for key in _STATISTICS)
    )


def missing_partials_note(loaded: LoadedPartials, read_nodes: set[int]) -> str | None:
    """When partials were used, the note on the nodes whose rank files had to be read."""
    if not loaded.seen or not read_nodes:
        return None
    named = sorted(node for node in read_nodes if node >= 0)
    which = (
        f"node{'s' if len(named) != 1 else ''} {', '.join(map(str, named))}"
        if named
        else "some ranks"
    )
    return (
        f"no usable partial reduction from {which} (not made yet, or the node stopped "
        "early): its rank files were read here instead"
    )


def usable_cpu_count() -> int:
    """The cores this process may run on (the default for --jobs)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
