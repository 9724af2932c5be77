"""Which ranks a text table lists: every one up to ``RANK_ROWS``, the ones worth reading after.

A report of 256 ranks printed 563 lines, of 4,096 ranks 8,241 (helper review): a table nobody
reads to its end hides the rank it was printed for. Beyond ``RANK_ROWS`` ranks a table lists
the ranks highest by its own measure (the slowest step, the most memory), the lowest few (the
other end of the spread) and those that did not complete, in rank order; a last line says how
many it left out and where every rank is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RANK_ROWS = 16
HIGHEST, LOWEST = 8, 4


def rows_worth_reading(
    entries: list[Any],
    measure: Callable[[Any], float | None],
    unusual: Callable[[Any], bool] = lambda _entry: False,
) -> tuple[list[Any], int]:
    """``entries`` (in rank order) to list, and how many were left out. ``measure``: what the
    table ranks by (None: unmeasured, listed last); ``unusual``: an entry listed whatever its
    measure (a rank that crashed), while there is room."""
    if len(entries) <= RANK_ROWS:
        return list(entries), 0
    measured = [
        (value, index)
        for index, e in enumerate(entries)
        if _number(value := measure(e))  # (a damaged summary's text or null: unmeasured)
    ]
    measured.sort()
    chosen = {index for _value, index in measured[-HIGHEST:]}
    chosen |= {index for _value, index in measured[:LOWEST]}
    for index, entry in enumerate(entries):
        if len(chosen) >= RANK_ROWS:
            break
        if unusual(entry):
            chosen.add(index)
    shown = [entry for index, entry in enumerate(entries) if index in chosen]
    return shown, len(entries) - len(shown)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def left_out_line(left: int, highest: str) -> str:
    """The table's last line, when it left ranks out."""
    return (
        f"  ... {left} more ranks not listed (shown: the {HIGHEST} with the {highest}, the "
        f"{LOWEST} with the least, and any that did not complete; final_summary.json has every "
        "rank)"
    )
