"""Reading a ``final_summary.json`` for ``traceml compare``: one-line errors for the user."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from traceml import schema
from traceml.errors import UserError
from traceml.files import text_path


class CompareInputError(UserError):
    """A file that cannot be compared; one line for the user (cli.main), exit code 2."""


def load_summary(path: Path | str) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        candidate = path / schema.SUMMARY_JSON
        if not candidate.is_file():
            raise CompareInputError(_no_summary_in(path))
        path = candidate
    if not (path.is_file() or path.is_fifo()):  # (a pipe: `<(cat a.json)`, /dev/stdin)
        if path.exists():
            raise CompareInputError(f"{path} is not a regular file")
        raise CompareInputError(f"no such file: {path}")
    try:
        data = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError:
        raise CompareInputError(f"{path} is not JSON (is it a final_summary.json?)") from None
    except OSError as exc:
        raise CompareInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    return check_summary(data, path)


def check_summary(data: Any, path: Path) -> dict[str, Any]:
    """A parsed file as a summary compare can read; CompareInputError (one line) when not."""
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
    _check_numbers(data, path)
    data["_path"] = text_path(path)  # for people and JSON
    data["_file"] = str(path)  # for the file system (a name that is not UTF-8 kept as is)
    return data


# Figures the comparison prints as they are (not through a job series, which is checked when it
# is estimated): a hand-edited string or object there would only fail while printing.
_NUMBERS = (
    (schema.SUMMARY_OVERALL, schema.PEAK_RESERVED),
    (schema.SUMMARY_OVERALL, schema.PEAK_RSS),
    (schema.SUMMARY_IMBALANCE, schema.IMBALANCE_FIELDS, schema.OWN_MS, "max_over_others"),
    (schema.SUMMARY_IMBALANCE, schema.IMBALANCE_FIELDS, schema.STEP, "max_over_others"),
)


# Fields read as they are, whose type a hand edit could change into a wrong verdict or a
# contradiction ("different world sizes (1 vs 1)") rather than a failure.
_TYPED = (
    ((schema.WORLD_SIZE,), int, "a whole number"),
    ((schema.SUMMARY_SETUP, schema.WORLD_SIZE), int, "a whole number"),
    ((schema.SUMMARY_OVERALL, schema.STEPS_PER_S), (int, float), "a number"),
    ((schema.RUN,), str, "a string"),
    ((schema.SUMMARY_STATUS,), str, "a string"),
    ((schema.SUMMARY_NOTES,), list, "a list"),
)


def _check_numbers(data: dict[str, Any], path: Path) -> None:
    """A wrongly typed figure is one line naming it (exit 2), not a failure while printing."""
    checks = [(keys, (int, float), "a number") for keys in _NUMBERS] + list(_TYPED)
    for keys, types, what in checks:
        node: Any = data
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None and (isinstance(node, bool) or not isinstance(node, types)):
            raise CompareInputError(
                f"{path}: {'.'.join(keys)} is {orjson.dumps(node).decode()[:40]}, not {what} "
                "(was the summary edited by hand?)"
            )


# ----------------------------------------------------------------------------------------------
# Statistics


def _no_summary_in(directory: Path) -> str:
    """A directory that exists but holds no summary: say so, and what would make one."""
    if (directory / schema.RANKS_DIR).is_dir():
        return (
            f"{directory} is a run directory without a {schema.SUMMARY_JSON} (the run has not "
            f"been reported yet): traceml report {directory}"
        )
    return (
        f"{directory} has no {schema.SUMMARY_JSON}: give a final_summary.json or a run "
        "directory (logs/<run-name>)"
    )
