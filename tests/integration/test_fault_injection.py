"""Every door from training code into traceml, broken on purpose: training must not notice.

``TRACEML_FAULT_INJECT=<entry point>`` makes that entry point raise (traceml.capture.guard). For
each registered entry point, a real seeded training runs with it broken and must end as the same
training without traceml ends: same exit code, same global step, the same final weights bit
for bit; traceml says so in exactly one warning per process that hit the fault, and whatever
rank file it left parses line by line. Full disk, failing disk and a deleted logs directory
are the same promise for the rank file's writes.

The runs are started together in the background (two at a time: the CI machine has two
cores); each test waits for its own.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from procs import PYTHON, SCRIPTS, TINY, clean_env, run, steps_written, torchrun_2
from rankfiles import lines_as_written

RFDETR_TRAIN = SCRIPTS / "rfdetr_train.py"
JOBS = int(os.environ.get("FAULT_SUITE_JOBS", "2"))
# Two epochs of 4 batches: the second epoch's DataLoader iterator is created inside the traced
# fit (the first one is created in Lightning's setup_data, before on_train_start).
EPOCHS, BATCHES = 2, 4
STEPS = EPOCHS * BATCHES
TORCHRUN_STEPS = STEPS // 2  # a DistributedSampler gives each of the 2 ranks half
RAISE_AFTER = 5  # the user's exception comes in the second epoch
ANNOUNCEMENT = re.compile(r"^traceml: tracing into ")

# The training every scenario of a launcher kind runs, traced or not.
TINY_ENV = {
    "TINY_EPOCHS": EPOCHS,
    "TINY_BATCHES": BATCHES,
    "TINY_VALIDATE": 0,
    "TINY_WEIGHTS_HASH": 1,
}
LAUNCHERS: dict[str, dict] = {
    "plain": TINY_ENV,
    # A validation at each epoch's end (and Lightning's sanity check before training).
    "validating": {**TINY_ENV, "TINY_VALIDATE": 1},
    # A user exception at batch RAISE_AFTER + 1: Lightning calls on_exception.
    "raising": {**TINY_ENV, "TINY_RAISE_AFTER": RAISE_AFTER},
    # traceml.capture.frameworks.rfdetr.init() in the script instead of TRACEML=1.
    "init": {**TINY_ENV, "TINY_INIT": "fault"},
    # 2 gloo ranks; the user's own collectives (sync and async) and DDP comm hook. Unbuffered
    # stderr, as many CI runners set it: the two ranks' warnings share one pipe and must not
    # run together (CI caught exactly that).
    "torchrun": {
        **TINY_ENV,
        "TINY_COLLECTIVES": 1,
        "TINY_COMM_DELAY_MS": 1,
        "PYTHONUNBUFFERED": 1,
    },
    "rfdetr": {"RFD_SKIP_EVAL": 1, "HF_HUB_OFFLINE": 1},
    # Any PyTorch loop (traceml.capture.frameworks.torch_loop): a hand-written loop with a
    # validation pass, and a Hugging Face Trainer (tiny BERT from a config), one raising.
    "loop": {"LOOP_STEPS": STEPS, "LOOP_VALIDATE_EVERY": 4},
    "loop_amp": {"LOOP_STEPS": STEPS, "LOOP_SCALER": 1, "LOOP_OVERFLOW_AT": 2},
    "loop_closure": {"LOOP_STEPS": STEPS, "LOOP_CLOSURE": 1},
    "hf": {"HF_STEPS": STEPS, "HF_HUB_OFFLINE": 1},
    "hf_raising": {"HF_STEPS": STEPS, "HF_RAISE_AT": RAISE_AFTER + 1, "HF_HUB_OFFLINE": 1},
}
SCRIPT_OF = {
    "loop": SCRIPTS / "plain_loop.py",
    "loop_amp": SCRIPTS / "plain_loop.py",
    "loop_closure": SCRIPTS / "plain_loop.py",
    "hf": SCRIPTS / "hf_trainer.py",
    "hf_raising": SCRIPTS / "hf_trainer.py",
}
# The untraced run whose exit code and weights a launcher kind's runs must match (RF-DETR:
# exit code and warning only).
REFERENCE = {"plain": "plain", "init": "plain", "raising": "raising", "torchrun": "torchrun"}
EXPECTED_STEP = {"plain": STEPS, "init": STEPS, "raising": RAISE_AFTER, "torchrun": TORCHRUN_STEPS}
REFERENCE.update(
    validating="validating",
    loop="loop",
    loop_amp="loop_amp",
    loop_closure="loop_closure",
    hf="hf",
    hf_raising="hf_raising",
)
EXPECTED_STEP.update(
    validating=STEPS,
    loop=STEPS,
    loop_amp=STEPS,
    loop_closure=STEPS,
    hf=STEPS,
    hf_raising=RAISE_AFTER,
)


@dataclass(frozen=True)
class Scenario:
    launcher: str
    # What the rank file(s) must end as: absent (traceml never got as far as creating one),
    # "disabled" (the fault turned tracing off mid-run) or "completed" (it came after).
    rank_file: str | None = "disabled"
    exit_code: int = 0
    # What the one warning says was turned off: all of tracing, or (an optional part that
    # fails on its own, such as a sampler) only that part.
    turned_off: str = "tracing disabled"


def scenario(launcher: str, rank_file: str | None = "disabled", **kwargs) -> Scenario:
    return Scenario(launcher, rank_file, **kwargs)


# Every name in traceml.capture.guard.ENTRY_POINTS, and the run that reaches it.
SCENARIOS: dict[str, Scenario] = {
    "import hook": scenario("plain", None),
    # Between `import lightning` and Lightning's code: the module still runs exactly once.
    "import_hooks.runner": scenario("plain", None),
    "import_hooks.finder": scenario("plain", None),
    "import_hooks.loader": scenario("plain", None),
    "lightning.Trainer.fit": scenario("plain", None),
    # After the fit: the rank file is complete by then.
    "lightning.Trainer.fit_done": scenario("plain", "completed"),
    "lightning.setup": scenario("plain", None),
    "lightning.on_train_start": scenario("plain"),
    "lightning.on_train_epoch_start": scenario("plain"),
    # Dispatched where the transfer, forward and backward have doors before them (CUDA events,
    # collectives); a single process on CPU opens Optimizer at the backward's end instead.
    "lightning.on_before_optimizer_step": scenario("torchrun"),
    "lightning.optimizer_stepped": scenario("torchrun"),
    "lightning.on_train_batch_end": scenario("plain"),
    "lightning.on_train_epoch_end": scenario("plain"),
    "lightning.on_validation_start": scenario("validating"),
    "lightning.on_validation_end": scenario("validating"),
    "lightning.on_train_end": scenario("plain"),
    "lightning.on_exception": scenario("raising", exit_code=1),
    "lightning.teardown": scenario("plain"),
    "lightning.fetcher_iter": scenario("plain"),
    "lightning.fetcher_next": scenario("plain"),
    # The door before the transfer exists where a CUDA event or a collective needs it (a
    # single process on CPU times the transfer with the door after it alone).
    "lightning.batch_to_device": scenario("torchrun"),
    "lightning.batch_transferred": scenario("plain"),
    "lightning.backward_timed": scenario("plain"),
    "lightning.backward_started": scenario("torchrun"),
    "lightning.backward_ended": scenario("torchrun"),
    "lightning.forward_timed": scenario("plain"),
    # The forward's two-door timing: where a CUDA event or a collective needs a door before.
    "lightning.forward_started": scenario("torchrun"),
    "lightning.forward_ended": scenario("torchrun"),
    # Worker-side input timing; with num_workers=0 its doors run in the training process.
    "dataloader.install": scenario("plain"),
    "dataloader.iterator": scenario("plain"),
    "dataloader.iterator_made": scenario("plain"),
    "dataloader.batch": scenario("plain"),
    # The telemetry sampler turns only itself off: the steps are still recorded.
    "telemetry.start": scenario("plain", "completed", turned_off="telemetry off"),
    "telemetry.collect": scenario("plain", "completed", turned_off="telemetry off"),
    "telemetry.stop": scenario("plain", "completed", turned_off="telemetry off"),
    # Fires after teardown wrote the footer: the file is complete.
    "exit handler": scenario("plain", "completed"),
    "init": scenario("init", None),
    "rfdetr.build_trainer": scenario("rfdetr", None),
    "distributed.register_comm_hook": scenario("torchrun"),
    "distributed.collective_start": scenario("torchrun"),
    "distributed.collective_end": scenario("torchrun"),
    "distributed.work_wait_start": scenario("torchrun"),
    "distributed.work_wait": scenario("torchrun"),
    "distributed.backward_started": scenario("torchrun"),
    "distributed.bucket_start": scenario("torchrun"),
    "distributed.bucket_launched": scenario("torchrun"),
    "distributed.backward_finished": scenario("torchrun"),
    # Any PyTorch loop: a door that fails before the first training forward leaves no file.
    "torch_loop.install": scenario("loop", None),
    "torch_loop.fetch": scenario("loop", None),
    "torch_loop.forward_pre_hook": scenario("loop", None),
    "torch_loop.forward_hook": scenario("loop"),
    "torch_loop.backward": scenario("loop"),
    "torch_loop.backward_done": scenario("loop"),
    "torch_loop.optimizer_pre_hook": scenario("loop"),
    "torch_loop.optimizer_hook": scenario("loop"),
    "torch_loop.epoch_end": scenario("loop"),
    # AMP's GradScaler skipping the optimizer step of an overflowing step.
    "torch_loop.scaler_skipped": scenario("loop_amp"),
    # optimizer.step(closure) (L-BFGS): named before any forward, so no rank file.
    "torch_loop.closure_step": scenario("loop_closure", None),
    "hf_trainer.train": scenario("hf", None),
    "hf_trainer.on_train_begin": scenario("hf", None),
    "hf_trainer.on_pre_optimizer_step": scenario("hf"),
    "hf_trainer.on_optimizer_step": scenario("hf"),
    "hf_trainer.on_step_end": scenario("hf"),
    "hf_trainer.on_train_end": scenario("hf"),
    "hf_trainer.train_failed": scenario("hf_raising", exit_code=1),
    # After the Trainer's own on_train_end closed the rank file.
    "hf_trainer.train_done": scenario("hf", "completed"),
}

# Under torchrun each rank breaks a different entry point (TINY_FAULT_INJECT_BY_RANK): half the
# runs, and the ranks disagree on whether they trace, which must not matter either.
TORCHRUN_PAIRS = [
    ("distributed.register_comm_hook", "distributed.collective_start"),
    ("distributed.collective_end", "distributed.work_wait"),
    ("distributed.backward_started", "distributed.bucket_start"),
    ("distributed.bucket_launched", "distributed.backward_finished"),
    ("lightning.batch_to_device", "distributed.work_wait_start"),
    ("lightning.forward_started", "lightning.forward_ended"),
    ("lightning.backward_started", "lightning.backward_ended"),
    ("lightning.on_before_optimizer_step", "lightning.optimizer_stepped"),
]


def injection(entry: str) -> tuple[str, int, dict]:
    """(run key, the rank that breaks ``entry``, environment) of the run that breaks it."""
    for pair in TORCHRUN_PAIRS:
        if entry in pair:
            return (
                "inject-" + "+".join(pair),
                pair.index(entry),
                {"TINY_FAULT_INJECT_BY_RANK": ",".join(pair)},
            )
    return f"inject-{entry}", 0, {"TRACEML_FAULT_INJECT": entry}


# The rank file's writes failing mid-run: after 4 writes (header and 3 steps), every further
# os.write to it raises this errno (tiny_lightning's TINY_FAIL_WRITE).
WRITE_FAILURES = {"ENOSPC": "No space left on device", "EIO": "Input/output error"}


# ----------------------------------------------------------------------------------------------
# Running


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    logs: Path

    def weights(self) -> list[tuple[int, str]]:
        """(global_step, sha256 of the final state_dict) per process, in printing order."""
        # Not anchored to line starts: two ranks share one pipe, and another process's
        # unterminated output may precede the line.
        found = re.findall(r"TINY_WEIGHTS global_step=(\d+) sha256=([0-9a-f]{64})", self.stdout)
        return [(int(step), digest) for step, digest in found]

    def warnings(self) -> list[str]:
        """traceml's lines on stderr, less the informational start-of-run announcement."""
        return [
            line
            for line in self.stderr.splitlines()
            if line.startswith("traceml:") and not ANNOUNCEMENT.match(line)
        ]

    def rank_files(self) -> list[Path]:
        return sorted(self.logs.glob("*/ranks/rank_*.jsonl")) if self.logs.is_dir() else []

    def describe(self) -> str:
        return f"exit {self.returncode}\n--- stderr (tail) ---\n{self.stderr[-3000:]}"


