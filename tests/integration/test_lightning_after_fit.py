"""What a Lightning script can do with its objects after a traced fit, as untraced (rule 1):
the fit's trainer, model, dataset and loader are freed once the script drops them (the exit
handler held the session, and through it all of them, until the process ended); trainer.fit
pickles (a spawned process's target); a batch sampler that yields iterators trains (the input
breakdown called len() on them and raised into the fit); the trainer's callbacks after the fit
are the script's alone, and a second fit of the same trainer trains untraced. In an interactive
session (a notebook, ``python -i``) the report comes at the fit's end, not at the exit."""

from __future__ import annotations

import json
import subprocess

from procs import PYTHON, clean_env, run, steps_written, traced_env

SCRIPT = """
import gc, json, pickle, weakref, warnings
warnings.filterwarnings("ignore")
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset, Sampler


class Points(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        return torch.randn(4, generator=generator), torch.randn(1, generator=generator)


class IteratorBatches(Sampler):  # each batch an iterator of indices, not a list
    def __len__(self):
        return 4

    def __iter__(self):
        for start in range(0, 16, 4):
            yield iter(range(start, start + 4))


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
model, dataset = Net(), Points()
loader = DataLoader(dataset, batch_sampler=IteratorBatches())
trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, loader)
outcome = {"global_step": trainer.global_step,
           "weights": [round(float(p.sum()), 6) for p in model.parameters()]}
for name, target in (("trainer.fit", trainer.fit), ("Trainer.fit", pl.Trainer.fit)):
    try:
        outcome[f"pickle {name}"] = type(pickle.loads(pickle.dumps(target))).__name__
    except Exception as exc:
        outcome[f"pickle {name}"] = type(exc).__name__
outcome["callbacks"] = sorted(type(c).__name__ for c in trainer.callbacks)
outcome["callbacks pickle"] = len(pickle.loads(pickle.dumps(trainer.callbacks)))
trainer.fit_loop.max_epochs = 3  # the same trainer fits again: one epoch more
trainer.fit(model, loader)
outcome["second global_step"] = trainer.global_step
held = {name: weakref.ref(value) for name, value in
        (("model", model), ("dataset", dataset), ("loader", loader), ("trainer", trainer))}
del model, dataset, loader, trainer
gc.collect()
outcome["freed"] = {name: ref() is None for name, ref in held.items()}
print("OUTCOME " + json.dumps(outcome, sort_keys=True), flush=True)
"""


def outcome_of(result) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [x for x in result.stdout.splitlines() if x.startswith("OUTCOME ")]
    return json.loads(line[len("OUTCOME ") :])


def test_after_a_traced_fit_the_scripts_objects_are_as_untraced(tmp_path):
    script = tmp_path / "after_fit.py"
    script.write_text(SCRIPT)
    untraced = outcome_of(run([PYTHON, script], clean_env(), tmp_path))
    traced_run = run([PYTHON, script], traced_env(tmp_path / "logs", "after"), tmp_path)
    traced = outcome_of(traced_run)
    assert untraced["global_step"] == 8
    assert untraced["freed"] == {"model": True, "dataset": True, "loader": True, "trainer": True}
    assert untraced["pickle trainer.fit"] == "method"
    assert untraced["pickle Trainer.fit"] == "function"
    assert untraced["second global_step"] == 12
    assert traced == untraced
    assert "tracing disabled" not in traced_run.stderr  # traced, not turned off on the way
    # The second fit is a second training: untraced, said once; the file holds the first's.
    assert "a second training in this process is not traced" in traced_run.stderr
    assert steps_written(tmp_path / "logs" / "after" / "ranks" / "rank_0.jsonl") == 8


# What a notebook's kernel does to sys.stderr (ipykernel's OutStream): it shows what is
# written to the stream, while the stream's fileno() is the terminal that started the kernel
# (here: /dev/null, so that what is written there is lost as a notebook's user loses it).
KERNEL_STDERR = """
import io, os, sys
class CellOutput(io.TextIOBase):
    def writable(self):
        return True
    def write(self, text):
        sys.__stdout__.write(text.replace("traceml report =", "[cell] traceml report ="))
        return len(text)
    def fileno(self):
        return os.open(os.devnull, os.O_WRONLY)

sys.stderr = CellOutput()
"""


def test_an_interactive_session_gets_its_report_when_the_fit_ends(tmp_path):
    # A notebook's kernel (here: the REPL reading its input from a pipe) may not exit for hours:
    # the report at exit came only then. It comes as the fit returns now, once, in the cell.
    (tmp_path / "after_fit.py").write_text(SCRIPT)
    env = traced_env(tmp_path / "logs", "repl")
    env["TRACEML_REPORT"] = "1"
    typed = KERNEL_STDERR + 'exec(open("after_fit.py").read())\nprint("BACK AT THE PROMPT")\n'
    result = subprocess.run(
        [PYTHON, "-u", "-i"], input=typed, env=env, cwd=tmp_path, timeout=300,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    out = result.stdout
    assert out.count("traceml report ====") == 1, out[-3000:]
    assert out.count("[cell] traceml report ====") == 1
    assert "traceml: repl (completed; 1 rank" in out
    assert out.index("traceml report ====") < out.index("BACK AT THE PROMPT")
    assert (tmp_path / "logs" / "repl" / "final_summary.json").is_file()


def test_a_ctrl_c_during_the_interactive_report_is_the_users(tmp_path):
    # The report runs inside the user's fit call in a notebook: a Ctrl-C there was swallowed
    # (one line), and the rest of the cell ran on (review of this stop's diff).
    (tmp_path / "after_fit.py").write_text(SCRIPT)
    env = traced_env(tmp_path / "logs", "repl")
    env["TRACEML_REPORT"] = "1"
    ctrl_c = (
        "import sys\n"
        "def tracer(frame, event, arg):\n"
        "    if event == 'call' and frame.f_code.co_name == 'communicate':\n"
        "        sys.settrace(None)\n"
        "        raise KeyboardInterrupt  # Ctrl-C while the report child runs\n"
        "\n"
    )
    typed = ctrl_c + 'sys.settrace(tracer); exec(open("after_fit.py").read()); print("NEXT")\n'
    result = subprocess.run(
        [PYTHON, "-u", "-i"], input=typed, env=env, cwd=tmp_path, timeout=300,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    out = result.stdout
    assert "traceml: could not write the final report: interrupted (Ctrl-C)" in out, out[-3000:]
    assert "NEXT\n" not in out  # the cell stopped there
    assert "KeyboardInterrupt" in out
