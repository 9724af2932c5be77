"""A compact step record (rank schema 2.0) that still answers every field.

Writers put only what was measured in a step line, under its short key (STEP_KEYS below;
schema.STEP_DEFAULTS and schema.ZERO_WHEN_MEASURED say what an absent field stands for); the
capture side reads any field of it by its schema name, as null when unmeasured, never 0.
Shared base: no wing imported.
"""

from __future__ import annotations

from traceml import schema
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


# Rank schema 2.0: step lines spell their fields with these short keys (about half the bytes
# of a CUDA DDP line went to key names); the header declares the map (schema.HEADER_STEP_KEYS)
# so a file explains itself. Readers turn them back into the schema's names at once: nothing after
# the reader sees a short key. "kind" stays as it is, since every record kind has it.
_PHASE_KEYS = {
    schema.INPUT_WAIT: "in",
    schema.H2D: "h2d",
    schema.FORWARD: "fw",
    schema.BACKWARD: "bw",
    schema.OPTIMIZER: "op",
    schema.RESIDUAL: "rs",
}
STEP_KEYS: dict[str, str] = {
    schema.STEP_INDEX: "i",
    schema.GLOBAL_STEP: "g",
    schema.EPOCH: "e",
    schema.MICROBATCHES: "mb",
    schema.OPTIMIZER_STEPPED: "os",
    schema.T_START_MS: "t",
    schema.GAP_MS: "gap",
    schema.STEP: "st",
    **_PHASE_KEYS,
    schema.RSS: "rss",
    schema.TRACEML_COST_US: "tu",
    **{
        schema.GPU_OF_PHASE[phase]: "g" + _PHASE_KEYS[phase]
        for phase in schema.GPU_OF_PHASE
        if phase != schema.STEP
    },
    schema.GPU_STEP: "gst",
    schema.MEM_PEAK_ALLOCATED: "ma",
    schema.MEM_PEAK_RESERVED: "mr",
    schema.COMM: "c",
    **{name: "c" + _PHASE_KEYS[phase] for phase, name in schema.COMM_OF_PHASE.items()},
    schema.COMM_COUNT: "cn",
    schema.COMM_BYTES: "cb",
    schema.GPU_COMM: "gc",
    **{name: "gc" + _PHASE_KEYS[phase] for phase, name in schema.GPU_COMM_OF_PHASE.items()},
}
STEP_FIELD_OF_KEY: dict[str, str] = {key: name for name, key in STEP_KEYS.items()}


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
    """A step record as written: short keys (STEP_KEYS), only measured fields. Read by
    schema names: ``record[field]`` of an absent field is its default or None, never a
    KeyError; ``get`` and ``in`` see only what is there. Serialisation sees the short keys
    (orjson writes dict subclasses as dicts)."""

    __slots__ = ()

    def __missing__(self, fieldname: str) -> object:
        key = STEP_KEYS.get(fieldname)
        if key is not None and dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        return step_field_default(self, fieldname)

    def get(self, fieldname: str, default: object = None) -> object:  # type: ignore[override]
        return dict.get(self, STEP_KEYS.get(fieldname, fieldname), default)

    def __contains__(self, fieldname: object) -> bool:
        return dict.__contains__(self, STEP_KEYS.get(fieldname, fieldname))  # type: ignore[call-overload]