def launch(launcher: str, workdir: Path, *, traced: bool, **extra) -> Outcome:
    workdir.mkdir(parents=True, exist_ok=True)
    logs = workdir / "logs"
    settings: dict = {"TRACEML_LOGS_DIR": logs, "TRACEML_REPORT": "0"}
    if traced and launcher != "init":
        settings.update(TRACEML="1", TRACEML_RUN_NAME="fault")
    env = clean_env(**settings, **LAUNCHERS[launcher], **extra)
    if launcher == "torchrun":
        command = torchrun_2(TINY)
    elif launcher in SCRIPT_OF:
        command = [PYTHON, SCRIPT_OF[launcher]]
    elif launcher == "rfdetr":
        env["RFD_WORKDIR"] = str(workdir / "work")
        command = [PYTHON, RFDETR_TRAIN]
    else:
        command = [PYTHON, TINY]
    result = run(command, env, workdir, timeout=300)
    shutil.rmtree(workdir / "work", ignore_errors=True)  # RF-DETR's checkpoints
    return Outcome(result.returncode, result.stdout, result.stderr, logs)


class Background:
    """Runs launched up front, JOBS at a time; ``get`` waits for one."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=JOBS)
        self.futures: dict[str, concurrent.futures.Future] = {}

    def submit(self, key: str, launcher: str, *, traced: bool, **extra) -> None:
        if key not in self.futures:
            workdir = self.root / re.sub(r"[^A-Za-z0-9_.-]", "_", key)
            self.futures[key] = self.pool.submit(launch, launcher, workdir, traced=traced, **extra)

    def get(self, key: str) -> Outcome:
        return self.futures[key].result()


def reference_key(launcher: str) -> str:
    return f"untraced-{REFERENCE[launcher]}"


def submit_entry(runs: Background, entry: str) -> None:
    launcher = SCENARIOS[entry].launcher
    if launcher in REFERENCE:
        runs.submit(reference_key(launcher), REFERENCE[launcher], traced=False)
    key, _, env = injection(entry)
    runs.submit(key, launcher, traced=True, **env)


def submit_write_failure(runs: Background, errno_name: str) -> None:
    runs.submit(reference_key("plain"), "plain", traced=False)
    # The header's write goes through; a run makes at least one more (the footer's), however
    # the sink batches its step records.
    runs.submit(f"write-{errno_name}", "plain", traced=True, TINY_FAIL_WRITE=f"{errno_name}:1")


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Start every run the selected tests need, the slowest first."""
    background = Background(tmp_path_factory.mktemp("faults"))
    selected = [item for item in request.session.items if item.module is request.module]
    entries = [
        item.callspec.params["entry"]
        for item in selected
        if hasattr(item, "callspec") and "entry" in item.callspec.params
    ]
    slow_first = {"rfdetr": 0, "torchrun": 1}
    for entry in sorted(entries, key=lambda e: slow_first.get(SCENARIOS[e].launcher, 2)):
        submit_entry(background, entry)
    for item in selected:
        if hasattr(item, "callspec") and "errno_name" in item.callspec.params:
            submit_write_failure(background, item.callspec.params["errno_name"])
    yield background
    background.pool.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------------------------
