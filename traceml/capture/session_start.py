"""Getting a :class:`~traceml.capture.session.Session` from IDLE to TRACING.

:func:`open_session` creates the rank file (and agrees on the run name with rank 0, and wraps
DDP's hook registration before the model is wrapped); :func:`start_session` starts the clock
and the parts (device timer, telemetry, comm timer) and writes the header.
"""

from __future__ import annotations

import time
from typing import Any

from traceml import console, schema
from traceml.capture import rss, step_clock
from traceml.capture.clock import clock_ns
from traceml.capture.lifecycle import DISABLED, READY, TRACING, UNSUPPORTED
from traceml.capture.recorder import RankRecorder, build_header
from traceml.capture.session_parts import describe_device


def open_session(session: Any, rank_info: dict[str, Any], unsupported_reason: str | None) -> bool:
    """IDLE -> READY with the rank file open; False when unsupported or not writable."""
    import os

    from traceml.capture import at_exit
    from traceml.capture.run_name import adopt_rank_zero_run_name, restart_count, restarted

    session.pid = os.getpid()
    session.rank_info = rank_info
    rank = rank_info[schema.RANK]
    console.set_rank(rank)
    restarts = restart_count()
    session.settings = restarted(session.settings, restarts)
    agree = not session.settings.run_name_explicit and rank_info[schema.WORLD_SIZE] > 1
    if agree and rank != 0:
        session.settings = adopt_rank_zero_run_name(session.settings, rank)
    try:
        recorder, problem = _open_rank_file(session, rank_info)
    finally:  # (also if that raised: the others wait for it)
        if agree and rank == 0:
            adopt_rank_zero_run_name(session.settings, rank)  # the name it writes, for them
    _note_restart(session, rank, restarts)
    if problem is not None:
        session.life.move(DISABLED)
        console.warn(f"{problem}; tracing disabled, training continues", all_ranks=True)
        return False
    session.recorder = recorder
    at_exit.register(session)
    if unsupported_reason:
        session.mark_unsupported(unsupported_reason)
        return False
    if rank_info[schema.WORLD_SIZE] > 1:
        _prepare_comm_timing(session)
    session.life.move(READY)
    return True


def _open_rank_file(session: Any, rank_info: dict[str, Any]) -> tuple[RankRecorder, str | None]:
    """The recorder with its rank file open, or the reason it is not. A name traceml derived
    (script and launch second) whose rank 0 file another run wrote already (two launches in
    one second) takes the first free ``-2``, ``-3``... on rank 0, as ``traceml run`` does; the
    other ranks take rank 0's name. A name the user chose is never changed."""
    settings = session.settings
    recorder = RankRecorder(settings, rank_info)
    problem = recorder.open()
    rank = rank_info[schema.RANK]
    if problem is None or settings.run_name_explicit or rank != 0:
        return recorder, problem
    taken = settings.run_name
    for number in range(2, 100):
        if not (settings.run_dir / schema.RANKS_DIR / schema.rank_file_name(rank)).exists():
            break  # not a name taken: the reason stands
        settings = settings.replace(run_name=f"{taken}-{number}")
        recorder = RankRecorder(settings, rank_info)
        problem = recorder.open()
        if problem is None:
            from traceml.settings import pin_run_name

            session.settings = settings
            pin_run_name(settings)  # processes it starts later join this run
            session.notes.append(
                {
                    "level": "warning",
                    "code": schema.EVENT_NOTE,
                    "message": f"the run name {taken} was taken by another run; this run is "
                    f"{settings.run_name}",
                }
            )
            break
    return recorder, problem


def _note_restart(session: Any, rank: int, restarts: int) -> None:
    """torchrun restarted the job (--max-restarts): this run is one attempt of it."""
    if not restarts or rank != 0 or session.settings.launcher_managed:
        return
    from traceml.capture.run_name import earlier_attempts

    earlier = earlier_attempts(session.settings.run_name, restarts)
    session.notes.append(
        {
            "level": "warning",
            "code": schema.EVENT_NOTE,
            "message": f"torchrun restarted this job (restart {restarts}): this run is that "
            f"attempt only; the earlier attempts are runs of their own ({', '.join(earlier[:3])}"
            + (", ...)" if len(earlier) > 3 else ")"),
        }
    )


