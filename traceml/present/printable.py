"""Text for a terminal from strings a file supplied: run names, event messages and paths come
from rank files and summaries, which anyone can write. A control character among them (an
escape sequence, a carriage return) would act on the reader's terminal; each one is shown as
its ``\\xNN`` escape instead."""

from __future__ import annotations

import re

# C0 controls but the newline and the tab, DEL, and the C1 controls (an 8-bit CSI is 0x9b).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every control character but newline and tab escaped."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)