# Checks shared by every scenario


def read_rank_file(path: Path) -> list[dict]:
    """Every line must parse (a record cut by a crash would not)."""
    lines = path.read_bytes().splitlines()
    assert lines, f"{path} is empty"
    assert path.read_bytes().endswith(b"\n"), f"{path}: last line cut"
    return lines_as_written(path)


def assert_warned_once_per_process(
    outcome: Outcome, entry: str, processes: int, turned_off: str
) -> None:
    """One warning per process (each broke one entry point), exactly one naming ``entry``."""
    warnings = outcome.warnings()
    assert len(warnings) == processes, (warnings, outcome.describe())
    assert all(turned_off in line for line in warnings), warnings
    naming = [line for line in warnings if f"InjectedFault: fault injected into {entry})" in line]
    assert len(naming) == 1, warnings


# ----------------------------------------------------------------------------------------------
# The table is complete


def registered_entry_points() -> set[str]:
    """Every entry point traceml defines: entry points register themselves when their module
    is imported, so import every module of the package (an integration's module included)."""
    import importlib
    import pkgutil

    import traceml
    from traceml.capture.guard import ENTRY_POINTS

    for module in pkgutil.walk_packages(traceml.__path__, "traceml."):
        if not module.name.endswith("__main__"):  # that one runs the command line
            importlib.import_module(module.name)
    return set(ENTRY_POINTS)


