"""A damaged or hand-edited summary given to ``traceml compare``: one line and exit 2 (or a
comparison), never an internal error (exit 70) while the result is printed."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import orjson
import pytest

from traceml import compare_command as compare_command_module
from traceml import schema
from traceml.analysis.compare_load import check_summary
from traceml.cli import build_parser, main
from traceml.errors import UserError
from traceml.finalize import summarise

from rankfiles import write_run

# A value of each wrong kind: null, a string, a negative, a list, an object, a bool, a huge one.
WRONG = [None, "x", -1, [], {}, True, 1e308]


def _summary(root: Path, name: str, slow: float = 0.0) -> dict[str, Any]:
    # Two ranks, one slower: every section (imbalance, rank table) has figures to damage.
    ranks = [
        [dict(forward=30 + rank * 5 + slow, backward=60, input=4) for _ in range(12)]
        for rank in range(2)
    ]
    write_run(root / name, ranks)
    summary, _text = summarise(root / name)
    return summary


def _compare(root: Path, a: dict[str, Any], b: dict[str, Any]) -> tuple[int, str]:
    paths = []
    for name, summary in (("a", a), ("b", b)):
        paths.append(root / f"{name}.json")
        paths[-1].write_bytes(orjson.dumps(summary))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["compare", *map(str, paths)])
    return code, err.getvalue()


def _replaced(value: Any, path: tuple, replacement: Any) -> Any:
    """``value`` with the field at ``path`` replaced; the rest shared, not copied."""
    if not path:
        return replacement
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replaced(value[head], rest, replacement)}
    return [*value[:head], _replaced(value[head], rest, replacement), *value[head + 1 :]]


def _fields(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every field's path (a list: its first item only, as every item is read alike)."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _fields(item, (*prefix, key))
    elif isinstance(value, list) and value:
        found += _fields(value[0], (*prefix, 0))
    return found


def _assert_clean(code: int, err: str) -> None:
    assert code in (0, 2), (code, err)
    if code == 2:
        assert err.startswith("traceml: error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("where", "value", "named"),
    [
        ((schema.SUMMARY_IMBALANCE, schema.IMBALANCE_FIELDS, schema.OWN_MS, "max_over_others"),
         "1.2", "max_over_others"),
        ((schema.SUMMARY_OVERALL, schema.PEAK_RESERVED), {}, schema.PEAK_RESERVED),
        ((schema.SUMMARY_OVERALL, schema.PEAK_RSS), "12", schema.PEAK_RSS),
    ],
)  # fmt: skip
def test_a_figure_of_the_wrong_type_is_one_line_naming_it(tmp_path, where, value, named):
    # The review's repro: these crashed while printing (exit 70, "Unknown format code 'f'").
    a = _summary(tmp_path, "ra")
    b = _summary(tmp_path, "rb", slow=3.0)
    code, err = _compare(tmp_path, a, _replaced(b, where, value))
    _assert_clean(code, err)
    assert code == 2 and named in err


def test_every_field_of_a_summary_may_be_damaged(tmp_path, monkeypatch):
    # Every field, each wrong kind of value. The random fuzz (test_fuzz.py) draws a few of the
    # ~600 fields per run and so missed the printed ones; this visits all of them. The files
    # are "read" from memory (through the loader's own checks) and the parser is built once,
    # to keep the ~4,000 cases a few seconds long.
    a = _summary(tmp_path, "ra")
    b = _summary(tmp_path, "rb", slow=3.0)
    given: dict[str, Any] = {"a.json": a}
    monkeypatch.setattr(
        compare_command_module, "load_summary", lambda p: check_summary(given[p], Path(p))
    )
    args = build_parser().parse_args(["compare", "a.json", "b.json"])
    for where in _fields(b):
        for value in WRONG:
            given["b.json"] = _replaced(b, where, value)
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    compare_command_module.compare_command(args)
                except UserError:
                    pass  # one line and exit 2 in cli.main; anything else is exit 70


def test_the_same_run_on_both_sides_is_named(tmp_path):
    from traceml.analysis.compare import compare

    a, b = _summary(tmp_path, "a"), _summary(tmp_path, "b", slow=1.0)
    same = [n for n in compare(a, dict(a))["notes"] if n.startswith("the same run")]
    assert same and "compare the run before your change" in same[0]
    assert not [n for n in compare(a, b)["notes"] if n.startswith("the same run")]
