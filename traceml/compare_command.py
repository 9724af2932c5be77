"""``traceml compare``: summaries in, the comparison's JSON and text out, and the exit code CI
sees (0 ok, 1 regression beyond the limit, 2 bad input, 3 inconclusive under the gate)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orjson

from traceml.analysis.compare import (
    INCONCLUSIVE,
    SLOWER,
    CompareInputError,
    CompareOptions,
    compare,
    load_summary,
)
from traceml.errors import OutputError
from traceml.present.compare_text import render_comparison

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_BAD_INPUT = 2
EXIT_INCONCLUSIVE = 3


def gate_exit_code(result: dict[str, Any], fail_on_regression: float | None) -> int:
    """The exit code CI sees: 1 = significant step-time regression beyond the limit,
    3 = inconclusive (under the gate only), 0 otherwise."""
    if fail_on_regression is None:
        return EXIT_OK
    if result["verdict"] == INCONCLUSIVE:
        return EXIT_INCONCLUSIVE
    step = result["step"]
    regressed = step.get("significant") and step["status"] == SLOWER
    if regressed and (step.get("change_pct") or 0.0) > fail_on_regression:
        return EXIT_REGRESSION
    return EXIT_OK


# ----------------------------------------------------------------------------------------------
# Text


def output_paths(output: str) -> tuple[Path, Path]:
    base = Path(output)
    if base.suffix in (".json", ".txt"):
        base = base.with_suffix("")
    return base.with_name(base.name + ".json"), base.with_name(base.name + ".txt")


def split_sides(runs: list[str], vs: list[str] | None) -> tuple[list[str], list[str]]:
    """``A B`` or ``A1 A2 ... --vs B1 B2 ...`` -> (A paths, B paths)."""
    if vs:
        return list(runs), list(vs)
    if len(runs) == 2:
        return [runs[0]], [runs[1]]
    raise CompareInputError(
        f"got {len(runs)} summar{'y' if len(runs) == 1 else 'ies'} and no --vs: give two "
        "(A B), or several a side with --vs (A1 A2 A3 --vs B1 B2 B3)"
    )


def compare_command(args: Any) -> int:
    options = CompareOptions(
        noise_floor_pct=args.noise_floor,
        equivalence_margin_pct=args.equivalence_margin,
        allow_setup_change=args.allow_setup_change,
    )
    try:
        paths_a, paths_b = split_sides(args.runs, args.vs)
        for name, value in (("--noise-floor", args.noise_floor),
                            ("--equivalence-margin", args.equivalence_margin)):  # fmt: skip
            if not (0 <= value < 100):
                raise CompareInputError(f"{name} {value:g}: expected a percentage in [0, 100)")
        side_a = [load_summary(path) for path in paths_a]
        side_b = [load_summary(path) for path in paths_b]
    except CompareInputError:
        raise  # one line and exit code 2, printed by cli.main
    result = compare(side_a, side_b, options)
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
            raise OutputError(f"cannot write {args.output}: {exc.strerror or exc}") from None
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
