"""What else differs between the runs compared: setup, diagnosis, imbalance, memory, traceml's
own cost. Shown beside the step-time verdict; the blocking differences make it INCONCLUSIVE."""

from __future__ import annotations

from typing import Any

from traceml import schema
from traceml.analysis import resources, stats
from traceml.analysis.diagnose import label

_SETUP_KEYS = (
    (schema.WORLD_SIZE, "world size"),
    (schema.BATCH_SIZE, "batch size"),
    (schema.ACCUMULATE_GRAD_BATCHES, "gradient accumulation"),
    ("device", "device"),
    ("device_name", "device model"),
    (schema.SCRIPT, "script"),
    ("trace_max_steps", "trace-max-steps"),
    (schema.INTEGRATION, "integration"),
)
# Differences that are usually the change under test: shown, not held against the comparison.
_CHANGE_KEYS = (("num_workers", "DataLoader workers"),)
# Options a run may leave unset; a missing world size or device is unknown, not unset.
_OPTIONS = frozenset(
    {schema.BATCH_SIZE, schema.ACCUMULATE_GRAD_BATCHES, "trace_max_steps", "num_workers"}
)


def _missing(key: str) -> str:
    return "not set" if key in _OPTIONS else "unknown"


# What a rank file says of its run that no report of it changes (warm-up, thresholds).
_RANK_FACTS = (
    schema.RANK,
    schema.HOST,
    schema.SUMMARY_STEPS_RECORDED,
    schema.WALL_MS,
    schema.BETWEEN_STEPS_MS,
    schema.AFTER_LAST_STEP_MS,
    schema.PEAK_RSS,
)


# What a report adds of its own (where, when, with which thresholds it was made).
_REPORTING = (
    "_path",
    "_file",
    schema.SUMMARY_RUN_DIR,
    schema.SUMMARY_GENERATED_AT,
    schema.SUMMARY_THRESHOLDS,
    schema.SUMMARY_VERDICTS,
    schema.SUMMARY_NOTES,
)


def run_identity(summary: dict[str, Any]) -> str:
    """The same for two summaries of one run, however each was reported (another warm-up
    skipped moves every statistic) or wherever it was copied; else all but what the report
    added (a summary without rank entries)."""
    ranks = summary.get(schema.SUMMARY_RANKS)
    entries = [e for e in ranks if isinstance(e, dict)] if isinstance(ranks, list) else []
    if entries and all(e.get(schema.WALL_MS) is not None for e in entries):
        facts = sorted(repr([e.get(key) for key in _RANK_FACTS]) for e in entries)
        return repr((summary.get(schema.RUN), summary.get(schema.SUMMARY_SETUP), facts))
    return repr({k: v for k, v in summary.items() if k not in _REPORTING})


def sides_setup_differences(
    side_a: list[dict[str, Any]], side_b: list[dict[str, Any]]
) -> tuple[list[str], list[str]]:
    """:func:`setup_differences` between the sides' first runs, and within each side between
    its first run and each other (several runs a side must be runs of one setup)."""
    unfair, changed = setup_differences(side_a[0], side_b[0])
    for name, side in (("A", side_a), ("B", side_b)):
        for other in side[1:]:
            more_unfair, more_changed = setup_differences(side[0], other)
            unfair += [f"within {name}: {difference}" for difference in more_unfair]
            changed += [f"within {name}: {difference}" for difference in more_changed]
    return list(dict.fromkeys(unfair)), list(dict.fromkeys(changed))


def _measured_accumulation(summary: dict[str, Any]) -> float | None:
    """Microbatches per step as counted (a hand-written loop's setup cannot say it)."""
    phases = (summary.get(schema.SUMMARY_OVERALL) or {}).get(schema.PHASE_STATS) or {}
    mean = (phases.get(schema.MICROBATCHES) or {}).get("mean")
    return round(mean, 1) if isinstance(mean, (int, float)) and mean > 0 else None


