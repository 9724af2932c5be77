"""The one clock every capture module reads: monotonic, in integer nanoseconds.

Modules bind ``clock_ns`` at import (``from traceml.capture.clock import clock_ns``), which is
as cheap as a local name on the hot path and lets a test patch one module's clock.
"""

from __future__ import annotations

import time

clock_ns = time.perf_counter_ns
NS_PER_MS = 1_000_000
