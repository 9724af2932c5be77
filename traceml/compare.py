"""Two summaries -> what changed, whether it is real, and a verdict for people and CI. Pure
except :func:`compare_command` (files in, files out, exit code).

Is a change real? For each phase the summary stores the distribution of per-step times (1001
quantiles) and the step count n. A distribution-free 95% confidence interval for a median is
the pair of order statistics at ranks n/2 -+ 0.98*sqrt(n); its half-width gives the median's
standard error, and the two runs' errors combine into an interval for the difference of
medians. A change is *significant* when that interval excludes zero and the change is at least
``MIN_EFFECT`` of the baseline (smaller differences are not worth a verdict). Deterministic:
no resampling, no seed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson

from traceml import schema, stats
from traceml.diagnose import label

Z95 = 1.959963984540054
MIN_EFFECT = 0.01  # changes under 1% of the baseline median are "no significant change"
MEMORY_CHANGE = 0.10  # a peak-memory change this large makes a faster run MIXED
MIN_STEPS = 10

IMPROVEMENT = "IMPROVEMENT"
REGRESSION = "REGRESSION"
EQUIVALENT = "EQUIVALENT"
MIXED = "MIXED"
INCONCLUSIVE = "INCONCLUSIVE"

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_BAD_INPUT = 2
EXIT_INCONCLUSIVE = 3


class CompareInputError(Exception):
    """A file that cannot be compared; one line for the user, exit code 2."""


# ----------------------------------------------------------------------------------------------
# Loading


def load_summary(path: Path | str) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        candidate = path / schema.SUMMARY_JSON
        if candidate.is_file():
            path = candidate
    if not path.is_file():
        raise CompareInputError(f"no such file: {path}")
    try:
        data = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError:
        raise CompareInputError(f"{path} is not JSON (is it a final_summary.json?)") from None
    except OSError as exc:
        raise CompareInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise CompareInputError(f"{path} is not a traceml summary")
    family, supported = schema.family_and_major(schema.SUMMARY_SCHEMA)
    found = data.get(schema.SCHEMA)
    major = schema.schema_major(found, family)
    if major is None:
        raise CompareInputError(
            f"{path} is not a traceml summary (schema {found!r}; expected {family}/{supported}.x)"
        )
    if major > supported:
        raise CompareInputError(
            f"{path} has schema {found}, newer than this traceml reads ({family}/{supported}.x): "
            "upgrade traceml"
        )
    if not isinstance(data.get(schema.SUMMARY_OVERALL), dict):
        raise CompareInputError(f"{path} is a traceml summary without an 'overall' section")
    data["_path"] = str(path)
    return data


# ----------------------------------------------------------------------------------------------
# Statistics


def median_interval(distribution: list[float], count: int) -> tuple[float, float, float]:
    """(median, lower, upper) of the 95% order-statistic interval for the median."""
    median = stats.interpolate_distribution(distribution, 0.5)
    if count < 2:
        return median, -math.inf, math.inf
    half = Z95 * 0.5 / math.sqrt(count)
    low = stats.interpolate_distribution(distribution, 0.5 - half)
    high = stats.interpolate_distribution(distribution, 0.5 + half)
    return median, low, high


def compare_field(a: dict[str, Any], b: dict[str, Any], fieldname: str) -> dict[str, Any]:
    """A vs B for one phase: medians, delta, % change, 95% interval, significance."""
    entry: dict[str, Any] = {"field": fieldname, "label": schema.PHASE_LABELS.get(fieldname)}
    stats_a = _phase_stats(a, fieldname)
    stats_b = _phase_stats(b, fieldname)
    dist_a = _distribution(a, fieldname)
    dist_b = _distribution(b, fieldname)
    if not stats_a or not stats_b or not dist_a or not dist_b:
        entry.update(status="not measured", a_median_ms=None, b_median_ms=None)
        entry["a_mean_ms"] = stats_a["mean"] if stats_a else None
        entry["b_mean_ms"] = stats_b["mean"] if stats_b else None
        return entry
    med_a, lo_a, hi_a = median_interval(dist_a, stats_a["count"])
    med_b, lo_b, hi_b = median_interval(dist_b, stats_b["count"])
    se_a = (hi_a - lo_a) / (2 * Z95)
    se_b = (hi_b - lo_b) / (2 * Z95)
    delta = med_b - med_a
    half = Z95 * math.sqrt(se_a**2 + se_b**2) if math.isfinite(se_a + se_b) else math.inf
    ci = (delta - half, delta + half)
    change = delta / med_a if med_a > 0 else None
    big_enough = change is not None and abs(change) >= MIN_EFFECT
    # A phase that is tiny in both runs (under 2% of the step) cannot move a verdict.
    step_median = (_phase_stats(a, schema.STEP) or {}).get("median") or 0.0
    material = fieldname == schema.STEP or max(med_a, med_b) >= 0.02 * step_median
    significant = bool(half < math.inf and (ci[0] > 0 or ci[1] < 0) and big_enough and material)
    status = ("slower" if delta > 0 else "faster") if significant else "no significant change"
    entry.update(
        status=status,
        significant=significant,
        a_median_ms=med_a,
        b_median_ms=med_b,
        a_mean_ms=stats_a["mean"],
        b_mean_ms=stats_b["mean"],
        delta_ms=delta,
        change_pct=None if change is None else change * 100,
        ci95_delta_ms=[ci[0], ci[1]],
        ci95_change_pct=(
            None
            if not med_a or not math.isfinite(half)
            else [ci[0] / med_a * 100, ci[1] / med_a * 100]
        ),
        a_count=stats_a["count"],
        b_count=stats_b["count"],
    )
    return entry


def _phase_stats(summary: dict[str, Any], fieldname: str) -> dict[str, Any] | None:
    return ((summary.get(schema.SUMMARY_OVERALL) or {}).get(schema.PHASE_STATS) or {}).get(
        fieldname
    )


def _distribution(summary: dict[str, Any], fieldname: str) -> list[float] | None:
    dist = ((summary.get(schema.SUMMARY_OVERALL) or {}).get(schema.DISTRIBUTIONS) or {}).get(
        fieldname
    )
    return dist if isinstance(dist, list) and dist else None


# ----------------------------------------------------------------------------------------------
# The comparison


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


def setup_differences(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[str], list[str]]:
    setup_a = a.get(schema.SUMMARY_SETUP) or {}
    setup_b = b.get(schema.SUMMARY_SETUP) or {}
    unfair = []
    for key, name in _SETUP_KEYS:
        if setup_a.get(key) != setup_b.get(key):
            unfair.append(f"{name}: {setup_a.get(key)} -> {setup_b.get(key)}")
    versions_a = setup_a.get(schema.VERSIONS) or {}
    versions_b = setup_b.get(schema.VERSIONS) or {}
    for package in ("torch", "pytorch_lightning", "lightning", "rfdetr"):
        if versions_a.get(package) != versions_b.get(package):
            unfair.append(f"{package}: {versions_a.get(package)} -> {versions_b.get(package)}")
    changed = [
        f"{name}: {setup_a.get(key)} -> {setup_b.get(key)}"
        for key, name in _CHANGE_KEYS
        if setup_a.get(key) != setup_b.get(key)
    ]
    return unfair, changed


def _primary(summary: dict[str, Any]) -> str | None:
    verdicts = summary.get(schema.SUMMARY_VERDICTS) or []
    return verdicts[0]["kind"] if verdicts else None


def _diagnosis_change(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    kind_a, kind_b = _primary(a), _primary(b)
    if kind_a is None or kind_b is None:
        message = "no diagnosis in one of the summaries"
    elif kind_a == kind_b:
        message = f"{label(kind_a)} in both runs"
    else:
        message = f"{label(kind_a)} -> {label(kind_b)}"
        if kind_a in ("INPUT_BOUND", "H2D_BOUND", "OPTIMIZER_HEAVY", "RESIDUAL_HEAVY", "STRAGGLER"):
            message += f": the {label(kind_a).lower()} problem is gone"
            if kind_a == "INPUT_BOUND":
                message += " (the input fix worked)"
    return {"a": kind_a, "b": kind_b, "changed": kind_a != kind_b, "message": message}


def _imbalance_ratio(summary: dict[str, Any]) -> float | None:
    fields = (summary.get(schema.SUMMARY_IMBALANCE) or {}).get(schema.IMBALANCE_FIELDS) or {}
    entry = fields.get(schema.OWN_MS) or fields.get(schema.STEP)
    return entry.get("max_over_others") if entry else None


def _memory(summary: dict[str, Any]) -> tuple[str, float | None]:
    overall = summary.get(schema.SUMMARY_OVERALL) or {}
    reserved = overall.get(schema.PEAK_RESERVED)
    if reserved is not None:
        return "device peak reserved", reserved
    return "peak RSS", overall.get(schema.PEAK_RSS)


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    fields = {f: compare_field(a, b, f) for f in schema.TIMED_FIELDS}
    unfair, changed = setup_differences(a, b)
    reasons: list[str] = []
    for name, summary in (("A", a), ("B", b)):
        count = (_phase_stats(summary, schema.STEP) or {}).get("count", 0)
        if count < MIN_STEPS:
            reasons.append(f"{name} has only {count} analysed steps (at least {MIN_STEPS} needed)")
    setup_a = a.get(schema.SUMMARY_SETUP) or {}
    setup_b = b.get(schema.SUMMARY_SETUP) or {}
    if setup_a.get("device") != setup_b.get("device"):
        reasons.append(
            f"different devices and clocks ({setup_a.get('device')} vs {setup_b.get('device')})"
        )
    elif setup_a.get(schema.TIMING) != setup_b.get(schema.TIMING):
        reasons.append("different timing methods (host clock vs CUDA events)")
    if a.get(schema.WORLD_SIZE) != b.get(schema.WORLD_SIZE):
        reasons.append(
            f"different world sizes ({a.get(schema.WORLD_SIZE)} vs {b.get(schema.WORLD_SIZE)})"
        )
    missing = [
        schema.PHASE_LABELS[f]
        for f in schema.PHASES
        if fields[f]["status"] == "not measured"
        and (_phase_stats(a, f) is not None) != (_phase_stats(b, f) is not None)
    ]
    if missing:
        reasons.append("phases measured in only one run: " + ", ".join(missing))
    step = fields[schema.STEP]
    if step["status"] == "not measured" and not reasons:
        reasons.append("no step times to compare")

    memory_name, memory_a = _memory(a)
    _name_b, memory_b = _memory(b)
    memory_change = (memory_b - memory_a) / memory_a if memory_a and memory_b is not None else None

    if reasons:
        verdict = INCONCLUSIVE
    elif step["status"] == "faster":
        verdict = MIXED if (memory_change or 0) >= MEMORY_CHANGE else IMPROVEMENT
    elif step["status"] == "slower":
        verdict = MIXED if (memory_change or 0) <= -MEMORY_CHANGE else REGRESSION
    else:
        verdict = EQUIVALENT

    moved = [fields[f]["label"] for f in schema.PHASES if fields[f].get("significant")]
    return {
        schema.SCHEMA: schema.COMPARISON_SCHEMA,
        "a": _run_info(a),
        "b": _run_info(b),
        "verdict": verdict,
        "inconclusive_reasons": reasons,
        "step": step,
        "fields": fields,
        "phases_that_moved": moved,
        "setup_differences": unfair,
        "changes": changed,
        "diagnosis": _diagnosis_change(a, b),
        "imbalance": {"a": _imbalance_ratio(a), "b": _imbalance_ratio(b)},
        "memory": {
            "measure": memory_name,
            "a_bytes": memory_a,
            "b_bytes": memory_b,
            "change_pct": None if memory_change is None else memory_change * 100,
        },
        "method": (
            "95% order-statistic interval for each median, combined for the difference; "
            f"changes under {MIN_EFFECT * 100:.0f}% are not called significant"
        ),
    }


def _run_info(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "path": summary.get("_path"),
        "run": summary.get(schema.RUN),
        "status": summary.get(schema.SUMMARY_STATUS),
        "steps_analysed": summary.get(schema.SUMMARY_STEPS_ANALYSED),
        "world_size": summary.get(schema.WORLD_SIZE),
    }


def gate_exit_code(result: dict[str, Any], fail_on_regression: float | None) -> int:
    """The exit code CI sees: 1 = significant step-time regression beyond the limit,
    3 = inconclusive (under the gate only), 0 otherwise."""
    if fail_on_regression is None:
        return EXIT_OK
    if result["verdict"] == INCONCLUSIVE:
        return EXIT_INCONCLUSIVE
    step = result["step"]
    regressed = step.get("significant") and step["status"] == "slower"
    if regressed and (step.get("change_pct") or 0.0) > fail_on_regression:
        return EXIT_REGRESSION
    return EXIT_OK


# ----------------------------------------------------------------------------------------------
# Text


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _fmt_pct(value: float | None, signed: bool = True) -> str:
    if value is None:
        return "-"
    return f"{value:+.1f}%" if signed else f"{value:.1f}%"


def _fmt_interval(interval: list[float]) -> str:
    return f"{interval[0]:+.1f}% .. {interval[1]:+.1f}%"


def render_comparison(result: dict[str, Any]) -> str:
    a, b = result["a"], result["b"]
    lines = [
        f"traceml compare: A = {a['run']} ({a['steps_analysed']} steps)  vs  "
        f"B = {b['run']} ({b['steps_analysed']} steps)",
        "",
    ]
    step = result["step"]
    verdict = result["verdict"]
    if verdict == INCONCLUSIVE:
        lines.append("Verdict: INCONCLUSIVE")
        for reason in result["inconclusive_reasons"]:
            lines.append(f"  - {reason}")
    else:
        ci = step.get("ci95_change_pct")
        ci_text = f", 95% CI {_fmt_interval(ci)}" if ci else ""
        lines.append(
            f"Verdict: {verdict}: step time {_fmt_pct(step.get('change_pct'))} "
            f"({_fmt_ms(step.get('a_median_ms'))} ms -> {_fmt_ms(step.get('b_median_ms'))} ms "
            f"median{ci_text})"
        )
        if verdict == MIXED:
            memory = result["memory"]
            lines.append(f"  but {memory['measure']} changed {_fmt_pct(memory['change_pct'])}")
    lines.append(f"Diagnosis: {result['diagnosis']['message']}")
    if result["phases_that_moved"]:
        lines.append("Phases that moved: " + ", ".join(result["phases_that_moved"]))
    else:
        lines.append("Phases that moved: none significantly")
    lines.append("")
    if result["setup_differences"]:
        lines.append("Setup differences (may make this comparison unfair):")
        lines.extend(f"  - {item}" for item in result["setup_differences"])
    else:
        lines.append("Setup differences: none")
    if result["changes"]:
        lines.append("Changed between the runs: " + "; ".join(result["changes"]))
    lines.append("")
    lines.append(
        f"  {'Phase':<12}{'A median':>10}{'B median':>10}{'delta ms':>10}{'change':>9}"
        f"{'95% CI of change':>20}  result"
    )
    for fieldname in schema.TIMED_FIELDS:
        entry = result["fields"][fieldname]
        ci = entry.get("ci95_change_pct")
        ci_text = _fmt_interval(ci) if ci else "-"
        lines.append(
            f"  {entry['label']:<12}{_fmt_ms(entry.get('a_median_ms')):>10}"
            f"{_fmt_ms(entry.get('b_median_ms')):>10}{_fmt_ms(entry.get('delta_ms')):>10}"
            f"{_fmt_pct(entry.get('change_pct')):>9}{ci_text:>20}  {entry['status']}"
        )
    lines.append("")
    imbalance = result["imbalance"]
    if imbalance["a"] is not None or imbalance["b"] is not None:

        def ratio(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}x"

        lines.append(
            f"Rank imbalance (slowest rank / the others' median): {ratio(imbalance['a'])} -> "
            f"{ratio(imbalance['b'])}"
        )
    memory = result["memory"]
    if memory["a_bytes"] is not None and memory["b_bytes"] is not None:
        lines.append(
            f"Memory ({memory['measure']}): {memory['a_bytes'] / 2**20:.0f} MiB -> "
            f"{memory['b_bytes'] / 2**20:.0f} MiB ({_fmt_pct(memory['change_pct'])})"
        )
    lines.append(f"Method: {result['method']}.")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# Command


def output_paths(output: str) -> tuple[Path, Path]:
    base = Path(output)
    if base.suffix in (".json", ".txt"):
        base = base.with_suffix("")
    return base.with_name(base.name + ".json"), base.with_name(base.name + ".txt")


def compare_command(args: Any) -> int:
    import sys

    try:
        a = load_summary(args.baseline)
        b = load_summary(args.candidate)
    except CompareInputError as exc:
        print(f"traceml: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    result = compare(a, b)
    text = render_comparison(result)
    if args.output:
        json_path, text_path = output_paths(args.output)
        try:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            for path in (json_path, text_path):
                if path.exists():
                    print(f"traceml: overwriting {path}", file=sys.stderr)
            json_path.write_bytes(
                orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)
            )
            text_path.write_text(text)
        except OSError as exc:
            print(
                f"traceml: error: cannot write {args.output}: {exc.strerror or exc}",
                file=sys.stderr,
            )
            return EXIT_BAD_INPUT
    sys.stdout.write(text)
    code = gate_exit_code(result, args.fail_on_regression)
    if code == EXIT_REGRESSION:
        print(
            f"traceml: step time regressed {result['step']['change_pct']:+.1f}% "
            f"(limit {args.fail_on_regression:g}%)",
            file=sys.stderr,
        )
    elif code == EXIT_INCONCLUSIVE:
        print("traceml: comparison inconclusive; see the reasons above", file=sys.stderr)
    return code