def setup_differences(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[str], list[str]]:
    setup_a = a.get(schema.SUMMARY_SETUP) or {}
    setup_b = b.get(schema.SUMMARY_SETUP) or {}
    unfair = []
    for key, name in _SETUP_KEYS:
        if setup_a.get(key) != setup_b.get(key):
            unfair.append(f"{name}: {_arrow(setup_a.get(key), setup_b.get(key), _missing(key))}")
    key = schema.ACCUMULATE_GRAD_BATCHES
    if setup_a.get(key) is None and setup_b.get(key) is None:
        before, after = _measured_accumulation(a), _measured_accumulation(b)
        if before is not None and after is not None and abs(before - after) >= 0.5:
            unfair.append(f"microbatches per step (counted): {_arrow(before, after, 'unknown')}")
    versions_a = setup_a.get(schema.VERSIONS) or {}
    versions_b = setup_b.get(schema.VERSIONS) or {}
    for package in ("torch", "pytorch_lightning", "lightning", "rfdetr"):
        if versions_a.get(package) != versions_b.get(package):
            before, after = versions_a.get(package), versions_b.get(package)
            unfair.append(f"{package}: {_arrow(before, after, 'not recorded')}")
    # Each report skips its own warm-up (--threshold warmup_steps): steps analysed from
    # different points, early slow steps counted on one side only.
    warmups = [(s.get(schema.SUMMARY_THRESHOLDS) or {}).get("warmup_steps") for s in (a, b)]
    if warmups[0] != warmups[1]:
        unfair.append(
            f"warm-up steps skipped: {_arrow(*warmups, 'unknown')} (make one report again with "
            "--threshold warmup_steps=N)"
        )
    changed = [
        f"{name}: {_arrow(setup_a.get(key), setup_b.get(key), _missing(key))}"
        for key, name in _CHANGE_KEYS
        if setup_a.get(key) != setup_b.get(key)
    ]
    return unfair, changed


def _primary(summary: dict[str, Any]) -> str | None:
    verdicts = summary.get(schema.SUMMARY_VERDICTS) or []
    return verdicts[0]["kind"] if verdicts else None


# traceml's own cost above this share of a step is worth a warning: it may move the result.
OWN_COST_WARN = 0.01


def own_cost_notes(side_a: list[dict[str, Any]], side_b: list[dict[str, Any]]) -> list[str]:
    notes = []
    for summary in (*side_a, *side_b):
        measured = resources.own_cost(summary)
        if measured is not None and measured[1] > OWN_COST_WARN:
            notes.append(
                f"traceml's own cost in {as_text(summary.get(schema.RUN), RUN_UNNAMED)} is "
                f"{measured[0]:.0f} us per step, {measured[1] * 100:.1f}% of step time (over "
                f"{OWN_COST_WARN:.0%}): changes of that size may be traceml's, not the training's"
            )
    return list(dict.fromkeys(notes))  # (one run on both sides: said once)


# Verdicts that name a problem (a change away from one is news).
_PROBLEMS = frozenset(
    {
        schema.VERDICT_INPUT_BOUND,
        schema.VERDICT_H2D_BOUND,
        schema.VERDICT_OPTIMIZER_HEAVY,
        schema.VERDICT_RESIDUAL_HEAVY,
        schema.VERDICT_STRAGGLER,
        schema.VERDICT_COMM_BOUND,
        schema.VERDICT_MEMORY_PRESSURE,
    }
)


