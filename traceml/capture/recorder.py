"""One rank's record of one traced training: its header, events, step records and footer.

The callback decides *what* happened; this object owns *how it is written*: the rank file
(through the batching sink: steps and samples are queued, the rest is written at once), the
header written once, the ``trace_max_steps`` limit, and the footer written once with the run's
status. Nothing here talks to Lightning.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from traceml import schema
from traceml.capture.rss import rss_high_water_mark
from traceml.capture.sink import RankSink, SinkError
from traceml.settings import Settings
from traceml.step_record import STEP_FIELD_OF_KEY, STEP_KEYS
from traceml.versions import package_versions

_COST_KEY = STEP_KEYS[schema.TRACEML_COST_US]  # a step record's own key


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class RankRecorder:
    def __init__(self, settings: Settings, rank_info: dict[str, Any]) -> None:
        self.settings = settings
        self.rank_info = rank_info
        self.sink: RankSink | None = None
        self.header_written = False
        self.footer_written = False
        self.steps_written = 0
        # Events before the header (a note from a door that runs before training starts):
        # written right after it, so that a rank file's first line is always its header.
        self._early_events: list[dict[str, Any]] = []
        self._said: set[tuple[Any, ...]] = set()  # (level, code, message): each said once
        # True once trace_max_steps records are written (an attribute: read twice a step).
        self._step_limit = settings.trace_max_steps
        self.limit_reached = self._step_limit is not None and self._step_limit <= 0
        self._write_ns_counted = 0  # the sink's write time already added to a step's cost
        self.status: str | None = None
        self.error: str | None = None
        self.error_type: str | None = None

    # -- the file --------------------------------------------------------------------------

    def open(self) -> str | None:
        """Create this rank's file; the reason it could not be created, or None."""
        rank = self.rank_info[schema.RANK]
        sink = RankSink(self.settings.run_dir / schema.RANKS_DIR / schema.rank_file_name(rank))
        try:
            sink.open()
        except SinkError as exc:
            return str(exc)
        self.sink = sink
        return None

    @property
    def is_open(self) -> bool:
        return self.sink is not None and self.sink.is_open and not self.footer_written

    def write_header(self, header: dict[str, Any]) -> None:
        if self.header_written or self.sink is None:
            return
        self.header_written = True
        self.sink.write(header)
        early, self._early_events = self._early_events, []
        for record in early:
            self.sink.write(record)

    def _event(self, record: dict[str, Any]) -> None:
        if not self.is_open:
            return
        said = (record.get(schema.LEVEL), record[schema.CODE], record.get(schema.MESSAGE))
        if said[2] is not None and said in self._said:
            return  # a door that runs at set-up and again at the start says its note once
        self._said.add(said)
        if self.header_written:
            self.sink.write(record)
        else:
            self._early_events.append(record)

    def event(self, level: str, code: str, message: str) -> None:
        self._event(
            {
                schema.KIND: schema.KIND_EVENT,
                schema.LEVEL: level,
                schema.CODE: code,
                schema.MESSAGE: message,
                "at_step": self.steps_written,
            }
        )

    def integration(self, name: str) -> None:
        """The header's integration, named again (schema.EVENT_INTEGRATION)."""
        self._event(
            {
                schema.KIND: schema.KIND_EVENT,
                schema.CODE: schema.EVENT_INTEGRATION,
                schema.INTEGRATION: name,
                "at_step": self.steps_written,
            }
        )

    def samples(self, records: list[dict[str, Any]]) -> None:
        """Append telemetry samples, each stamped with the steps written before it."""
        if not self.is_open:
            return
        for record in records:
            record[schema.AT_STEP] = self.steps_written
            self.sink.append(record)

    @property
    def write_ns(self) -> int:
        """Time spent in the rank file's system calls so far (any thread)."""
        return self.sink.write_ns if self.sink is not None else 0

    # -- steps -----------------------------------------------------------------------------

    def step(self, record: Any) -> bool:
        """Append one step record. False when the file can no longer be written (the sink has
        warned once); a record past ``trace_max_steps`` is dropped and counts as written."""
        sink = self.sink
        if sink is None or self.footer_written:
            return False
        if not self.count_step(record):
            return True  # steps still queued for their CUDA events when the limit was reached
        return sink.append(record)

    def count_step(self, record: Any) -> bool:
        """Count one step record about to be queued (its cost field gets the flusher's write
        time since the last one); False past ``trace_max_steps``: not to be written. The
        sink's replay of door events (``step_events``) queues what it counts itself."""
        if self.limit_reached or self.footer_written:
            return False
        written = self.sink.write_ns
        if written != self._write_ns_counted:
            self._count_write_time(record, written)
        self.steps_written += 1
        if self._step_limit is not None and self.steps_written >= self._step_limit:
            self.limit_reached = True
        return True

    def count_rows(self, count: int) -> tuple[int, int]:
        """:meth:`count_step` for ``count`` usual steps written as one rows line
        (``step_rows``): how many may be written (fewer at ``trace_max_steps``), and the
        flusher's write time (ns) that the first one's cost field counts."""
        if self.limit_reached or self.footer_written:
            return 0, 0
        limit = self._step_limit
        if limit is not None and self.steps_written + count >= limit:
            count = limit - self.steps_written
            self.limit_reached = True
        self.steps_written += count
        written = self.sink.write_ns
        write_ns, self._write_ns_counted = written - self._write_ns_counted, written
        return count, write_ns

    def _count_write_time(self, record: Any, written: int) -> None:
        """The rank file is written on the flusher thread, outside every entry point: that is
        traceml's cost too, counted with the step that follows it (about every 250 ms)."""
        # A dict (the CUDA path), or a closed step whose record the flusher builds (its
        # session fields in ``extra``).
        fields = record if isinstance(record, dict) else record.extra
        cost = fields.get(_COST_KEY)
        if cost is not None:
            fields[_COST_KEY] = round(cost + (written - self._write_ns_counted) / 1000.0, 1)
            self._write_ns_counted = written

    @property
    def bad_record(self) -> str | None:
        """Why a queued record could not be made (the sink dropped it), or None."""
        return self.sink.bad_record if self.sink is not None else None

    def flush(self) -> bool:
        """Everything queued written now (its records built); False when the file is off."""
        return self.sink is not None and self.sink.flush()

    # -- the end ---------------------------------------------------------------------------

    def finish(self) -> None:
        """Write the footer and close the file (once)."""
        if self.footer_written or self.sink is None:
            return
        self.footer_written = True
        footer = {
            schema.KIND: schema.KIND_FOOTER,
            schema.STATUS: self.status or schema.STATUS_COMPLETED,
            schema.STEPS: self.steps_written,
            schema.ENDED_AT: utc_now(),
        }
        if self.error:
            footer[schema.ERROR] = self.error
        if self.error_type:
            footer[schema.ERROR_TYPE] = self.error_type
        footer[schema.RSS_HWM] = rss_high_water_mark()
        self.sink.write(footer)
        self.sink.close()

    def ended_by(self, exception: BaseException) -> None:
        """Record why training stopped: Ctrl-C / SIGTERM are 'interrupted', the rest 'exception'."""
        interrupted = isinstance(exception, KeyboardInterrupt) or (
            type(exception).__name__ == "SIGTERMException"
        )
        self.status = schema.STATUS_INTERRUPTED if interrupted else schema.STATUS_EXCEPTION
        message = str(exception).strip().splitlines()
        self.error = type(exception).__name__ + (f": {message[0]}" if message else "")
        self.error_type = type(exception).__name__


