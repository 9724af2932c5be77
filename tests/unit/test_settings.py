"""TRACEML_* parsing: defaults, validation, round trip through the environment."""

from pathlib import Path

import pytest

from traceml import settings as s


def test_defaults(tmp_path):
    result = s.load_settings({}, ["python", "train.py"], now=0.0, cwd=tmp_path)
    assert result.logs_dir == tmp_path / "logs"
    assert result.run_name.startswith("train-")
    assert result.trace_max_steps is None
    assert result.report is True
    assert result.launcher_managed is False
    assert result.run_name_explicit is False


def test_values_are_read(tmp_path):
    env = {
        "TRACEML_LOGS_DIR": "runs",
        "TRACEML_RUN_NAME": "exp_1.a-b",
        "TRACEML_TRACE_MAX_STEPS": "5",
        "TRACEML_REPORT": "0",
        "TRACEML_REPORT_WAIT_S": "2.5",
        "TRACEML_HTML": "yes",
        "TRACEML_THRESHOLD_INPUT_WARN": "0.2",
    }
    result = s.load_settings(env, ["python", "x.py"], cwd=tmp_path)
    assert result.logs_dir == tmp_path / "runs"
    assert result.run_name == "exp_1.a-b"
    assert result.run_name_explicit is True
    assert result.trace_max_steps == 5
    assert result.report is False
    assert result.report_wait_s == 2.5
    assert result.html is True
    assert result.thresholds == {"input_warn": 0.2}
    assert result.run_dir == tmp_path / "runs" / "exp_1.a-b"


@pytest.mark.parametrize(
    ("name", "value", "fragment"),
    [
        ("TRACEML_TRACE_MAX_STEPS", "abc", "TRACEML_TRACE_MAX_STEPS='abc' is not a whole number"),
        ("TRACEML_TRACE_MAX_STEPS", "0", "must be at least 1"),
        ("TRACEML_RUN_NAME", "../escape", "is not a safe run name"),
        ("TRACEML_RUN_NAME", "a b", "is not a safe run name"),
        ("TRACEML_REPORT", "maybe", "is not a yes/no value"),
        ("TRACEML_REPORT_WAIT_S", "-1", "must be a finite number of seconds, zero or more"),
        ("TRACEML_REPORT_WAIT_S", "inf", "must be a finite number of seconds, zero or more"),
        ("TRACEML_THRESHOLD_NOPE", "1", "unknown threshold"),
        ("TRACEML_THRESHOLD_INPUT_WARN", "x", "is not a number"),
    ],
)
def test_bad_values_name_the_variable(tmp_path, name, value, fragment):
    with pytest.raises(s.SettingsError) as info:
        s.load_settings({name: value}, ["python", "t.py"], cwd=tmp_path)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_a_traceml_value_that_is_no_yes_or_no_is_named_where_it_starts_tracing():
    # Any value but an off one started tracing, silently (helper review).
    with pytest.raises(s.SettingsError, match="TRACEML='disabled' is not a yes/no value"):
        s.check_enable({"TRACEML": "disabled"})
    for value in ("1", "yes", "On", ""):
        s.check_enable({"TRACEML": value})
    from traceml.capture.bootstrap import _own_command

    assert _own_command(["python", "/venv/bin/traceml", "run", "t.py"])
    assert _own_command(["python", "-m", "traceml", "report", "logs/x"])
    assert not _own_command(["python", "train.py"])


@pytest.mark.parametrize(
    ("argv", "stem"),
    [
        (["python", "/a/b/train.py", "--x"], "train"),
        (["python", "-u", "train.py"], "train"),
        (["python", "-X", "importtime", "my run.py"], "my_run"),
        (["python", "-m", "pkg.trainer", "--lr", "1"], "trainer"),
        (["python", "-mpkg.tool"], "tool"),
        (["python", "-c", "print(1)"], "python"),
        (["python"], "python"),
    ],
)
def test_script_stem(argv, stem):
    assert s.script_stem(argv) == stem


def test_run_name_prefers_the_launch_stamp_then_the_elastic_run_id():
    argv = ["python", "train.py"]
    assert s.default_run_name({"TRACEML_LAUNCH_STAMP": "20260101-000000"}, argv) == (
        "train-20260101-000000"
    )
    assert s.default_run_name({"TORCHELASTIC_RUN_ID": "job42"}, argv) == "train-job42"
    assert s.default_run_name({"TORCHELASTIC_RUN_ID": "none"}, argv, now=0).startswith("train-19")