def diagnosis_change(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    kind_a, kind_b = _primary(a), _primary(b)
    if kind_a is None or kind_b is None:
        message = "no diagnosis in one of the summaries"
    elif kind_a == kind_b:
        message = f"{label(kind_a)} in both runs"
    elif schema.VERDICT_INSUFFICIENT_DATA in (kind_a, kind_b):
        # Too few steps for a diagnosis says nothing about the other run's problem: not "gone".
        short = "B" if kind_b == schema.VERDICT_INSUFFICIENT_DATA else "A"
        message = (
            f"{label(kind_a)} -> {label(kind_b)}: {short} has too few steps for a diagnosis, "
            "so this cannot tell whether the diagnosis changed"
        )
    else:
        message = f"{label(kind_a)} -> {label(kind_b)}"
        if kind_a in _PROBLEMS:
            message += f": the {label(kind_a).lower()} problem is gone"
            if kind_a == schema.VERDICT_INPUT_BOUND:
                message += " (the input fix worked)"
    return {"a": kind_a, "b": kind_b, "changed": kind_a != kind_b, "message": message}


def imbalance_ratio(summary: dict[str, Any]) -> float | None:
    fields = (summary.get(schema.SUMMARY_IMBALANCE) or {}).get(schema.IMBALANCE_FIELDS) or {}
    entry = fields.get(schema.OWN_MS) or fields.get(schema.STEP)
    return entry.get("max_over_others") if entry else None


def _memory(summary: dict[str, Any]) -> tuple[str, float | None]:
    overall = summary.get(schema.SUMMARY_OVERALL) or {}
    reserved = overall.get(schema.PEAK_RESERVED)
    if reserved is not None:
        return "device peak reserved", reserved
    return "peak RSS", overall.get(schema.PEAK_RSS)


def side_memory(side: list[dict[str, Any]]) -> tuple[str, float | None]:
    """The median over a side's runs (one odd run's allocator growth is not the change)."""
    measured = [_memory(s) for s in side]
    name = measured[0][0]
    values = sorted(v for n, v in measured if n == name and v is not None)
    return name, stats.quantile_sorted(values, 0.5) if values else None


# Differences that make the timing itself incomparable: INCONCLUSIVE unless accepted.
_BLOCKING_KEYS = (
    (schema.WORLD_SIZE, "world sizes"),
    ("device", "devices and clocks"),
    ("device_name", "device models"),
    (schema.TIMING, "timing methods (host clock vs CUDA events)"),
)


def _setup_value(summary: dict[str, Any], key: str) -> Any:
    if key == schema.WORLD_SIZE:
        return summary.get(schema.WORLD_SIZE)
    return (summary.get(schema.SUMMARY_SETUP) or {}).get(key)


def blocking_differences(side_a: list[dict[str, Any]], side_b: list[dict[str, Any]]) -> list[str]:
    found = []
    for key, name in _BLOCKING_KEYS:
        values_a = [_setup_value(s, key) for s in side_a]
        values_b = [_setup_value(s, key) for s in side_b]
        found += _spread("the A runs", name, values_a) + _spread("the B runs", name, values_b)
        if values_a[0] != values_b[0]:
            found.append(f"different {name} ({as_text(values_a[0])} vs {as_text(values_b[0])})")
    return found


def setup_spread(summaries: list[dict[str, Any]]) -> list[str]:
    """How runs meant to be alike (a noise-floor set) differ in a setting that blocks a
    comparison."""
    found = []
    for key, name in _BLOCKING_KEYS:
        found += _spread("the runs", name, [_setup_value(s, key) for s in summaries])
    return found


def _spread(runs: str, name: str, values: list[Any]) -> list[str]:
    """``runs`` differing among themselves in the setting ``name``: the line saying so."""
    if len(set(map(repr, values))) > 1:
        return [f"{runs} differ in {name} ({listing(values)})"]
    return []


def listing(values: list[Any]) -> str:
    return ", ".join(as_text(v) for v in values)


RUN_UNNAMED = "run name unknown"


def as_text(value: Any, missing: str = "unknown") -> str:
    """A setup value as text; a summary without it (an older traceml, a setting left at its
    default) says so in words, never "None"."""
    return missing if value is None else str(value)


def _arrow(before: Any, after: Any, missing: str) -> str:
    return f"{as_text(before, missing)} -> {as_text(after, missing)}"


def memory_comparison(
    side_a: list[dict[str, Any]], side_b: list[dict[str, Any]]
) -> tuple[dict[str, Any], float | None]:
    """Peak memory A vs B (each side's median run), and its relative change (None: unmeasured)."""
    memory_name, memory_a = side_memory(side_a)
    _name_b, memory_b = side_memory(side_b)
    memory_change = (memory_b - memory_a) / memory_a if memory_a and memory_b is not None else None
    shown = {
        "measure": memory_name,
        "a_bytes": memory_a,
        "b_bytes": memory_b,
        "change_pct": None if memory_change is None else memory_change * 100,
    }
    return shown, memory_change
