"""Notes in English about what rank files say or lack (damage, events, missing ranks)."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from traceml import schema
from traceml.analysis.rankfile import RankRecords


def _no_header_note(data: RankRecords) -> str:
    rank = data.rank
    if data.bad_lines and data.step_count == 0:
        return f"rank {rank}: its file holds no readable record"
    if data.step_count == 0 and not data.events and data.footer is None:
        return f"rank {rank}: its file is empty (the process ended before training)"
    if data.bad_schema is not None:
        return (
            f"rank {rank}: its header's schema {data.bad_schema} is not a traceml rank schema "
            "(a damaged header); its steps were read as a headerless file's"
        )
    return f"rank {rank}: its file has no header line"


def _unstepped_note(data: RankRecords) -> list[str]:
    if not data.unstepped:
        return []
    return [
        f"rank {data.rank}: {data.unstepped} microbatch window(s) ended without an optimizer "
        "step (training stopped, or an epoch ended, inside an accumulation window): not "
        f"counted as steps; their {data.unstepped_ms:.1f} ms are between steps"
    ]


def rank_notes(data: RankRecords) -> tuple[list[str], str | None]:
    """Sentences about one rank file's gaps and events, and its trace-max-steps message."""
    rank = data.rank
    notes: list[str] = []
    max_steps_message: str | None = None
    if data.unreadable is not None:
        return [f"rank {rank}: its file cannot be read ({data.unreadable})"], None
    notes.extend(_damage_notes(data))
    if data.header is None:
        notes.append(_no_header_note(data))
    notes.extend(_unstepped_note(data))
    if data.truncated_tail:
        notes.append(
            f"rank {rank}: the last line was cut short (the process was probably killed); "
            f"{data.step_count} complete steps kept"
        )
    if data.bad_lines:
        # A damaged line may hold many steps (a rows line); the footer counts set-aside windows.
        written = (data.footer or {}).get(schema.STEPS)
        lost = written - data.step_count - data.unstepped if type(written) is int else 0
        notes.append(
            f"rank {rank}: {data.bad_lines} unreadable lines skipped"
            + (f", with {lost} of the {written} steps the rank wrote" if lost > 0 else "")
        )
    for event in data.events:
        code = event.get(schema.CODE)
        message = event.get(schema.MESSAGE, "")
        if code == schema.EVENT_UNSUPPORTED:
            notes.append(f"rank {rank}: not traced: {message}; it trained natively")
        elif code == schema.EVENT_DISABLED:
            notes.append(
                f"rank {rank}: tracing turned itself off after {event.get('at_step', '?')} "
                f"steps: {message}"
            )
        elif code == schema.EVENT_MAX_STEPS:
            max_steps_message = message
        elif code in (schema.EVENT_VERSION, schema.EVENT_NOTE, schema.EVENT_BUCKET_TIMING_OFF) and (
            message
        ):
            notes.append(f"rank {rank}: {message}")
    footer = data.footer
    if data.header is not None and footer is None:
        notes.append(
            f"rank {rank}: no footer: the process ended without closing its file "
            "(killed, or still running)"
        )
    elif footer is not None:
        status = footer.get(schema.STATUS)
        error = footer.get(schema.ERROR)
        if status == schema.STATUS_EXCEPTION:
            notes.append(
                f"rank {rank}: training failed after {data.step_count} steps"
                + (f" ({error})" if error else "")
            )
        elif status == schema.STATUS_INTERRUPTED:
            notes.append(
                f"rank {rank}: training was interrupted after {data.step_count} steps"
                + (f" ({error})" if error else "")
            )
    return notes, max_steps_message


def _damage_notes(data: RankRecords) -> list[str]:
    """Notes on what clean_records replaced, and on a header that names another rank."""
    rank = data.rank
    notes = []
    if data.bad_values:
        notes.append(
            f"rank {rank}: {data.bad_values} step value{'s' if data.bad_values != 1 else ''} "
            "of the wrong type or out of range (not a number, negative, huge) treated as "
            "unmeasured"
        )
    if data.bad_header_fields:
        notes.append(
            f"rank {rank}: header field{'s' if len(data.bad_header_fields) != 1 else ''} "
            f"{', '.join(data.bad_header_fields)} of the wrong type or out of range; ignored"
        )
    indices = [i for i in data.columns.get(schema.STEP_INDEX, ()) if isinstance(i, int)]
    disorder = sum(later <= earlier for earlier, later in pairwise(indices))
    if disorder:  # traceml numbers a rank's steps 0, 1, 2, ... in the order it writes them
        notes.append(
            f"rank {rank}: its step records are out of order or repeated ({disorder} "
            f"place{'s' if disorder != 1 else ''}): the file was edited, or two processes "
            "wrote it; each record counts as it stands, and the warm-up skipped is the first "
            "records in the file"
        )
    claimed = (data.header or {}).get(schema.RANK)
    if claimed is not None and claimed != rank:
        notes.append(f"rank {rank}: its header says rank {claimed}; the file name's rank is used")
    return notes


