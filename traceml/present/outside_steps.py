"""The report's line on training time outside the steps: between them, and after the last
one until training ended."""

from __future__ import annotations

from typing import Any

from traceml import schema


def outside_steps_text(summary: dict[str, Any]) -> str | None:
    """Training time outside the steps: between them, and after the last one until training
    ended (final validation, checkpoints), when the rank files say when that was. After a step
    limit, the time after the last recorded step is mostly the steps that ran untraced."""
    overall = summary.get(schema.SUMMARY_OVERALL) or {}
    between = overall.get(schema.BETWEEN_STEPS_MS)
    wall = overall.get(schema.WALL_MS)
    after = overall.get(schema.AFTER_LAST_STEP_MS)
    if not wall or between is after is None:
        return None
    if _limited(summary):
        measured = "not measured"
        if between is not None:
            measured = (
                f"{between / 1000:.2f} s of {wall / 1000:.2f} s from the first step's start to "
                f"the last step's end ({between / wall * 100:.0f}%)"
            )
        text = f"Between steps (validation, checkpoints, epoch ends): {measured}"
        if after is not None:
            text += (
                f"; after the last traced step, {after / 1000:.2f} s: the steps run after the "
                "step limit, if any (untraced), and whatever followed them"
            )
    elif between is None:  # several steps, no gap between them measured
        text = (
            f"Outside steps: {after / 1000:.2f} s after the last step (validation, checkpoints);"
            " the time between steps was not measured"
        )
    elif after is None:
        text = (
            f"Between steps (validation, checkpoints, epoch ends): {between / 1000:.2f} s of "
            f"{wall / 1000:.2f} s from the first step's start to the last step's end "
            f"({between / wall * 100:.0f}%); the time after the last step is unknown (the "
            "rank files give no end time, or their clocks disagree)"
        )
    else:
        total = wall + after
        outside = between + after
        text = (
            f"Outside steps (validation, checkpoints, epoch ends): {outside / 1000:.2f} s of "
            f"{total / 1000:.2f} s from the first step to the end of training "
            f"({outside / total * 100:.0f}%): {between / 1000:.2f} s between steps, "
            f"{after / 1000:.2f} s after the last step"
        )
    return text


def _limited(summary: dict[str, Any]) -> bool:
    """Did a rank stop recording at the step limit (--trace-max-steps), training on untraced?"""
    limit = (summary.get(schema.SUMMARY_SETUP) or {}).get("trace_max_steps")
    entries = summary.get(schema.SUMMARY_RANKS) or []
    recorded = [e.get(schema.SUMMARY_STEPS_RECORDED) for e in entries]
    return type(limit) is int and any(type(n) is int and n >= limit for n in recorded)