def test_round_trip_through_the_environment(tmp_path):
    original = s.Settings(
        logs_dir=tmp_path,
        run_name="abc",
        trace_max_steps=3,
        report=False,
        report_wait_s=1.5,
        html=True,
        launcher_managed=True,
        thresholds={"input_warn": 0.3, "warmup_steps": 1},
        run_name_explicit=False,
    )
    env = s.settings_to_env(original)
    assert env["TRACEML"] == "1"
    assert s.load_settings(env, ["python", "z.py"], cwd=Path("/")) == original


def test_mark_launch_does_not_override_a_chosen_name():
    env = {"TRACEML_RUN_NAME": "mine"}
    s.mark_launch(env)
    assert "TRACEML_LAUNCH_STAMP" not in env
    env = {}
    s.mark_launch(env, now=0)
    assert env["TRACEML_LAUNCH_STAMP"]


def test_distributed_env():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "GROUP_RANK": "1"}
    d = s.distributed_env(env)
    assert (d.rank, d.local_rank, d.world_size, d.node_rank) == (3, 1, 4, 1)
    assert s.distributed_env({"RANK": "x"}).rank is None


def test_a_long_script_name_keeps_its_stamp():
    # The stamp was cut off a stem of 80+ characters: the second launch of that script found
    # the first one's directory ("rank_0.jsonl already exists").
    argv = ["python", "x" * 120 + ".py"]
    first = s.default_run_name({}, argv, now=0)
    second = s.default_run_name({}, argv, now=1)
    assert first != second
    assert second.endswith("-" + s.make_launch_stamp(1))
    assert len(second) == 80 and s.is_valid_run_name(second)
    stamp = {"TRACEML_LAUNCH_STAMP": "20260101-000000"}
    assert s.default_run_name(stamp, argv).endswith("-20260101-000000")
    assert s.default_run_name({"TORCHELASTIC_RUN_ID": "job42"}, argv).endswith("-job42")
    # A run id too long to fit keeps one letter of the stem and the first 78 of the id.
    assert s.default_run_name({"TORCHELASTIC_RUN_ID": "j" * 200}, argv) == "x-" + "j" * 78


@pytest.mark.parametrize(
    ("argv", "target"),
    [
        (["python", "-um", "torch.distributed.run", "x.py"], ("module", "torch.distributed.run")),
        (["python", "-Bm", "pkg.train", "--lr", "1"], ("module", "pkg.train")),
        (["python", "-Bmpkg.train"], ("module", "pkg.train")),
        (["python", "-Ec", "print(1)"], ("code", "print(1)")),
        (["python", "-uW", "ignore", "t.py"], ("script", "t.py")),
        (["python", "-uWignore", "-m", "pkg"], ("module", "pkg")),
        (["python", "-X", "dev", "-Im", "pkg"], ("module", "pkg")),
        (["python", "--check-hash-based-pycs", "always", "t.py"], ("script", "t.py")),
        (["python", "-"], ("script", "-")),
        (["python", "-m"], ("module", "")),
    ],
)
def test_interpreter_target_reads_combined_flags_as_cpython(argv, target):
    assert s.interpreter_target(argv) == target


def test_each_restart_of_a_torchrun_job_is_a_run_of_its_own(tmp_path):
    from traceml.capture.run_name import restart_count, restarted

    assert [restart_count(e) for e in ({}, {"TORCHELASTIC_RESTART_COUNT": "2"})] == [0, 2]
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "x"}) == 0
    base = s.load_settings({"TRACEML_LOGS_DIR": str(tmp_path), "TRACEML_RUN_NAME": "job"}, ["p"])
    assert restarted(base, 0) is base
    again = restarted(base, 1)
    assert again.run_name == "job-restart1" and restarted(again, 1) == again  # inherited: kept
    long = base.replace(run_name="a" * 128)
    assert restarted(long, 3).run_name == "a" * 119 + "-restart3"
    assert s.is_valid_run_name(restarted(long, 3).run_name)
    managed = base.replace(launcher_managed=True)  # traceml run's directory is the job's
    assert restarted(managed, 1) is managed
