"""TRACEML=1 on a real (tiny) Lightning training: what is recorded, and that it is right."""

from __future__ import annotations

import itertools
import signal
import subprocess
import time

import pytest

from traceml import schema
from traceml.analysis.reduce import reduce_run
from traceml.capture.rss import RSS_EVERY_NS

from procs import (
    PYTHON,
    SCRIPTS,
    TINY,
    clean_env,
    rank_records,
    run,
    steps_of,
    steps_written,
    tiny_result,
    traced_env,
    warning_lines,
)
from rankfiles import lines_as_written

SHAPES = SCRIPTS / "lightning_shapes.py"  # Lightning fits of unusual shapes, chosen by SHAPE


def traced(tmp_path, **tiny):
    settings = {
        "TRACEML": "1",
        "TRACEML_LOGS_DIR": tmp_path / "logs",
        "TRACEML_RUN_NAME": "t",
        "TRACEML_REPORT": "0",
    }
    env = clean_env(**{**settings, **tiny})
    result = run([PYTHON, TINY], env, tmp_path)
    return result, tmp_path / "logs" / "t"


def assert_adds_up(step):
    named = sum(step[p] for p in schema.PHASES if step[p] is not None)
    assert abs(named - step[schema.STEP]) < 0.001  # ms: within 1 microsecond
    assert step[schema.RESIDUAL] >= 0


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_one_record_per_optimizer_step_and_phases_add_up(tmp_path, package):
    # An evaluation after training (trainer.validate) adds no steps and no second footer.
    result, run_dir = traced(
        tmp_path, TINY_PACKAGE=package, TINY_BATCHES=10, TINY_EPOCHS=2, TINY_VALIDATE_AFTER=1
    )
    assert result.returncode == 0, result.stderr
    lightning = tiny_result(result.stdout)
    assert lightning["traceml_callbacks"] == 1
    # The step ends just before the module's on_train_batch_end: Lightning dispatches no
    # batch-end hook to traceml's callback.
    assert lightning["batch_end_dispatches"] == 0
    # Nothing left open by the traced fit (its procfs descriptor stayed: review, stop 60).
    assert lightning["fds_added"] == 0
    records = rank_records(run_dir)
    assert records[0]["kind"] == "header" and records[-1]["kind"] == "footer"
    assert records[-1]["status"] == "completed"
    assert [r["kind"] for r in records].count("footer") == 1
    steps = steps_of(records)
    # Sanity checks and validation (2 batches each epoch) add nothing.
    assert len(steps) == lightning["global_step"] == 20
    assert [s["global_step"] for s in steps] == list(range(1, 21))
    assert records[-1]["steps"] == 20
    # One process: no communication to time (distributed runs: test_distributed.py).
    assert records[0].get(schema.COMM_TIMING) is None
    for step in steps:
        assert step[schema.COMM] is None
        for fieldname in schema.TIMED_FIELDS:
            assert step[fieldname] is not None, fieldname
        for fieldname in (*schema.GPU_FIELDS, schema.MEM_PEAK_ALLOCATED, schema.MEM_PEAK_RESERVED):
            assert step[fieldname] is None  # CPU: unmeasured, never 0
        assert step[schema.RSS] is None or step[schema.RSS] > 10_000_000
        assert_adds_up(step)
    # RSS is read at most every RSS_EVERY_NS (50 ms): on these millisecond steps, the first
    # step's end and then at most one in every 50 ms.
    read = [s for s in steps if s[schema.RSS] is not None]
    assert read and read[0] is steps[0]
    ends = [s[schema.T_START_MS] + s[schema.STEP] for s in read]
    assert all(b - a >= RSS_EVERY_NS / 1e6 - 0.01 for a, b in itertools.pairwise(ends))
    assert len(read) < len(steps)
    # Validation ran between the epochs: it shows as a gap before epoch 1's first step.
    first_of_epoch_1 = next(s for s in steps if s["epoch"] == 1)
    assert first_of_epoch_1[schema.GAP_MS] > max(s[schema.GAP_MS] or 0 for s in steps[1:10])


def test_gradient_accumulation(tmp_path):
    result, run_dir = traced(tmp_path, TINY_BATCHES=7, TINY_ACCUM=2)
    assert result.returncode == 0, result.stderr
    steps = steps_of(rank_records(run_dir))
    assert len(steps) == tiny_result(result.stdout)["global_step"] == 4
    assert [s["microbatches"] for s in steps] == [2, 2, 2, 1]  # the last group is shorter
    for step in steps:
        assert_adds_up(step)


