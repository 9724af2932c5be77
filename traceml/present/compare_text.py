"""The text of ``traceml compare``: a header, the verdict, setup differences, the table of
phases, and the footer (imbalance, memory, resources, input pipeline, notes, method)."""

from __future__ import annotations

import textwrap
from typing import Any

from traceml.analysis import input_pipeline, resources
from traceml.analysis.compare_estimate import (
    CI_LABEL,
    EQUIVALENT,
    HIDDEN_MATERIAL,
    INCONCLUSIVE,
    MATERIAL_SHARE,
    MIXED,
    NOISE_FLOOR_GIVEN,
    NOISE_FLOOR_MEASURED,
)
from traceml.analysis.compare_noise import RECOMMENDED_RUNS, NoiseFloor
from traceml.analysis.compare_rules import floor_is_a_guess, format_interval, format_pct
from traceml.analysis.compare_setup import RUN_UNNAMED, as_text
from traceml.present.printable import printable


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _side_title(runs: list[dict[str, Any]]) -> str:
    if len(runs) == 1:
        return as_text(runs[0]["run"], RUN_UNNAMED)
    names = [as_text(r["run"], RUN_UNNAMED) for r in runs]
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{len(runs)} runs ({shown})"


def _side_steps(runs: list[dict[str, Any]]) -> str:
    steps = [r["job_steps"] for r in runs if r["job_steps"] is not None]
    ess = [r["ess"] for r in runs if r["ess"] is not None]
    text = (
        "-"
        if not steps
        else str(min(steps)) + (f"-{max(steps)}" if max(steps) > min(steps) else "")
    )
    if ess:
        low, high = round(min(ess)), round(max(ess))
        text += f" (ESS {low}" + (f"-{high}" if high > low else "") + ")"
    return text


def _mean_name(result: dict[str, Any]) -> str:
    """What the A and B figures are: with several runs a side, the geometric mean of the runs'
    means (what the change is the ratio of, so figures, delta and change agree)."""
    several = len(result["a_runs"]) > 1 or len(result["b_runs"]) > 1
    return "geometric mean of the runs' means" if several else "mean"


def render_comparison(result: dict[str, Any]) -> str:
    lines = [
        *_header_lines(result),
        "",
        *_verdict_lines(result),
        "",
        *_setup_lines(result),
        "",
        *_table_lines(result),
        "",
        *_footer_lines(result),
    ]
    return printable("\n".join(lines) + "\n")


def _header_lines(result: dict[str, Any]) -> list[str]:
    runs_a, runs_b = result["a_runs"], result["b_runs"]
    lines = [
        f"traceml compare: A = {_side_title(runs_a)}  vs  B = {_side_title(runs_b)}",
        f"Job steps per run: A {_side_steps(runs_a)}, B {_side_steps(runs_b)}",
    ]
    noise = result["noise"]
    drift = noise["within_run_drift_pct"]
    if noise["run_to_run"] == "unknown":
        lines.append(
            f"Run-to-run noise: unknown (one run a side); noise floor {_floor_text(noise)}"
            + (f"; within-run drift {drift:.1f}%" if drift is not None else "")
        )
    else:
        cv = noise["run_to_run_cv_pct"]
        lines.append(
            f"Run-to-run noise: {len(runs_a)} + {len(runs_b)} runs, spread of run means "
            + ("-" if cv is None else f"{cv:.1f}%")
        )
    return lines


def _floor_text(noise: dict[str, Any]) -> str:
    source = noise.get("noise_floor_source")
    if source == NOISE_FLOOR_MEASURED:
        return f"{noise['noise_floor_pct']:.1f}% (measured, {noise['noise_floor_runs']} runs)"
    if source == NOISE_FLOOR_GIVEN:
        return f"{noise['noise_floor_pct']:.3g}% (--noise-floor)"
    return f"{noise['noise_floor_pct']:.3g}% (assumed)"


GUESS_ADVICE = (
    "for a sure answer compare 3 runs a side (A1 A2 A3 --vs B1 B2 B3), or measure the floor "
    "once from 3 identical runs (traceml compare --noise-floor-from R1 R2 R3) and pass it "
    "with --noise-floor"
)