def test_every_entry_point_has_a_scenario():
    registered = registered_entry_points()
    assert len(registered) >= 20  # the import above really found them
    assert set(SCENARIOS) == registered, {
        "registered without a scenario": sorted(registered - set(SCENARIOS)),
        "scenario for no entry point": sorted(set(SCENARIOS) - registered),
    }


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_every_lightning_hook_of_the_callback_is_an_entry_point(package):
    import importlib

    from traceml.capture.frameworks.lightning import StepTiming

    callback_api = importlib.import_module(package).Callback
    hooks = {
        name: member
        for name, member in vars(StepTiming).items()
        if inspect.isfunction(member)
        and (name in ("setup", "teardown") or name.startswith("on_"))
        and inspect.isfunction(getattr(callback_api, name, None))
    }
    # Sanity: the overrides the step timing depends on are found at all.
    assert {"setup", "on_train_start", "on_before_optimizer_step", "on_train_batch_end"} <= set(
        hooks
    )
    undecorated = sorted(
        name for name, hook in hooks.items() if not hasattr(hook, "traceml_entry_point")
    )
    assert undecorated == []
    registered = registered_entry_points()
    for hook in hooks.values():
        assert hook.traceml_entry_point in registered


# ----------------------------------------------------------------------------------------------
# One broken entry point at a time