def test_trace_max_steps_records_the_first_steps_and_training_goes_on(tmp_path):
    # The script's own exit code (3, after training) passes through as well.
    result, run_dir = traced(tmp_path, TINY_BATCHES=12, TRACEML_TRACE_MAX_STEPS=2, TINY_EXIT_CODE=3)
    assert result.returncode == 3, result.stderr
    records = rank_records(run_dir)
    assert len(steps_of(records)) == 2
    assert tiny_result(result.stdout)["global_step"] == 12
    assert any(r.get("code") == "trace_max_steps_reached" for r in records)
    assert records[-1]["status"] == "completed" and records[-1]["steps"] == 2


# Counts, on the training thread, the calls into traceml's code between the training_step
# calls FROM and TO (numbered from 1): the steps a limit left untraced must run none of it.
LATE_CALLS_PROBE = """
import atexit, os, sys
FROM, TO = int(os.environ["PROBE_FROM"]), int(os.environ["PROBE_TO"])
steps, late = [0], {}
def profile(frame, event, arg):
    if event != "call":
        return
    code = frame.f_code
    if code.co_name == "training_step" and code.co_filename.endswith("tiny_lightning.py"):
        steps[0] += 1
    elif FROM <= steps[0] < TO and "/traceml/" in code.co_filename:
        where = code.co_filename.rsplit("/traceml/", 1)[1] + ":" + code.co_name
        late[where] = late.get(where, 0) + 1
sys.setprofile(profile)
atexit.register(lambda: print("LATE_CALLS", steps[0], sorted(late.items()), flush=True))
"""


@pytest.mark.parametrize("why", ["limit", "unsupported"])
def test_untraced_steps_run_none_of_traceml(tmp_path, why):
    # After a limit (seen by the flusher, every 250 ms: 20 ms steps reach it by step ~15), or
    # in a setup named unsupported (manual optimization), the steps from the 50th on must run
    # nothing of traceml's: no dispatch of a callback hook, no door, no timing collate_fn.
    hooks = tmp_path / "probe"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(LATE_CALLS_PROBE)
    reason = {"TRACEML_TRACE_MAX_STEPS": 2} if why == "limit" else {"TINY_MANUAL": 1}
    result, run_dir = traced(
        tmp_path,
        TINY_BATCHES=60,
        TINY_STEP_SLEEP_MS=20,
        TINY_VALIDATE=0,
        PYTHONPATH=hooks,
        PROBE_FROM=50,
        PROBE_TO=60,
        **reason,
    )
    assert result.returncode == 0, result.stderr
    assert len(steps_of(rank_records(run_dir))) == (2 if why == "limit" else 0)
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("LATE_CALLS")]
    assert line == "LATE_CALLS 60 []", line


