"""Two launches in the same second derive the same run name: the second gets a suffix instead
of a refusal (the script never ran); a chosen --run-name is still refused when taken."""

from __future__ import annotations

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
