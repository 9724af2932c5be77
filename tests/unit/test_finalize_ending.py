"""``traceml report`` on a run of ``traceml run``: the ending its manifest recorded."""

from __future__ import annotations

import json

import pytest

from traceml import schema
from traceml.finalize import launch_ending


def write_manifest(run_dir, **fields):
    run_dir.mkdir(exist_ok=True)
    (run_dir / schema.MANIFEST_JSON).write_text(json.dumps(fields))


def test_a_failing_exit_code_fails_the_run_with_its_note(tmp_path):
    write_manifest(tmp_path, exit_code=4, signal=None)
    ending = launch_ending(tmp_path)
    assert ending["status"] is None and ending["exit_code"] == 4
    assert ending["notes"] == [
        "the script exited with code 4 (a failure, by its own account): "
        "this report covers the steps recorded before that"
    ]


def test_a_signal_interrupts_the_run(tmp_path):
    write_manifest(tmp_path, exit_code=143, signal="SIGTERM")
    ending = launch_ending(tmp_path)
    assert ending["status"] == schema.RUN_INTERRUPTED and ending["exit_code"] == 143
    assert ending["notes"][0].startswith("traceml run received SIGTERM and stopped")


def test_a_script_killed_from_elsewhere_is_not_a_failure_by_its_own_account(tmp_path):
    # A SIGKILL to the script (the OOM killer) read "exited with code 137 (a failure, by its
    # own account)" (helper review): the manifest names the signal it died of.
    write_manifest(tmp_path, exit_code=137, signal=None, script_signal="SIGKILL")
    ending = launch_ending(tmp_path)
    assert ending["exit_code"] == 137 and ending["status"] is None
    assert ending["notes"] == [
        "the script was killed by SIGKILL (exit code 137), not sent by traceml run (the "
        "kernel's out-of-memory killer sends SIGKILL): this report covers the steps recorded "
        "before that"
    ]


def test_the_launcher_names_the_signal_a_script_died_of():
    from traceml.launch import died_of

    assert (died_of(-9), died_of(0), died_of(3), died_of(-200)) == ("SIGKILL", None, None, None)


@pytest.mark.parametrize(
    "fields",
    [
        {"exit_code": 4, "signal": None, "script_signal": "SIGKILL\nforged"},
        {"exit_code": None, "signal": None},  # still running
        {"exit_code": True, "signal": None},
        {"exit_code": "4", "signal": None},
        {"exit_code": 4, "signal": "SIGTERM\\nforged line"},
        {"exit_code": 4, "signal": 15},
    ],
)
def test_no_ending_from_a_running_or_odd_manifest(tmp_path, fields):
    write_manifest(tmp_path, **fields)
    assert launch_ending(tmp_path) == {}


def test_no_manifest_or_a_broken_one(tmp_path):
    assert launch_ending(tmp_path) == {}  # a direct launch
    (tmp_path / schema.MANIFEST_JSON).write_text("{not json")
    assert launch_ending(tmp_path) == {}
    (tmp_path / schema.MANIFEST_JSON).write_text("[1]")
    assert launch_ending(tmp_path) == {}
