"""Text for a terminal from strings a file supplied: run names, event messages and paths come
from rank files and summaries, which anyone can write. A control character among them (an
escape sequence, a carriage return) would act on the reader's terminal; each one is shown as
its ``\\xNN`` escape instead."""

from __future__ import annotations

import re

# C0 controls but the newline and the tab, DEL, and the C1 controls (an 8-bit CSI is 0x9b);
# and the bidirectional overrides and isolates, which reorder what a terminal shows (a run
# name that reads as another).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with every control character but newline and tab escaped."""
    return _CONTROL.sub(_escaped, text)


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
