"""One "is tracing off?" rule, and the idle start-up budget it protects: with TRACEML unset,
the start-up hook imports nothing beyond what Python had already loaded."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import traceml_bootstrap
from traceml import settings

ROOT = Path(__file__).resolve().parents[2]
PTH = ROOT / "traceml_bootstrap.pth"


def _pth_off_values() -> tuple[str, ...]:
    """The tuple the .pth line compares TRACEML against (read from its source, not run)."""
    tree = ast.parse(PTH.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.NotIn):
            return ast.literal_eval(node.comparators[0])
    raise AssertionError("no 'not in (...)' test in the .pth line")


def test_pth_line_settings_and_bootstrap_share_one_off_rule():
    assert _pth_off_values() == traceml_bootstrap.OFF_VALUES
    assert frozenset(traceml_bootstrap.OFF_VALUES) == settings._OFF_VALUES


@pytest.mark.parametrize(
    ("value", "on"),
    [("", False), ("0", False), (" OFF ", False), ("No", False), ("1", True), ("yes", True)],
)
def test_the_rule_on_values(value, on):
    assert traceml_bootstrap.tracing_requested({"TRACEML": value}) is on
    assert traceml_bootstrap.tracing_requested({}) is False


def _python(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout.strip()


@pytest.mark.parametrize("value", [None, "", "0", "off"])
def test_idle_pth_line_imports_nothing(value):
    env = {} if value is None else {"TRACEML": value}
    code = (
        "import sys; before = set(sys.modules); "
        f"exec(open({str(PTH)!r}).read()); "
        "print(sorted(set(sys.modules) - before), hasattr(sys, '_traceml_pth_ran'))"
    )
    assert _python(code, **env) == "[] False"


def test_idle_interpreter_start_loads_no_traceml_module():
    code = "import sys; print(sorted(m for m in sys.modules if m.startswith('traceml')))"
    assert _python(code) == "[]"


def test_installed_start_up_files_are_the_repository_s():
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    for name in ("traceml_bootstrap.pth", "traceml_bootstrap.start"):
        installed = site / name
        if not installed.exists():
            pytest.skip(f"{name} is not installed in {site} (run scripts/env.sh)")
        assert installed.read_text() == (ROOT / name).read_text(), name


def test_init_does_not_turn_tracing_on_again_after_a_failure(monkeypatch, tmp_path):
    # A failure no callback owns turns tracing off for the process (guard -> deactivate); a
    # later traceml.init() (a notebook cell run again) turned it back on (review).
    from traceml.capture import bootstrap, manual

    monkeypatch.setattr(bootstrap, "register_integrations", lambda hooks=None: None)
    monkeypatch.delenv("TRACEML", raising=False)
    bootstrap.reset_for_tests()
    try:
        manual.init(logs_dir=tmp_path, run_name="first")
        assert bootstrap.active_settings() is not None
        bootstrap.deactivate()
        manual.init(logs_dir=tmp_path, run_name="first")
        assert bootstrap.active_settings() is None
    finally:
        bootstrap.reset_for_tests()
