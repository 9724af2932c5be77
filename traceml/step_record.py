"""A compact step record (rank schema 1.3) that still answers every field.

Writers put only what was measured in a step line (schema.STEP_DEFAULTS and
schema.ZERO_WHEN_MEASURED say what an absent field stands for); readers and the capture side
read any field of it, as null when unmeasured, never 0. Shared base: no wing imported.
"""

from __future__ import annotations

from traceml.schema import (
    COMM_BYTES,
    COMM_COUNT,
    COMM_FIELDS,
    EPOCH,
    GAP_MS,
    GLOBAL_STEP,
    GPU_COMM,
    GPU_COMM_OF_PHASE,
    GPU_FIELDS,
    KIND,
    MEM_PEAK_ALLOCATED,
    MEM_PEAK_RESERVED,
    MICROBATCHES,
    OPTIMIZER_STEPPED,
    PHASES,
    RSS,
    STEP,
    STEP_DEFAULTS,
    STEP_INDEX,
    T_START_MS,
    TRACEML_COST_US,
    ZERO_WHEN_MEASURED,
)

# Every field a step record may carry, in the order a writer puts them.
STEP_RECORD_FIELDS: tuple[str, ...] = (
    KIND,
    STEP_INDEX,
    GLOBAL_STEP,
    EPOCH,
    MICROBATCHES,
    OPTIMIZER_STEPPED,
    T_START_MS,
    GAP_MS,
    STEP,
    *PHASES,
    RSS,
    TRACEML_COST_US,
    *GPU_FIELDS,
    MEM_PEAK_ALLOCATED,
    MEM_PEAK_RESERVED,
    GPU_COMM,
    *GPU_COMM_OF_PHASE.values(),
    *COMM_FIELDS,
)


def step_field_default(record: dict, fieldname: str) -> object:
    """What an absent field of a compact step record stands for: its STEP_DEFAULTS value, 0
    for a wait of a kind the record measured (ZERO_WHEN_MEASURED), else None (unmeasured)."""
    if fieldname in STEP_DEFAULTS:
        return STEP_DEFAULTS[fieldname]
    for marker, fields in ZERO_WHEN_MEASURED.items():
        if fieldname in fields and record.get(marker) is not None:
            return 0 if fieldname in (COMM_COUNT, COMM_BYTES) else 0.0
    return None


class StepRecord(dict):
    """A step record as written (only measured fields, see STEP_DEFAULTS), which reads back
    every field: ``record[field]`` of an absent field is its default or None, never a
    KeyError. ``get`` and serialisation see only what is there (orjson writes dict
    subclasses as dicts)."""

    __slots__ = ()

    def __missing__(self, fieldname: str) -> object:
        return step_field_default(self, fieldname)