@pytest.mark.parametrize("entry", sorted(SCENARIOS))
def test_a_broken_entry_point_never_changes_the_training(runs, entry):
    plan = SCENARIOS[entry]
    key, rank, _ = injection(entry)
    outcome = runs.get(key)
    assert outcome.returncode == plan.exit_code, outcome.describe()
    processes = 2 if plan.launcher == "torchrun" else 1
    assert_warned_once_per_process(outcome, entry, processes, plan.turned_off)

    if plan.launcher in REFERENCE:
        reference = runs.get(reference_key(plan.launcher))
        assert reference.returncode == plan.exit_code, reference.describe()
        assert reference.warnings() == []
        # Same global step, same weights bit for bit, on every rank.
        assert [step for step, _ in outcome.weights()] == [EXPECTED_STEP[plan.launcher]] * processes
        assert outcome.weights() == reference.weights()
    if plan.exit_code == 0:
        assert "Traceback" not in outcome.stderr, outcome.describe()
    else:
        # The user's exception reaches the user, with its traceback.
        assert "Traceback" in outcome.stderr
        assert f"failing on purpose at batch {RAISE_AFTER + 1}" in outcome.stderr

    files = outcome.rank_files()
    if plan.rank_file is None:
        assert files == [], files
        return
    assert [path.name for path in files] == [f"rank_{r}.jsonl" for r in range(processes)]
    for path in files:
        records = read_rank_file(path)
        assert records[0]["kind"] == "header"
        footer = records[-1]
        assert footer["kind"] == "footer"  # no scenario here kills the process
        assert footer["status"] == plan.rank_file
        assert footer["steps"] == sum(r["kind"] == "step" for r in records)
        if plan.rank_file == "completed":  # the fault stopped no step from being recorded
            assert footer["steps"] == EXPECTED_STEP[plan.launcher]
    if plan.rank_file == "disabled":
        records = read_rank_file(files[rank])
        assert any(
            r["kind"] == "event" and r.get("code") == "disabled" and entry in r["message"]
            for r in records
        ), records