def build_header(
    settings: Settings,
    rank_info: dict[str, Any],
    *,
    integration: str,
    device: dict[str, Any],
    clock_origin_unix: float,
    timing: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    script = sys.argv[0] if sys.argv and sys.argv[0] else None
    header: dict[str, Any] = {
        schema.KIND: schema.KIND_HEADER,
        schema.SCHEMA: schema.RANK_SCHEMA,
        schema.HEADER_STEP_KEYS: STEP_FIELD_OF_KEY,
        schema.RUN: settings.run_name,
        **rank_info,
        schema.HOST: socket.gethostname(),
        schema.PID: os.getpid(),
        schema.JOB: _job_identity(),
        schema.STARTED_AT: utc_now(),
        schema.CLOCK_ORIGIN_UNIX: clock_origin_unix,
        schema.VERSIONS: package_versions(),
        schema.DEVICE: device,
        schema.TIMING: timing,
        schema.SCRIPT: Path(script).name if script else None,
        schema.INTEGRATION: integration,
        schema.SETTINGS: {"trace_max_steps": settings.trace_max_steps},
    }
    header.update(extra or {})
    return header


def _job_identity() -> str | None:
    """Every rank of one launch reads the same; two launches at once cannot (a rendezvous port
    is one job's while it runs; --standalone draws a run id per job). Not the rendezvous
    address: with a static rendezvous each node's workers get their own node's spelling."""
    parts = [os.environ.get(name, "") for name in ("TORCHELASTIC_RUN_ID", "MASTER_PORT")]
    return "|".join(parts) if any(parts) else None