def _verdict_lines(result: dict[str, Any]) -> list[str]:
    step = result["step"]
    verdict = result["verdict"]
    ci = step.get("ci_change_pct")
    lines = []
    if verdict == INCONCLUSIVE:
        detail = ""
        if step.get("change_pct") is not None:
            detail = f": step time {format_pct(step['change_pct'])}" + (
                f", {CI_LABEL} {format_interval(ci)}" if ci else ""
            )
        lines.append(f"Verdict: INCONCLUSIVE{detail}")
        lines.extend(f"  - {reason}" for reason in result["inconclusive_reasons"])
    else:
        ci_text = f", {CI_LABEL} {format_interval(ci)}" if ci else ""
        lines.append(
            f"Verdict: {verdict}: step time {format_pct(step.get('change_pct'))} "
            f"({_fmt_ms(step.get('a_mean_ms'))} ms -> {_fmt_ms(step.get('b_mean_ms'))} ms "
            f"{_mean_name(result)}{ci_text})"
        )
        if verdict == MIXED:
            memory = result["memory"]
            lines.append(f"  but {memory['measure']} changed {format_pct(memory['change_pct'])}")
        if verdict != EQUIVALENT and floor_is_a_guess(result):
            lines.extend(
                textwrap.wrap(
                    "one run a side with a default noise floor: a whole run being faster or "
                    f"slower than the next could explain this; {GUESS_ADVICE}",
                    100,
                    initial_indent="  caution: ",
                    subsequent_indent="    ",
                )
            )
    lines.append(f"Diagnosis: {result['diagnosis']['message']}")
    moved = result["phases_that_moved"]
    small = [
        f"{e['label']} {format_pct(e.get('change_pct'))}"
        for e in result["fields"].values()
        if e.get("hidden_rule") == HIDDEN_MATERIAL
    ]
    lines.append(
        "Phases that moved: "
        + (", ".join(moved) if moved else "none significantly")
        + (
            f"; real but under {MATERIAL_SHARE * 100:.0f}% of step: " + ", ".join(small)
            if small
            else ""
        )
    )
    return lines


def _setup_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    if result["setup_differences"]:
        lines.append("Setup differences (may make this comparison unfair):")
        lines.extend(f"  - {item}" for item in result["setup_differences"])
    else:
        lines.append("Setup differences: none")
    if result["changes"]:
        lines.append("Changed between the runs: " + "; ".join(result["changes"]))
    return lines


def _table_lines(result: dict[str, Any]) -> list[str]:
    lines = [
        f"  {_mean_name(result).capitalize()} per job step (ms)",
        f"  {'Phase':<12}{'A':>9}{'B':>9}{'delta':>9}{'change':>9}"
        f"{CI_LABEL + ' of change':>20}  result",
    ]
    for entry in result["fields"].values():
        ci = entry.get("ci_change_pct")
        ci_text = format_interval(ci) if ci else "-"
        status = entry["status"]
        if entry.get("hidden_rule") == HIDDEN_MATERIAL:
            # Real (its interval excludes zero) but too small a part of the step to move it.
            status = f"real, but {entry['step_share_pct']:.1f}% of step"
        elif entry.get("hidden_by"):
            status = f"hidden: {entry['hidden_by']}"
        lines.append(
            f"  {entry['label']:<12}{_fmt_ms(entry.get('a_mean_ms')):>9}"
            f"{_fmt_ms(entry.get('b_mean_ms')):>9}{_fmt_ms(entry.get('delta_ms')):>9}"
            f"{format_pct(entry.get('change_pct')):>9}{ci_text:>20}  {status}"
        )
    return lines


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _footer_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    imbalance = result["imbalance"]
    if imbalance["a"] is not None or imbalance["b"] is not None:
        lines.append(
            "Rank imbalance (slowest rank / the others' median): "
            f"{_ratio(imbalance['a'])} -> {_ratio(imbalance['b'])}"
        )
    memory = result["memory"]
    if memory["a_bytes"] is not None and memory["b_bytes"] is not None:
        lines.append(
            f"Memory ({memory['measure']}): {memory['a_bytes'] / 2**20:.0f} MiB -> "
            f"{memory['b_bytes'] / 2**20:.0f} MiB ({format_pct(memory['change_pct'])})"
        )
    lines.extend(resources.delta_lines(result.get("resources") or {}))
    lines.extend(input_pipeline.comparison_lines(result.get("input_pipeline")))
    lines.extend(f"Note: {note}" for note in result["notes"])
    # One line in the JSON; wrapped here so the text stays 100 columns wide.
    lines.extend(
        textwrap.wrap(
            f"Method: {result['method']}.", 100, subsequent_indent="  ", break_on_hyphens=False
        )
    )
    return lines


# ----------------------------------------------------------------------------------------------
# Command


def noise_floor_lines(floor: NoiseFloor) -> list[str]:
    """What ``traceml compare --noise-floor-from`` prints: the floor and how to use it."""
    lines = [
        f"Noise floor: {floor.pct:.1f}% from {floor.runs} identical runs (spread of their mean "
        f"step times {floor.run_cv_pct:.1f}%; one-sided 95% bound on the step-time difference "
        f"of two such runs, t on {floor.df} df)",
        f"Use it for one run a side: traceml compare A B --noise-floor {floor.pct:.1f} "
        "--fail-on-regression PCT",
    ]
    if floor.runs < RECOMMENDED_RUNS:
        lines.append(
            f"Note: {floor.runs} runs give a wide floor; {RECOMMENDED_RUNS} or more narrow it"
        )
    return lines