# ----------------------------------------------------------------------------------------------
# The rank file's disk fails


@pytest.mark.parametrize("errno_name", sorted(WRITE_FAILURES))
def test_a_failing_disk_stops_tracing_not_training(runs, errno_name):
    outcome = runs.get(f"write-{errno_name}")
    reference = runs.get(reference_key("plain"))
    assert outcome.returncode == 0, outcome.describe()
    assert outcome.weights() == reference.weights()
    assert outcome.weights()[0][0] == STEPS
    warnings = outcome.warnings()
    assert len(warnings) == 1, warnings
    assert "cannot write" in warnings[0] and WRITE_FAILURES[errno_name] in warnings[0]
    [path] = outcome.rank_files()
    records = read_rank_file(path)
    # The header's write went through, whole; nothing after it. (Step records are batched by
    # traceml.capture.sink, so the failing write may have carried several: none is written.)
    assert [r["kind"] for r in records] == ["header"]


def test_deleting_the_logs_directory_mid_run_does_not_stop_training(tmp_path):
    logs = tmp_path / "logs"
    env = clean_env(
        TRACEML="1",
        TRACEML_LOGS_DIR=logs,
        TRACEML_RUN_NAME="gone",
        TRACEML_REPORT_WAIT_S=0,  # the report at exit: no other rank to wait for
        TINY_BATCHES=30,
        TINY_STEP_SLEEP_MS=20,
        TINY_VALIDATE=0,
    )
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    path = logs / "gone" / "ranks" / "rank_0.jsonl"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(
            [PYTHON, str(TINY)], env=env, cwd=tmp_path, stdout=stdout, stderr=stderr
        )
        try:
            deadline = time.monotonic() + 120
            while steps_written(path) < 3:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"no 3 steps written while training ran: {err.read_text()}")
                time.sleep(0.02)
            shutil.rmtree(logs)
            process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait(timeout=30)
    stderr_text = err.read_text()
    assert process.returncode == 0, stderr_text[-3000:]
    assert "TINY_RESULT global_step=30 " in out.read_text()
    assert "Traceback" not in stderr_text
    # The rank file's writes still succeed (the open file outlives its directory); the report
    # at exit finds no run directory, and says so once.
    warnings = [
        line
        for line in stderr_text.splitlines()
        if line.startswith("traceml:") and not ANNOUNCEMENT.match(line)
    ]
    assert len(warnings) == 1 and "final report" in warnings[0], warnings
    assert not logs.exists()  # nothing put the directory back
