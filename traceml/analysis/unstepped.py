"""Windows without an optimizer step are not steps.

The capture writes the microbatches left open when training stops inside an accumulation
window (``trainer.should_stop``, a batch start returning -1) or when a loop's epoch ends inside
one as a step record with ``optimizer_stepped: false``: time that was trained but updated
nothing. Counted as a step it made the step count exceed the optimizer's (``global_step``) and
could be the only "step" analysed. Set aside here before any statistic; its time (its gap and
its length) goes into the next step's gap, between steps, so wall time still adds up, and the
rank's note counts it.
"""

from __future__ import annotations

from traceml import schema
from traceml.analysis.clean import is_number
from traceml.analysis.rankfile import RankRecords


def set_aside(data: RankRecords) -> None:
    """Drop ``data``'s unstepped windows from its columns (in place), counted on ``data``."""
    flags = data.columns.pop(schema.OPTIMIZER_STEPPED, None)
    if not flags or flags.count(False) == 0:  # (a C-speed pass: nearly every run)
        return
    columns = data.columns
    gaps, lengths = columns[schema.GAP_MS], columns[schema.STEP]
    keep: list[int] = []
    carried = 0.0
    for index, flag in enumerate(flags):
        if flag is False:
            time_ms = sum(v for v in (gaps[index], lengths[index]) if is_number(v))
            data.unstepped += 1
            data.unstepped_ms += time_ms
            carried += time_ms
            continue
        if carried and is_number(gaps[index]):
            gaps[index] += carried
        carried = 0.0
        keep.append(index)
    for name, column in columns.items():
        columns[name] = [column[index] for index in keep]
