"""Rank files -> summary dict. Pure Python; never imports torch or Lightning.

The reduction is a pipeline of small modules, each entered once:
:mod:`rankfile` (read) -> :mod:`clean` (check values) -> :mod:`reduce_rank` (one rank's part,
with :mod:`notes`) -> :mod:`reduce_run` (add the parts up). Damage is reported, never raised:
a truncated last line, a missing footer, a missing rank, an empty file, a value of the wrong
type, a negative time each become a note. Only two things are errors: no rank files at all, and
a rank file of a newer schema than this traceml understands.

This module keeps the names callers have always imported from here.
"""

from __future__ import annotations

from traceml.analysis.clean import clean_records
from traceml.analysis.notes import rank_notes
from traceml.analysis.rankfile import (
    RankRecords,
    list_rank_files,
    parse_lines,
    read_rank_file,
    scan_rank_files,
)
from traceml.analysis.reduce_rank import (
    TIMELINE_BINS,
    reduce_rank,
    shares_from_sums,
    summarise_rank,
    summarise_records,
)
from traceml.analysis.reduce_run import reduce_records, reduce_run
from traceml.errors import ReduceError

__all__ = [
    "TIMELINE_BINS",
    "RankRecords",
    "ReduceError",
    "clean_records",
    "list_rank_files",
    "parse_lines",
    "rank_notes",
    "read_rank_file",
    "reduce_rank",
    "reduce_records",
    "reduce_run",
    "scan_rank_files",
    "shares_from_sums",
    "summarise_rank",
    "summarise_records",
]
