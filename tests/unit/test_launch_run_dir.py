"""Two launches in the same second derive the same run name: the second gets a suffix instead
of a refusal (the script never ran); a chosen --run-name is still refused when taken. And the
settings ``traceml run`` derives from its options and the TRACEML_* environment."""

from __future__ import annotations

import os
import re

import pytest

from traceml.errors import LaunchError
from traceml.launch import _create_run_dir
from traceml.settings import Settings


def _settings(tmp_path, explicit: bool) -> Settings:
    return Settings(logs_dir=tmp_path, run_name="train-20261206-101010", run_name_explicit=explicit)


def test_a_derived_name_taken_gets_the_next_free_suffix(tmp_path):
    first = _create_run_dir(_settings(tmp_path, explicit=False))
    second = _create_run_dir(_settings(tmp_path, explicit=False))
    third = _create_run_dir(_settings(tmp_path, explicit=False))
    assert [s.run_name for s in (first, second, third)] == [
        "train-20261206-101010",
        "train-20261206-101010-2",
        "train-20261206-101010-3",
    ]
    assert all((s.run_dir / "ranks").is_dir() for s in (first, second, third))


def test_a_chosen_name_taken_is_refused(tmp_path):
    _create_run_dir(_settings(tmp_path, explicit=True))
    with pytest.raises(LaunchError, match="already exists; choose another --run-name"):
        _create_run_dir(_settings(tmp_path, explicit=True))


def _run_settings(
    tmp_path, monkeypatch, *options: str, script: str = "train.py", **environ: str
) -> Settings:
    """What ``traceml run SCRIPT OPTIONS`` would run with, in this environment."""
    from traceml.cli import _threshold_overrides, build_parser
    from traceml.launch import make_settings

    for name in list(os.environ):
        if name.startswith("TRACEML"):
            monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    (tmp_path / script).write_text("")
    args = build_parser().parse_args(["run", str(tmp_path / script), *options])
    return make_settings(args, _threshold_overrides(args.threshold))


def test_run_reads_the_environment_under_its_options(tmp_path, monkeypatch):
    # TRACEML_THRESHOLD_* were checked by `traceml run` but left out of its report, and the
    # options' defaults silently replaced TRACEML_LOGS_DIR, _RUN_NAME, _HTML and _REPORT.
    env = {
        "TRACEML_THRESHOLD_INPUT_WARN": "0.1",
        "TRACEML_THRESHOLD_MIN_STEPS": "3",
        "TRACEML_LOGS_DIR": "elsewhere",
        "TRACEML_RUN_NAME": "chosen",
        "TRACEML_HTML": "1",
        "TRACEML_REPORT": "0",
    }
    settings = _run_settings(tmp_path, monkeypatch, "--threshold", "input_warn=0.2", **env)
    assert settings.thresholds == {"input_warn": 0.2, "min_steps": 3}
    assert settings.run_dir == tmp_path.resolve() / "elsewhere" / "chosen"
    assert settings.run_name_explicit and settings.html and not settings.report
    settings = _run_settings(
        tmp_path, monkeypatch, "--logs-dir", "mine", "--run-name", "flag", "--no-report", **env
    )
    assert settings.run_dir == tmp_path.resolve() / "mine" / "flag"
    # An option given replaces its variable, which is then not read: a bad one is no error.
    bad_name = {**env, "TRACEML_RUN_NAME": "../bad"}
    assert _run_settings(tmp_path, monkeypatch, "--run-name", "ok", **bad_name).run_name == "ok"
    with pytest.raises(LaunchError, match=re.escape("TRACEML_RUN_NAME='../bad' is not")):
        _run_settings(tmp_path, monkeypatch, **bad_name)
    bad = {"TRACEML_TRACE_MAX_STEPS": "abc", "TRACEML_REPORT": "?", "TRACEML_HTML": "?"}
    bad["TRACEML_THRESHOLD_MIN_STEPS"] = "x"  # (review: each an error though an option given)
    options = ["--trace-max-steps", "3", "--no-report", "--html", "--threshold", "min_steps=4"]
    given = _run_settings(tmp_path, monkeypatch, *options, **bad)
    assert given.trace_max_steps == 3 and given.thresholds == {"min_steps": 4}
    plain = _run_settings(tmp_path, monkeypatch)
    assert plain.logs_dir == tmp_path.resolve() / "logs" and plain.thresholds == {}
    assert plain.report and not plain.html and not plain.run_name_explicit


def test_run_keeps_the_stamp_of_a_long_script_name(tmp_path, monkeypatch):
    settings = _run_settings(tmp_path, monkeypatch, script="x" * 120 + ".py")
    assert re.fullmatch(r"x+-\d{8}-\d{6}", settings.run_name) and len(settings.run_name) == 80


def test_an_unknown_user_in_logs_dir_is_a_plain_name(tmp_path, monkeypatch):
    # Path.expanduser raised RuntimeError on "~nouser/x": a traceback, exit 70. Now read as
    # TRACEML_LOGS_DIR is (os.path.expanduser leaves it as it is).
    settings = _run_settings(tmp_path, monkeypatch, "--logs-dir", "~traceml_no_such_user/x")
    assert settings.logs_dir == tmp_path.resolve() / "~traceml_no_such_user" / "x"