def mark_unsupported(session: Any, reason: str) -> None:
    """READY -> UNSUPPORTED: the setup is named, in the file and in one warning."""
    session.life.move(UNSUPPORTED)
    session.recorder.status = schema.STATUS_UNSUPPORTED
    console.warn(f"not tracing: {reason} is not supported; training runs natively")
    session.write_header(timing="host")
    session.recorder.event("warning", schema.EVENT_UNSUPPORTED, f"{reason} is not supported")


def _prepare_comm_timing(session: Any) -> None:
    """Multi-rank run: the DDP hook registration is wrapped now, before the model is wrapped
    (and the user registers a hook of their own); the rest is installed at start."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.nn.parallel import DistributedDataParallel

    from traceml.capture.instruments.distributed import CommTimer

    session.comm = CommTimer(on_failure=session.disable)
    session.cost_owners.append(session.comm)
    session.comm.wrap_hook_registration(DistributedDataParallel)
    session.add_undo(session.comm.uninstall)


def start_session(
    session: Any,
    device: Any,
    loop_facts: dict[str, Any],
    gpu: Any,
    ddp_model: Any,
    origin_ns: int | None = None,
) -> None:
    """READY -> TRACING: the clock starts, the parts are installed, the header is written."""
    session.device = device
    now = clock_ns()
    origin = now if origin_ns is None else min(origin_ns, now)
    session.clock = step_clock.StepClock(origin_ns=origin)
    session._clock_origin_unix = time.time() - (now - origin) / 1e9
    session.gpu = gpu
    session._rss = rss.rss_reader()
    _start_telemetry(session, device)
    session.header_extra = dict(loop_facts)
    if session.comm is not None:
        _start_comm_timing(session, ddp_model)
    session.write_header(timing="host+cuda_events" if session.gpu else "host")
    for note in session.notes:
        session.recorder.event(note.get("level", "info"), note["code"], note["message"])
    if session.rank_info[schema.RANK] == 0 and not session.settings.launcher_managed:
        from traceml.capture.run_end import announce_direct_launch

        announce_direct_launch(session.settings.run_dir)  # the launcher prints its own
    session.life.move(TRACING)


def _start_telemetry(session: Any, device: Any) -> None:
    """Host CPU/memory and allocator samples about once a second (``telemetry``): its own
    thread, its own guarded calls; a failure there stops telemetry only."""
    from traceml.capture.telemetry import sampler_for

    sampler = sampler_for(device, session.clock.origin_ns)
    if sampler is not None:
        sampler.start()
        session.telemetry = sampler


def _start_comm_timing(session: Any, ddp_model: Any) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    comm = session.comm
    comm.clock = session.clock
    comm.gpu = session.gpu
    session.clock.comm_enabled = True
    if session.gpu is not None:
        session.gpu.comm_enabled = True
    if isinstance(ddp_model, DistributedDataParallel):
        comm.attach_buckets(ddp_model)
    comm.install_collectives(dist)
    comm.active = True
    session.header_extra[schema.COMM_TIMING] = "host+cuda_events" if session.gpu else "host"
    session.header_extra[schema.BUCKET_TIMING] = comm.bucket_timing
    if comm.bucket_note:
        session.notes.append(
            {
                "level": "warning",
                "code": schema.EVENT_BUCKET_TIMING_OFF,
                "message": f"DDP gradient-bucket timing is off: {comm.bucket_note}",
            }
        )


def write_header(session: Any, timing: str) -> None:
    """The rank file's header (once the clock's timing kind is known)."""
    if session.recorder is None:
        return
    session.recorder.write_header(
        build_header(
            session.settings,
            session.rank_info,
            integration=session.integration,
            device=describe_device(session.device),
            clock_origin_unix=session._clock_origin_unix,
            timing=timing,
            extra=session.header_extra,
        )
    )