def dedupe_rank_notes(notes: list[str], ranks: int) -> list[str]:
    """'rank 0: X', 'rank 1: X' ... -> 'all N ranks: X' when every rank says the same."""
    by_text: dict[str, list[str]] = {}
    order: list[str] = []
    for note in notes:
        prefix, sep, text = note.partition(": ")
        key = text if sep and prefix.startswith("rank ") else note
        if key not in by_text:
            order.append(key)
        by_text.setdefault(key, []).append(note)
    result = []
    for key in order:
        group = by_text[key]
        # Every rank said it, not one rank several times: count the distinct rank prefixes.
        said_by = {note.partition(": ")[0] for note in group}
        if ranks > 1 and len(said_by) == ranks and group[0] != key:
            result.append(f"all {ranks} ranks: {key}")
        else:
            result.extend(group)
    return result


def rank_ranges(ranks: list[int], most: int = 20) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8" (the first ``most`` runs, then how many more)."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:most])
    return text + (f" and {len(runs) - most} more ranges" if len(runs) > most else "")


def missing_ranks_note(missing: list[int], headers: dict[int, dict[str, Any]]) -> str:
    ranks = rank_ranges(missing)
    per_node = None
    for header in headers.values():
        if (
            isinstance(header.get(schema.LOCAL_WORLD_SIZE), int)
            and header[schema.LOCAL_WORLD_SIZE] > 0
        ):
            per_node = header[schema.LOCAL_WORLD_SIZE]
            break
    text = f"rank{'s' if len(missing) > 1 else ''} {ranks} missing: no rank file"
    if per_node and len(missing) <= 4096:  # beyond that, a node list says nothing useful
        nodes = sorted({r // per_node for r in missing})
        seen_nodes = {h.get(schema.NODE_RANK) for h in headers.values()}
        absent = [n for n in nodes if n not in seen_nodes]
        if absent:
            text += (
                f" (node{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} wrote "
                "nothing here: is the logs dir on a filesystem all nodes share?)"
            )
        else:
            text += f" (node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))})"
    return text


def mixed_runs_note(headers: dict[int, dict[str, Any]]) -> str | None:
    """A note when the rank files' headers name more than one run, world size or launch: files
    of different runs copied into one directory, or two jobs given one run name at once (each
    wrote the ranks whose files it created first), whose figures would mix unseen."""
    named = {
        rank: (header.get(schema.RUN), header.get(schema.WORLD_SIZE), header.get(schema.JOB))
        for rank, header in headers.items()
        if header.get(schema.RUN) is not None
    }
    if len(set(named.values())) <= 1:
        return None
    jobs = len({job for _run, _world, job in named.values()}) > 1
    # Grouped by what they name, the largest group first: listed rank by rank, the first eight
    # of 16 identical ranks hid the one odd rank 12 (helper review).
    groups: dict[tuple[Any, Any, Any], list[int]] = {}
    for rank, key in sorted(named.items()):
        groups.setdefault(key, []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))
    listing = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)}: run {run!r}, world size "
        f"{world}" + (f", launch {job!r}" if jobs else "")
        for (run, world, job), ranks in ordered[:8]
    ) + (f"; {len(ordered) - 8} more" if len(ordered) > 8 else "")
    return (
        f"the rank files come from different runs ({listing}): these figures mix them; give "
        "each run its own directory"
    )


def warmup_note(
    recorded: int, analysed: int, skipped_by_rank: dict[int, int], warmup: int
) -> str | None:
    """The note on skipped warm-up steps (or on too few steps to skip any)."""
    skipped = max(skipped_by_rank.values(), default=0)
    if skipped:
        # A rank with no more steps than the warm-up skips none: "each rank" alone would
        # misstate what its figures include.
        fewer = sorted(rank for rank, count in skipped_by_rank.items() if count < skipped)
        return (
            f"skipped the first {skipped} step{'s' if skipped != 1 else ''} of each rank as "
            "warm-up (DataLoader start-up, lazy initialisation, allocator growth)"
            + (
                f", except rank{'s' if len(fewer) != 1 else ''} {rank_ranges(fewer)}: too few "
                "steps to skip a warm-up, so every step there is analysed"
                if fewer
                else ""
            )
            + f"; {analysed} of {recorded} steps analysed"
        )
    if recorded and recorded <= warmup * len(skipped_by_rank):
        return "too few steps to skip a warm-up: every recorded step is analysed"
    return None
