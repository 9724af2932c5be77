"""``traceml compare``: summaries in, the comparison's JSON and text out, and the exit code CI
sees (0 ok, 1 regression beyond the limit, 2 bad input, 3 inconclusive under the gate)."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from traceml.analysis.compare import (
    DEFAULT_NOISE_FLOOR_PCT,
    INCONCLUSIVE,
    NOISE_FLOOR_ASSUMED,
    NOISE_FLOOR_GIVEN,
    NOISE_FLOOR_MEASURED,
    SLOWER,
    CompareInputError,
    CompareOptions,
    compare,
    load_summary,
)
from traceml.analysis.compare_noise import NoiseFloor, measure_noise_floor
from traceml.analysis.compare_rules import floor_is_a_guess
from traceml.analysis.compare_setup import run_identity
from traceml.errors import OutputError
from traceml.files import text_path, write_atomically
from traceml.present.compare_text import GUESS_ADVICE, noise_floor_lines, render_comparison

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_BAD_INPUT = 2
EXIT_INCONCLUSIVE = 3


def gate_exit_code(result: dict[str, Any], fail_on_regression: float | None) -> int:
    """The exit code CI sees: 1 = significant step-time regression beyond the limit,
    3 = inconclusive (under the gate only), 0 otherwise.

    One run a side with the default noise floor is a guess about run-to-run noise: a regression
    found that way exits 3 (no answer), never 1; a floor the user gave or measured makes it 1.
    """
    if fail_on_regression is None:
        return EXIT_OK
    if result["verdict"] == INCONCLUSIVE:
        return EXIT_INCONCLUSIVE
    step = result["step"]
    regressed = step.get("significant") and step["status"] == SLOWER
    if regressed and (step.get("change_pct") or 0.0) > fail_on_regression:
        return EXIT_INCONCLUSIVE if floor_is_a_guess(result) else EXIT_REGRESSION
    return EXIT_OK


def output_paths(output: str) -> tuple[Path, Path]:
    """``--output comparisons/a_vs_b`` -> a_vs_b.json and a_vs_b.txt there; a directory (one
    that exists, or a path ending in a separator) gets comparison.json and .txt inside it."""
    if not output.strip():
        raise CompareInputError("--output needs a path (comparisons/a_vs_b)")
    base = Path(output)
    if output.endswith(("/", os.sep)) or base.is_dir() or base.name in ("", ".", ".."):
        base = base / "comparison"
    if base.suffix in (".json", ".txt"):
        base = base.with_suffix("")
    return base.with_name(base.name + ".json"), base.with_name(base.name + ".txt")


def split_sides(runs: list[str], vs: list[str] | None) -> tuple[list[str], list[str]]:
    """``A B`` or ``A1 A2 ... --vs B1 B2 ...`` -> (A paths, B paths)."""
    if vs:
        if not runs:
            raise CompareInputError("--vs needs the A runs before it (A1 A2 A3 --vs B1 B2 B3)")
        return list(runs), list(vs)
    if len(runs) == 2:
        return [runs[0]], [runs[1]]
    raise CompareInputError(
        f"got {len(runs)} summar{'y' if len(runs) == 1 else 'ies'} and no --vs: give two "
        "(A B), or several a side with --vs (A1 A2 A3 --vs B1 B2 B3)"
    )


def compare_command(args: Any) -> int:
    _check_percentages(args)
    if args.output is not None:
        output_paths(args.output)  # a bad --output is said before any work
    floor = None
    floor_runs: list[dict[str, Any]] = []
    if args.noise_floor_from:
        floor_runs = _distinct([load_summary(p) for p in args.noise_floor_from])
        floor = measure_noise_floor(floor_runs)
        if not args.runs and not args.vs:  # measuring only
            sys.stdout.write("\n".join(noise_floor_lines(floor)) + "\n")
            return EXIT_OK
    paths_a, paths_b = split_sides(args.runs, args.vs)
    side_a = _distinct([load_summary(path) for path in paths_a])
    side_b = _distinct([load_summary(path) for path in paths_b])
    if args.output is not None:
        _check_output_is_no_input(args.output, [*side_a, *side_b, *floor_runs])
    try:
        result = compare(side_a, side_b, _options(args, floor))
        # Printing reads the summaries' figures too (imbalance, memory): inside the same net.
        text = render_comparison(result)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as exc:
        # load_summary checks the schema, the sections and the figures printed as they are; a
        # field of the wrong type or an impossible value elsewhere (a hand-edited or damaged
        # summary) surfaces here.
        raise CompareInputError(
            "cannot compare these summaries: a field has an unexpected type or value "
            f"({type(exc).__name__}: {exc}); were they written by traceml and left as they were?"
        ) from None
    if args.output is not None:
        _write_outputs(args.output, result, text)
    sys.stdout.write(text)
    code = gate_exit_code(result, args.fail_on_regression)
    _say_why(code, result, args.fail_on_regression)
    return code


def _distinct(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The summaries of one side (or of --noise-floor-from): one run given twice would count
    as two identical runs (a spread of 0%, a floor that is no measurement)."""
    seen: dict[str, str] = {}
    for summary in summaries:
        # What the run measured, not where or when (or with which thresholds or warm-up) it
        # was reported: a copied run directory reported again is the same run.
        content = run_identity(summary)
        path = summary.get("_path", "?")
        if content in seen:
            raise CompareInputError(
                f"{path} is the same run as {seen[content]}: give each run once (several runs "
                "a side must be separate runs of the same training)"
            )
        seen[content] = path
    return summaries