def test_sigkill_keeps_every_completed_step(tmp_path):
    env = traced_env(
        tmp_path / "logs",
        "k",
        TINY_BATCHES=500,
        TINY_STEP_SLEEP_MS=30,
        TINY_VALIDATE=0,
    )
    process = subprocess.Popen(
        [PYTHON, str(TINY)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    path = tmp_path / "logs" / "k" / "ranks" / "rank_0.jsonl"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if steps_written(path) >= 5:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the traced run never wrote 5 steps")
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    records = lines_as_written(path)  # every line parses
    steps = steps_of(rank_records(tmp_path / "logs" / "k"))
    assert len(steps) >= 5
    assert [s[schema.STEP_INDEX] for s in steps] == list(range(len(steps)))
    assert records[-1]["kind"] == "step"  # no footer: the process never got to write one
    report = run(
        [PYTHON, "-m", "traceml", "report", tmp_path / "logs" / "k"], clean_env(), tmp_path
    )
    assert report.returncode == 0, report.stderr
    assert "no footer" in report.stdout


def break_method(tmp_path, module: str, method: str, when: str, error: str):
    """A directory for PYTHONPATH whose sitecustomize makes ``module``'s ``Class.method`` raise
    ``error`` whenever ``when`` holds, as a traceml bug would; it runs as usual otherwise."""
    hooks = tmp_path / "inject"
    hooks.mkdir()
    cls, name = method.split(".")
    (hooks / "sitecustomize.py").write_text(
        f"import {module} as m\n"
        f"original = m.{cls}.{name}\n"
        "def broken(self, *args):\n"
        f"    if {when}:\n"
        f"        raise {error}\n"
        "    return original(self, *args)\n"
        f"m.{cls}.{name} = broken\n"
    )
    return hooks


def test_a_broken_callback_disables_tracing_and_training_finishes(tmp_path):
    # A sitecustomize on the path breaks the clock where it counts the usual steps written as
    # rows, as a traceml bug would (every step after the first goes as rows on a single CPU
    # process: the break is found in the flusher's replay, the warning at the next step's end;
    # the first step, written one by one before it, is kept).
    hooks = break_method(
        tmp_path, "traceml.capture.step_clock", "StepClock.rows_closed",
        "True", "ValueError('injected failure')",
    )  # fmt: skip
    env = traced_env(
        tmp_path / "logs",
        "b",
        TINY_BATCHES=8,
        PYTHONPATH=hooks,
    )
    result = run([PYTHON, TINY], env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert tiny_result(result.stdout)["global_step"] == 8
    warnings = warning_lines(result.stderr)
    assert len(warnings) == 1
    assert "tracing disabled" in warnings[0] and "injected failure" in warnings[0]
    records = rank_records(tmp_path / "logs" / "b")
    assert len(steps_of(records)) == 1
    assert any(r.get("code") == "disabled" for r in records)
    assert records[-1]["status"] == "disabled"


def test_a_step_record_that_cannot_be_made_disables_tracing_with_a_note_and_a_footer(tmp_path):
    # The records are made on the sink's flusher thread (closed_step): a bug there drops that
    # record alone and turns tracing off with one warning, the note and the footer still
    # written; nothing reaches the training or prints a thread's traceback. (Two microbatches
    # a step: such steps are closed ones whose record the sink builds; the usual one-microbatch
    # step's record is made in the replay, test_a_broken_callback_disables_tracing...)
    hooks = break_method(
        tmp_path, "traceml.capture.closed_step", "ClosedStep.record",
        "self.index == 2", "ZeroDivisionError('injected into a record')",
    )  # fmt: skip
    env = traced_env(tmp_path / "logs", "r", TINY_BATCHES=16, TINY_ACCUM=2, PYTHONPATH=hooks)
    result = run([PYTHON, TINY], env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert tiny_result(result.stdout)["global_step"] == 8
    assert "Traceback" not in result.stderr, result.stderr
    warnings = warning_lines(result.stderr)
    assert len(warnings) == 1, warnings
    assert "tracing disabled: a step record could not be made" in warnings[0]
    assert "ZeroDivisionError: injected into a record" in warnings[0]
    records = rank_records(tmp_path / "logs" / "r")
    indexes = [s[schema.STEP_INDEX] for s in steps_of(records)]
    assert indexes[:2] == [0, 1] and 2 not in indexes
    assert any(r.get("code") == "disabled" for r in records)
    assert records[-1]["kind"] == "footer" and records[-1]["status"] == "disabled"


def test_unwritable_logs_dir_warns_and_trains(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the logs dir should be")
    result, _ = traced(tmp_path, TINY_BATCHES=4, TRACEML_LOGS_DIR=blocker / "logs")
    assert result.returncode == 0, result.stderr
    assert tiny_result(result.stdout)["global_step"] == 4
    warnings = warning_lines(result.stderr)
    assert len(warnings) == 1 and "cannot create" in warnings[0]


def test_direct_launch_prints_the_report_at_exit(tmp_path):
    env = clean_env(
        TRACEML="1", TRACEML_LOGS_DIR=tmp_path / "logs", TINY_BATCHES=14, TINY_VALIDATE=0
    )
    result = run([PYTHON, TINY], env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("Verdict:") == 1 and "Verdict:" not in result.stdout
    run_dir = next((tmp_path / "logs").iterdir())
    assert run_dir.name.startswith("tiny_lightning-")
    assert (run_dir / "final_summary.json").is_file()


def test_init_twice_gives_one_callback_and_conflicts_are_errors(tmp_path):
    env = clean_env(
        TRACEML_LOGS_DIR=tmp_path / "logs",
        TRACEML_REPORT="0",
        TINY_BATCHES=4,
        TINY_INIT="manual",
        TINY_INIT_CALLS=2,
    )
    result = run([PYTHON, TINY], env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert tiny_result(result.stdout)["traceml_callbacks"] == 1
    assert len(steps_of(rank_records(tmp_path / "logs" / "manual"))) == 4

    code = (
        "import traceml.capture.frameworks.rfdetr as t\n"
        "t.init(run_name='one')\n"
        "try:\n"
        "    t.init(run_name='two')\n"
        "except t.TraceMLConfigError as exc:\n"
        "    print('ERROR', exc)\n"
    )
    result = run([PYTHON, "-c", code], clean_env(TRACEML_LOGS_DIR=tmp_path), tmp_path)
    assert "ERROR traceml is already initialised with run_name='one' (asked 'two')" in (
        result.stdout
    )
    # Under an automatic launch the launch's configuration wins, with a warning.
    result = run([PYTHON, "-c", code], clean_env(TRACEML="1", TRACEML_RUN_NAME="launch"), tmp_path)
    assert "ERROR" not in result.stdout
    assert "traceml.init() ignored" in result.stderr


def test_init_takes_its_arguments_over_the_environment_and_warns_once(tmp_path):
    # (helper review) A bad TRACEML_* value warned twice when the script also called init();
    # init(run_name=...) lost to a bad TRACEML_RUN_NAME; TRACEML=0 did not turn init() off;
    # init(trace_max_steps=2.7) was cut to 2.
    code = (
        "import traceml\n"
        "from traceml.capture import bootstrap\n"
        "import numpy\n"
        "traceml.init(run_name='chosen', trace_max_steps=numpy.int64(5))  # an integer: fine\n"
        "s = bootstrap.active_settings()\n"
        "print('NAME', s and s.run_name)\n"
        "for bad in ({'trace_max_steps': 2.7}, {'run_name': 5}, {'logs_dir': ''}):\n"
        "    try:\n"
        "        traceml.init(**bad)\n"
        "    except ValueError as exc:\n"
        "        print('REFUSED', exc)\n"
    )
    bad_name = {"TRACEML_RUN_NAME": "../bad", "TRACEML_LOGS_DIR": tmp_path / "logs"}
    result = run([PYTHON, "-c", code], clean_env(**bad_name), tmp_path)
    assert "NAME chosen" in result.stdout and warning_lines(result.stderr) == [], result.stderr
    assert result.stdout.count("REFUSED") == 3, result.stdout
    result = run([PYTHON, "-c", code], clean_env(TRACEML="1", **bad_name), tmp_path)
    assert "NAME None" in result.stdout
    assert len(warning_lines(result.stderr)) == 1, result.stderr  # the start-up's, once
    for off in ("0", "off"):  # the start-up hook's rule for TRACEML, init() too
        result = run([PYTHON, "-c", code], clean_env(TRACEML=off, **bad_name), tmp_path)
        assert "NAME None" in result.stdout and warning_lines(result.stderr) == []


def test_unsupported_setup_is_named_and_trains_natively(tmp_path):
    result, run_dir = traced(tmp_path, TINY_BATCHES=5, TINY_MANUAL="1")
    assert result.returncode == 0, result.stderr
    assert tiny_result(result.stdout)["global_step"] == 5
    warnings = warning_lines(result.stderr)
    assert warnings == [
        "traceml: not tracing: manual optimization (automatic_optimization=False) is not "
        "supported; training runs natively"
    ]
    records = rank_records(run_dir)
    assert steps_of(records) == []
    assert records[-1]["status"] == "unsupported"
    report = run([PYTHON, "-m", "traceml", "report", run_dir], clean_env(), tmp_path)
    assert report.returncode == 0
    assert "NOT-TRACED" in report.stdout and "manual optimization" in report.stdout


COMPILED_IN_PLACE = """
import os
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
HOW = os.environ["HOW"]

class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        layers = torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        self.model = torch.nn.Sequential(*layers)
        if HOW == "in_place":
            self.model.compile(backend="eager", fullgraph=True)  # nn.Module.compile: in place

    def on_train_start(self):
        if HOW == "train_start":  # after traceml's door went on the network
            self.model.compile(backend="eager", fullgraph=True)

    def training_step(self, batch, idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

data = DataLoader(TensorDataset(torch.randn(32, 16), torch.randn(32, 1)), batch_size=8)
trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
module = Module()
if HOW == "fit":  # Lightning's own path: it compiles training_step and forward
    trainer.fit(torch.compile(module, backend="eager", fullgraph=True), data)
else:
    trainer.fit(module, data)
print("RESULT", trainer.global_step, module.model[0].weight.detach().sum().item())
print("GRAPH_BREAKS", torch._dynamo.utils.counters["graph_break"].total())
"""


@pytest.mark.parametrize("how", ["in_place", "fit", "train_start"])
def test_a_network_compiled_in_place_is_named_and_trains_as_untraced(tmp_path, how):
    # Module.compile(fullgraph=True) compiles the forward as the module's attribute finds it:
    # with traceml's door there, its clock read broke the graph and the user's fit raised
    # (torch._dynamo Unsupported). Now it is named, as torch.compile(model) is; so is
    # trainer.fit(torch.compile(module)), which was traced with graph breaks at the door (and
    # other weights under bf16-mixed), and a compile after the door went on (on_train_start)
    # calls through it rather than raise (helper review).
    script = tmp_path / "compiled.py"
    script.write_text(COMPILED_IN_PLACE)
    untraced = run([PYTHON, script], clean_env(HOW=how), tmp_path)
    assert untraced.returncode == 0, untraced.stderr
    result = run([PYTHON, script], traced_env(tmp_path, "compiled", HOW=how), tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == untraced.stdout  # the weights, and no graph break of traceml's
    assert "RESULT 4 " in result.stdout and "GRAPH_BREAKS 0" in result.stdout
    named = [
        "traceml: not tracing: torch.compile (and the CUDA graphs it may capture) is not "
        "supported; training runs natively"
    ]
    assert warning_lines(result.stderr) == (named if how != "train_start" else [])
    if how == "train_start":  # traced, the compiled forward through its door untimed
        assert len(steps_of(rank_records(tmp_path / "compiled"))) == 4


FAKE_CUDA = """
import time
import traceml.capture.frameworks.lightning as L
from traceml.capture.cuda_timing import CudaStepTimer

class LaggingEvent:
    # Completes 3 ms after it was recorded, like a device running behind the host.
    def record(self):
        self.t = time.perf_counter()
    def query(self):
        return time.perf_counter() - self.t > 0.003
    def synchronize(self):
        pass
    def elapsed_time(self, end):
        return (end.t - self.t) * 1000.0

def fake_device_timer(self, pl_module):
    return CudaStepTimer(
        new_event=LaggingEvent,
        peak_allocated=lambda: 1000,
        peak_reserved=lambda: 2000,
    )

L.StepTiming._device_timer = fake_device_timer
"""


@pytest.mark.parametrize("max_steps", [None, 3])
def test_cuda_event_path_with_a_lagging_fake_device(tmp_path, max_steps):
    # CI has no GPU: the callback's CUDA path runs here against events that complete late.
    hooks = tmp_path / "inject"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(FAKE_CUDA)
    extra = {"TRACEML_TRACE_MAX_STEPS": max_steps} if max_steps else {}
    result, run_dir = traced(tmp_path, TINY_BATCHES=10, PYTHONPATH=hooks, **extra)
    assert result.returncode == 0, result.stderr
    steps = steps_of(rank_records(run_dir))
    assert len(steps) == (max_steps or 10)
    assert [s["step"] for s in steps] == list(range(len(steps)))
    for step in steps:
        for fieldname in (
            schema.GPU_H2D,
            schema.GPU_FORWARD,
            schema.GPU_BACKWARD,
            schema.GPU_OPTIMIZER,
            schema.GPU_STEP,
        ):
            assert step[fieldname] is not None and step[fieldname] >= 0
        assert step[schema.GPU_STEP] >= step[schema.GPU_FORWARD] + step[schema.GPU_BACKWARD]
        assert step[schema.MEM_PEAK_ALLOCATED] == 1000
        assert step[schema.MEM_PEAK_RESERVED] == 2000
        assert_adds_up(step)


SUBMODULE_NETWORK = """
import os, sys, time
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Slow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, x):
        time.sleep(0.02)
        return self.layer(x)


class Metric(torch.nn.Module):
    __module__ = "torchmetrics.image.fake"

    def __init__(self):
        super().__init__()
        self.inception = torch.nn.Linear(64, 64)


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Slow()  # no forward of its own: training_step calls self.net(x)
        if os.environ.get("SECOND"):
            self.head = torch.nn.Linear(1, 1)
        if os.environ.get("METRIC"):  # a metric's own network, larger (torchmetrics' FID)
            self.metric = Metric()

    def training_step(self, batch, _index):
        x, y = batch
        out = self.net(x)
        if os.environ.get("SECOND"):
            out = self.head(out)
        return torch.nn.functional.mse_loss(out, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


data = TensorDataset(torch.randn(24, 8), torch.randn(24, 1))
trainer = pl.Trainer(
    max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
)
trainer.fit(Module(), DataLoader(data, batch_size=4))
print("STEPS", trainer.global_step)
"""


@pytest.mark.parametrize(("second", "metric"), [("", ""), ("1", ""), ("", "1")])
def test_a_network_in_a_submodule_called_directly_is_forward(tmp_path, second, metric):
    # `self.net(x)` in training_step, the LightningModule defining no forward: traceml timed
    # the LightningModule's forward, which never ran: Forward null on every step, its 20 ms in
    # Residual, and a RESIDUAL-HEAVY verdict with no word of why.
    script = tmp_path / "submodule.py"
    script.write_text(SUBMODULE_NETWORK)
    env = traced_env(tmp_path / "logs", "sub", SECOND=second, METRIC=metric)
    result = run([PYTHON, script], env, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STEPS 6" in result.stdout
    records = rank_records(tmp_path / "logs" / "sub")
    steps = steps_of(records)
    assert len(steps) == 6
    for step in steps[1:]:
        assert 19.0 <= step[schema.FORWARD] <= 40.0, step
        assert_adds_up(step)
    notes = [r["message"] for r in records if r["kind"] == "event"]
    named = [n for n in notes if n.startswith("Forward is self.net's forward")]
    assert len(named) == (1 if second else 0), notes
    if second:
        assert "self.head count as Residual" in named[0]


@pytest.mark.parametrize("device", ["cpu", "fake_cuda"])
def test_a_batch_fetched_and_never_trained_on_is_no_step(tmp_path, device):
    # on_train_batch_start returning -1 ends the epoch after that batch's fetch: the fetch
    # alone was written as a step (0.1 ms, its optimizer "did not step"), two extra steps here
    # in the statistics and steps/s. With CUDA events, dropping it left the device step open:
    # the next step's gpu_step_ms spanned the epoch's end (a review of that fix).
    extra = {"SHAPE": "cut_short"}
    if device == "fake_cuda":
        (tmp_path / "inject").mkdir()
        (tmp_path / "inject" / "sitecustomize.py").write_text(FAKE_CUDA)
        extra["PYTHONPATH"] = tmp_path / "inject"
    result = run([PYTHON, SHAPES], traced_env(tmp_path / "logs", "cut", **extra), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STEPS 8" in result.stdout
    steps = steps_of(rank_records(tmp_path / "logs" / "cut"))
    assert [s[schema.GLOBAL_STEP] for s in steps] == list(range(1, 9))
    assert all(s.get(schema.OPTIMIZER_STEPPED, True) for s in steps)
    if device == "fake_cuda":  # the fake device's events are on the host's clock
        assert all(s[schema.GPU_STEP] <= s[schema.STEP] + 5.0 for s in steps), steps


@pytest.mark.parametrize(
    ("device", "shape", "kept"),
    [
        ("cpu", "callback_raises", 6),
        ("fake_cuda", "callback_raises", 6),
        ("cpu", "optimizer_step_raises", 5),
    ],
)
def test_a_step_whose_callback_raised_after_its_optimizer_step_is_kept(
    tmp_path, device, shape, kept
):
    # A callback's on_train_batch_end raised after the sixth optimizer step: the step ends
    # only at the module's own hook, after every callback, so the open step was dropped and the
    # file said "failed after 5 steps" for 6 updates made (helper review, stop 60). Not kept
    # where Lightning did not count the step (its global step would repeat the fifth's).
    extra = {"SHAPE": shape}
    if device == "fake_cuda":  # the guarded doors' path (CUDA events), not one-door timing
        (tmp_path / "inject").mkdir()
        (tmp_path / "inject" / "sitecustomize.py").write_text(FAKE_CUDA)
        extra["PYTHONPATH"] = tmp_path / "inject"
    result = run([PYTHON, SHAPES], traced_env(tmp_path / "logs", "cb", **extra), tmp_path)
    assert result.returncode == 1 and "STEPPED 6" in result.stdout, result.stderr[-3000:]
    assert "RuntimeError: callback failed at the sixth step's end" in result.stderr
    records = rank_records(tmp_path / "logs" / "cb")
    steps = steps_of(records)
    assert [s[schema.GLOBAL_STEP] for s in steps] == list(range(1, kept + 1))
    assert records[-1]["status"] == "exception" and records[-1]["steps"] == kept
    assert_adds_up(steps[-1])


def test_validation_inside_an_accumulation_window_is_not_the_steps_residual(tmp_path):
    # val_check_interval=2 with 4 microbatches a step: each validation (60 ms) ran between two
    # microbatches of an open step and was its Residual (steps of ~70 ms for ~10).
    env = traced_env(tmp_path / "logs", "mid", SHAPE="mid_window")
    result = run([PYTHON, SHAPES], env, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STEPS 4" in result.stdout
    steps = steps_of(rank_records(tmp_path / "logs" / "mid"))
    assert [s[schema.MICROBATCHES] for s in steps] == [4, 4, 4, 4]
    for step in steps[1:]:
        assert step[schema.RESIDUAL] < 40.0, step  # one 60 ms validation was inside each
        assert step[schema.GAP_MS] >= 55.0, step  # ... and is the gap before the step now
        assert_adds_up(step)


def test_a_window_stopped_before_its_optimizer_step_is_not_a_step(tmp_path):
    # A validation inside the third window stopped the fit (2 optimizer steps): the window
    # left was reported as a third step (3 of 3 steps for global_step 2), and, shifted by
    # the validation, as shorter than its phases ("overlapping phase hooks", Residual 0).
    env = traced_env(tmp_path / "logs", "stopped", SHAPE="stopped_mid_window")
    result = run([PYTHON, SHAPES], env, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STEPS 2" in result.stdout
    run_dir = tmp_path / "logs" / "stopped"
    records = rank_records(run_dir)
    steps = steps_of(records)
    assert [s.get(schema.OPTIMIZER_STEPPED, True) for s in steps] == [True, True, False]
    assert steps[-1][schema.RESIDUAL] > 0 and steps[-1][schema.MICROBATCHES] == 1, steps[-1]
    assert_adds_up(steps[-1])
    events = [r.get("message", "") for r in records if r["kind"] == "event"]
    assert not any("overlapping" in message for message in events), events
    summary = reduce_run(run_dir)
    assert summary[schema.SUMMARY_STEPS_RECORDED] == 2, summary
    assert any("1 microbatch window(s) ended without" in n for n in summary["notes"])


def test_a_test_pass_inside_the_fits_end_leaves_it_completed(tmp_path):
    # on_fit_end running trainer.test() (RF-DETR's run_test=True) made Lightning tear the fit
    # down as stage "test": the session stayed open, the exit handler wrote "interrupted",
    # and traceml's callback stayed in trainer.callbacks after the fit.
    env = traced_env(tmp_path / "logs", "tested", SHAPE="test_at_fit_end")
    result = run([PYTHON, SHAPES], env, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STEPS 4" in result.stdout
    plain = run([PYTHON, SHAPES], clean_env(SHAPE="test_at_fit_end"), tmp_path)
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("CALLBACKS")]
    assert line in plain.stdout.splitlines()  # the trainer's callbacks as untraced
    records = rank_records(tmp_path / "logs" / "tested")
    assert records[-1]["status"] == "completed" and len(steps_of(records)) == 4


def test_the_set_up_is_no_steps_own_cost(tmp_path):
    # traceml's set-up (the fit's setup and on_train_start hooks: ~40 ms) was the first step's
    # traceml_us: a one-step run (fast_dev_run) reported traceml's cost as 10x its step.
    result, run_dir = traced(tmp_path, TINY_BATCHES=1, TINY_VALIDATE=0)
    assert result.returncode == 0, result.stderr
    (only,) = steps_of(rank_records(run_dir))
    assert only[schema.TRACEML_COST_US] < only[schema.STEP] * 1000, only  # a part of the step
