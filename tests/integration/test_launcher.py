"""`traceml run` and direct launches: real subprocesses, real torchrun with 2 gloo ranks."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time

import psutil
import pytest

from procs import (
    PYTHON,
    TINY,
    clean_env,
    only_run_dir,
    rank_records,
    run,
    steps_of,
    steps_written,
    traceml,
)


@pytest.fixture
def tiny(tmp_path):
    """A copy of the tiny script inside tmp_path: every process it starts names tmp_path."""
    target = tmp_path / "tiny_lightning.py"
    shutil.copy(TINY, target)
    return target


def leftovers(tmp_path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(str(tmp_path) in part for part in process.info["cmdline"] or []):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def assert_no_orphans(tmp_path):
    deadline = time.monotonic() + 10
    while leftovers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers(tmp_path) == []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_single_process_run(tmp_path, tiny):
    env = clean_env(TINY_BATCHES=14, TINY_VALIDATE=0)
    result = run(
        traceml(
            "run", tiny, "--logs-dir", tmp_path / "logs", "--html", "--args", "--ignored-by-tiny"
        ),
        env,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    run_dir = only_run_dir(tmp_path / "logs")
    assert run_dir.name.startswith("tiny_lightning-")
    assert sorted(p.name for p in (run_dir / "ranks").iterdir()) == ["rank_0.jsonl"]
    summary = json.loads((run_dir / "final_summary.json").read_text())
    assert summary["steps_recorded"] == 14
    assert (run_dir / "final_summary.txt").is_file() and (run_dir / "report.html").is_file()
    # The report comes on stderr (the script's stdout stays its own), the HTML's path after it.
    assert result.stderr.rstrip().splitlines()[-2].startswith("Summary: ")
    assert "traceml: wrote " in result.stderr.rstrip().splitlines()[-1]
    assert "Verdict:" in result.stderr and "Verdict:" not in result.stdout
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["exit_code"] == 0
    assert manifest["child_command"][-1] == "--ignored-by-tiny"
    assert manifest["cwd"] == str(tmp_path)
    assert manifest["topology"]["world_size"] == 1
    assert manifest["versions"]["torch"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("import sys; sys.exit(2)", "the script exited with code 2 before any step"),
        ("pass", "did the script step an optimizer"),
    ],
)
def test_a_run_with_no_step_says_why_in_one_line(tmp_path, body, says):
    # A script that failed at its argument parsing got the hint about optimizers and
    # WORLD_SIZE, sending its user to look for the wrong cause.
    script = tmp_path / "early.py"
    script.write_text(body + "\n")
    result = run(traceml("run", script, "--logs-dir", tmp_path / "logs"), clean_env(), tmp_path)
    assert result.returncode == (2 if "exit" in body else 0)
    lines = [line for line in result.stderr.splitlines() if "no training steps" in line]
    assert len(lines) == 1 and says in lines[0], result.stderr


def test_module_launch_no_report_and_the_exit_code(tmp_path, tiny):
    # The script's sys.exit(3) after training is the launch's exit code.
    env = clean_env(TINY_BATCHES=3, TINY_VALIDATE=0, TINY_EXIT_CODE=3, PYTHONPATH=tmp_path)
    result = run(
        traceml(
            "run",
            "-m",
            "tiny_lightning",
            "--logs-dir",
            tmp_path / "logs",
            "--run-name",
            "mod",
            "--no-report",
        ),
        env,
        tmp_path,
    )
    assert result.returncode == 3, result.stderr
    assert "Verdict:" not in result.stdout + result.stderr
    assert len(steps_of(rank_records(tmp_path / "logs" / "mod"))) == 3


def test_a_script_exiting_with_an_error_code_after_training_is_a_failed_run(tmp_path, tiny):
    # sys.exit(3) after the loop: every rank file ends "completed" (nothing raised inside the
    # training), and the report said "completed" beside its note of the exit code.
    env = clean_env(TINY_BATCHES=4, TINY_VALIDATE=0, TINY_EXIT_CODE=3)
    result = run(
        traceml("run", tiny, "--logs-dir", tmp_path / "logs", "--run-name", "three"), env, tmp_path
    )
    assert result.returncode == 3, result.stderr
    assert "the script exited with code 3 (a failure, by its own account)" in result.stderr
    summary = json.loads((tmp_path / "logs" / "three" / "final_summary.json").read_text())
    assert summary["status"] == "failed"
    assert rank_records(tmp_path / "logs" / "three")[-1]["status"] == "completed"
    # `traceml report` made again (the docs' advice after a crash) read only the rank files and
    # turned the launcher's "failed" back into "completed", its note gone (review, stop 60).
    again = run(traceml("report", tmp_path / "logs" / "three"), clean_env(), tmp_path)
    assert again.returncode == 0, again.stderr
    assert "the script exited with code 3 (a failure, by its own account)" in again.stdout
    summary = json.loads((tmp_path / "logs" / "three" / "final_summary.json").read_text())
    assert summary["status"] == "failed"


def test_a_script_killed_from_elsewhere_is_named_by_its_signal(tmp_path, tiny):
    # Killed by SIGKILL (the OOM killer's), not by traceml run: the report read "exited with
    # code 137 (a failure, by its own account)" (helper review).
    env = clean_env(TINY_BATCHES=4, TINY_VALIDATE=0, TINY_KILL_ITSELF=1)
    result = run(
        traceml("run", tiny, "--logs-dir", tmp_path / "logs", "--run-name", "oom"), env, tmp_path
    )
    assert result.returncode == 137, result.stderr  # 128 + 9, as a shell shows it
    assert "the script was killed by SIGKILL (exit code 137), not sent by traceml run" in (
        result.stderr
    )
    assert "by its own account" not in result.stderr


def test_script_that_raises_after_three_steps(tmp_path, tiny):
    env = clean_env(TINY_BATCHES=10, TINY_RAISE_AFTER=3, TINY_VALIDATE=0)
    result = run(
        traceml("run", tiny, "--logs-dir", tmp_path / "logs", "--run-name", "boom"), env, tmp_path
    )
    # The user's exception passes through with its traceback and exit code.
    assert result.returncode == 1
    assert "RuntimeError: tiny_lightning: failing on purpose at batch 4" in result.stderr
    assert "Traceback" in result.stderr
    records = rank_records(tmp_path / "logs" / "boom")
    assert len(steps_of(records)) == 3
    assert records[-1]["status"] == "exception"
    assert "failing on purpose" in records[-1]["error"]
    summary = json.loads((tmp_path / "logs" / "boom" / "final_summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["steps_recorded"] == 3
    assert "training failed after 3 steps" in result.stderr
    assert "the script exited with code 1" in result.stderr


# The launcher's exit status is the script's, as untraced (measured: this script sent SIGTERM
# exits 0, Lightning's graceful end; sent SIGINT, 1: "Detected KeyboardInterrupt"). It was
# 143 / 130 whatever the script did. A script killed by the signal: test_launcher_signals.py.
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 1)])
def test_signal_gives_a_partial_report_and_no_orphans(tmp_path, tiny, sig, code):
    env = clean_env(TINY_BATCHES=1000, TINY_STEP_SLEEP_MS=20, TINY_VALIDATE=0, TINY_NUM_WORKERS=2)
    process = subprocess.Popen(
        traceml("run", str(tiny), "--logs-dir", str(tmp_path / "logs"), "--run-name", "term"),
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # SIGINT as in a terminal's job: a test run from a background job inherits it
        # ignored, and the launcher and the script would then both ignore it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    rank_file = tmp_path / "logs" / "term" / "ranks" / "rank_0.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if steps_written(rank_file) >= 4:
            break
        time.sleep(0.1)
    assert len(leftovers(tmp_path)) >= 3  # launcher, script, two DataLoader workers
    process.send_signal(sig)
    _stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == code
    assert f"received {sig.name}" in stderr
    summary = json.loads((tmp_path / "logs" / "term" / "final_summary.json").read_text())
    assert summary["steps_recorded"] >= 4
    assert summary["status"] == "interrupted"
    assert_no_orphans(tmp_path)


def test_two_ranks_under_traceml_run(tmp_path, tiny):
    env = clean_env(TINY_BATCHES=12, TINY_VALIDATE=0)
    result = run(
        traceml(
            "run",
            "--nproc-per-node",
            "2",
            tiny,
            "--logs-dir",
            tmp_path / "logs",
            "--run-name",
            "ddp",
        ),
        env,
        tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "logs" / "ddp"
    assert sorted(p.name for p in (run_dir / "ranks").iterdir()) == ["rank_0.jsonl", "rank_1.jsonl"]
    summary = json.loads((run_dir / "final_summary.json").read_text())
    assert summary["world_size"] == 2
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    # 12 batches split by the DistributedSampler: 6 optimizer steps per rank.
    assert [r["steps_recorded"] for r in summary["ranks"]] == [6, 6]
    assert "Per rank (median ms per step)" in result.stderr
    assert result.stderr.count("Verdict:") == 1
    assert_no_orphans(tmp_path)


def test_direct_torchrun_launch(direct_ddp_run):
    result, run_dir = direct_ddp_run.result, direct_ddp_run.run_dir
    assert run_dir.name.startswith("tiny_lightning-")  # one run directory for both ranks
    assert sorted(p.name for p in (run_dir / "ranks").iterdir()) == ["rank_0.jsonl", "rank_1.jsonl"]
    combined = result.stdout + result.stderr
    assert combined.count("Verdict:") == 1  # printed once, by rank 0
    assert (run_dir / "final_summary.json").is_file()


def test_two_nodes_simulated_on_one_machine(tmp_path, tiny):
    env = clean_env(TINY_BATCHES=8, TINY_VALIDATE=0)
    port = str(free_port())
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--logs-dir",
        str(tmp_path / "logs"),
    ]
    nodes = []
    for rank in (0, 1):
        nodes.append(
            subprocess.Popen(
                traceml("run", *common, "--node-rank", str(rank), str(tiny)),
                env=env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        # Node 1 starts later: its own default run name differs (another second), so the
        # ranks must agree on rank 0's.
        time.sleep(1.5)
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], (
        outputs[0][1][-6000:] + outputs[1][1][-3000:]
    )
    run_dir = only_run_dir(tmp_path / "logs")  # both nodes agreed on one run directory
    assert sorted(p.name for p in (run_dir / "ranks").iterdir()) == ["rank_0.jsonl", "rank_1.jsonl"]
    summary = json.loads((run_dir / "final_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["ranks_missing"] == []
    assert sorted(r["node_rank"] for r in summary["ranks"]) == [0, 1]
    assert "Verdict:" in outputs[0][1] and "Verdict:" not in outputs[0][0]  # on stderr
    assert "node 1 finished" in outputs[1][1]
    # Node 1 named no directory of its own, which would never exist (helper review).
    assert "the ranks write into node 0's run directory" in outputs[1][1]
    assert "traceml watch" not in outputs[1][1]
    # Each node reduced its own rank into a partial; node 0 merged them (no fallback note).
    partials = sorted(p.name for p in (run_dir / "partials").iterdir())
    assert partials == ["node_0.json", "node_1.json"]
    assert not [note for note in summary["notes"] if "partial" in note], summary["notes"]
    assert_no_orphans(tmp_path)


def test_a_scripts_option_before_args_says_where_it_goes(tmp_path):
    # `traceml run train.py --epochs 3` (no --args): argparse's line named no way out.
    command = [PYTHON, "-m", "traceml", "run", "train.py", "--epochs", "3"]
    result = run(command, clean_env(), tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "... --args --epochs 3" in result.stderr


def test_missing_script_is_one_line_exit_2(tmp_path):
    result = run([PYTHON, "-m", "traceml", "run", "nope.py"], clean_env(), tmp_path)
    assert result.returncode == 2
    assert result.stderr == "traceml: error: no such script: nope.py\n"


def test_a_package_directory_runs_as_python_runs_it(tmp_path):
    # `python pkgdir` runs pkgdir/__main__.py; `traceml run pkgdir` said "no such script".
    package = tmp_path / "pkgdir"
    package.mkdir()
    (package / "__main__.py").write_text("print('MAIN RAN')\n")
    env = clean_env(TRACEML_LOGS_DIR=tmp_path / "logs")
    result = run([PYTHON, "-m", "traceml", "run", "pkgdir", "--no-report"], env, tmp_path)
    assert "MAIN RAN" in result.stdout, result.stderr
    (tmp_path / "empty").mkdir()
    refused = run([PYTHON, "-m", "traceml", "run", "empty"], env, tmp_path)
    assert refused.returncode == 2
    assert refused.stderr == "traceml: error: empty is a directory without a __main__.py to run\n"