def _check_percentages(args: Any) -> None:
    if args.noise_floor is not None and args.noise_floor_from:
        raise CompareInputError("give --noise-floor or --noise-floor-from, not both")
    limit = args.fail_on_regression
    if limit is not None and not (math.isfinite(limit) and limit >= 0):
        raise CompareInputError(
            f"--fail-on-regression {limit:g}: expected a percentage >= 0 (5 fails the run on a "
            "step time more than 5% slower)"
        )
    for name, value in (("--noise-floor", args.noise_floor),
                        ("--equivalence-margin", args.equivalence_margin)):  # fmt: skip
        if value is not None and not (0 <= value < 100):
            raise CompareInputError(f"{name} {value:g}: expected a percentage in [0, 100)")


def _options(args: Any, floor: NoiseFloor | None) -> CompareOptions:
    """The user's choices; the floor from identical runs, the one given, or the default."""
    if floor is not None:
        pct, source, runs = floor.pct, NOISE_FLOOR_MEASURED, floor.runs
    elif args.noise_floor is not None:
        pct, source, runs = args.noise_floor, NOISE_FLOOR_GIVEN, None
    else:
        pct, source, runs = DEFAULT_NOISE_FLOOR_PCT, NOISE_FLOOR_ASSUMED, None
    return CompareOptions(
        noise_floor_pct=pct,
        equivalence_margin_pct=args.equivalence_margin,
        allow_setup_change=args.allow_setup_change,
        noise_floor_source=source,
        noise_floor_runs=runs,
    )


def _check_output_is_no_input(output: str, summaries: list[dict[str, Any]]) -> None:
    """--output naming a summary being compared (A/final_summary.json) would replace it with
    the comparison: refused before comparing. samefile also catches another spelling of the
    path (a symlink, ../a, a case-insensitive file system)."""
    for written in output_paths(output):
        for summary in summaries:
            source = summary.get("_file")
            with contextlib.suppress(OSError):  # no such output file yet: it is no input
                if source and os.path.samefile(written, source):
                    shown = summary.get("_path", source)
                    raise CompareInputError(
                        f"--output {text_path(output)} would overwrite {shown}, one of the "
                        "summaries compared: choose another path"
                    )


def _write_outputs(output: str, result: dict[str, Any], text: str) -> None:
    json_path, text_path = output_paths(output)
    try:
        for path in (json_path, text_path):  # before either is written: both or neither
            if path.is_dir():
                raise IsADirectoryError(errno.EISDIR, f"{path} is a directory, not a file name")
        json_path.parent.mkdir(parents=True, exist_ok=True)
        for path in (json_path, text_path):
            if path.exists():
                print(f"traceml: overwriting {path}", file=sys.stderr)
        # Whole files, never through a symlink planted at the path (files.write_atomically).
        write_atomically(
            json_path, orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)
        )
        write_atomically(text_path, text.encode())
    except OSError as exc:
        raise OutputError(f"cannot write {output}: {exc.strerror or exc}") from None


def _say_why(code: int, result: dict[str, Any], limit: float | None) -> None:
    """One line on stderr under the gate: what made it fail or give no answer."""
    change = result["step"].get("change_pct")
    if code == EXIT_REGRESSION:
        print(f"traceml: step time regressed {change:+.1f}% (limit {limit:g}%)", file=sys.stderr)
    elif code == EXIT_INCONCLUSIVE and result["verdict"] != INCONCLUSIVE:
        print(
            f"traceml: step time {change:+.1f}% looks like a regression, but with one run a "
            "side and the default noise floor the gate cannot tell it from run-to-run noise "
            f"(exit 3, no answer); {GUESS_ADVICE}",
            file=sys.stderr,
        )
    elif code == EXIT_INCONCLUSIVE:
        print("traceml: comparison inconclusive; see the reasons above", file=sys.stderr)
