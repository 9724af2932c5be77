"""Ordinary user operations on a real Lightning training, each one's outcome printed as JSON.

Plain Lightning, no traceml import: tests/integration/test_transparency.py runs it untraced
and with TRACEML=1 and compares the two JSON lines, which must be identical (issue 20). Each
process traces its first fit only, so TR_CASE picks which training comes first:

* ``main``: forkserver training workers, spawn validation workers over a Subset of the training
  dataset, gradient checkpointing in forward; pickle / deepcopy / torch.save of the dataset,
  collate_fn, DataLoader, model and callback during and after fit; validate / test / predict
  after fit; a second fit; set_start_method after fit; a checkpoint saved to TR_OUT.
* ``gan``: manual optimization with two optimizers (GAN style).
* ``resume``: fit resumed from the checkpoint TR_RESUME_FROM (saved by the other mode).
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import io
import json
import multiprocessing
import os
import pickle
import typing

import lightning.pytorch as pl
import torch
from dicts_probe import dicts_made, threads_left
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset

CASE = os.environ.get("TR_CASE", "main")
OUT = os.environ.get("TR_OUT", ".")
outcome: dict[str, object] = {}


class Points(Dataset):
    def __init__(self, count: int = 16) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(count, 4, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


def collate(items):
    xs, ys = zip(*items, strict=True)
    return torch.stack(xs), torch.stack(ys)


class Remember(pl.Callback):
    """The user's own callback: it only counts."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1


def describe(value) -> str:
    """A stable description of what an operation gave back (or raised)."""
    if isinstance(value, BaseException):
        return f"raised {type(value).__name__}"
    if isinstance(value, torch.Tensor):
        return f"tensor {value.tolist()}"
    return f"{type(value).__module__}.{type(value).__qualname__}"


def attempt(name: str, operation) -> None:
    try:
        outcome[name] = describe(operation())
    except Exception as exc:  # the outcome is what matters, raised or not
        outcome[name] = describe(exc)


def round_trips(prefix: str, objects: dict[str, object]) -> None:
    for label, obj in objects.items():
        attempt(f"{prefix}.pickle.{label}", lambda obj=obj: pickle.loads(pickle.dumps(obj)))
        attempt(f"{prefix}.deepcopy.{label}", lambda obj=obj: copy.deepcopy(obj))

        def saved(obj=obj, label=label):
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            data = buffer.getvalue()
            outcome[f"{prefix}.traceml_in_saved.{label}"] = b"traceml" in data
            if b"traceml" in data:  # for whoever reads a failure: what mentions it
                at = data.index(b"traceml")
                print(f"TR_TRACEML_IN {label}: {data[max(0, at - 80) : at + 80]!r}", flush=True)
            return torch.load(io.BytesIO(data), weights_only=False)

        attempt(f"{prefix}.torch_save.{label}", saved)


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
        self.head = torch.nn.Linear(8, 1)
        self.during: dict[str, object] = {}

    def forward(self, x):
        # Gradient checkpointing: the inner block runs again during backward.
        return self.head(checkpoint(self.inner, x, use_reentrant=False))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == 2 and CASE == "main":
            trainer = self.trainer
            loader = trainer.train_dataloader
            round_trips(
                "during",
                {
                    "dataset": loader.dataset,
                    "collate_fn": loader.collate_fn,
                    "loader": loader,
                    "model": self,
                    "callback": next(c for c in trainer.callbacks if isinstance(c, Remember)),
                },
            )
            outcome["during.types"] = [type(loader).__name__, type(loader.dataset).__name__]
            outcome["during.collate_is_users"] = loader.collate_fn is collate
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Body(torch.nn.Module):
    """The model inside a LightningModule (``self.model``: the module whose forward traceml
    times), one that TorchScript can compile."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class WithModel(Net):
    """The ``dicts`` cases' module: at its second batch, what code sees of the two methods
    traceml times while traced (the model's ``forward``, the module's ``on_train_batch_end``)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Body()
        self.batch_ends = 0

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            method_outcomes(self)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.batch_ends += 1


def method_outcomes(module: pl.LightningModule) -> None:
    for label, owner, name in (
        ("model.forward", module.model, "forward"),
        ("module.on_train_batch_end", module, "on_train_batch_end"),
    ):
        bound = getattr(owner, name)
        outcome[f"methods.{label}.method"] = [
            type(bound).__name__,
            inspect.ismethod(bound),
            bound.__self__ is owner,
            bound.__func__ is getattr(type(owner), name),
            bound.__name__,
            bound == getattr(owner, name),
            sorted(typing.get_type_hints(bound)),
        ]
        attempt(f"methods.{label}.pickle", lambda f=bound: pickle.loads(pickle.dumps(f)))
        outcome[f"methods.{label}.source"] = inspect.getsource(bound).splitlines()[0].strip()
        outcome[f"methods.{label}.signature"] = str(inspect.signature(bound))
    ones = torch.ones(2, 4)
    attempt("methods.jit_script", lambda: torch.jit.script(module.model)(ones).detach())
    attempt("methods.to_torchscript", lambda: module.to_torchscript()(ones).detach())


class Gan(pl.LightningModule):
    """Manual optimization, two optimizers: a generator and a discriminator."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = torch.nn.Linear(4, 4)
        self.discriminator = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        real, _ = batch
        g_opt, d_opt = self.optimizers()
        fake = self.generator(real)
        d_loss = self.discriminator(fake.detach()).mean() - self.discriminator(real).mean()
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        g_loss = -self.discriminator(fake).mean()
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()

    def configure_optimizers(self):
        return (
            torch.optim.SGD(self.generator.parameters(), lr=0.01),
            torch.optim.Adam(self.discriminator.parameters(), lr=0.01),
        )


def trainer(epochs: int = 1, callbacks=()) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=epochs,
        num_sanity_val_steps=0,  # each spawned validation worker costs an interpreter start
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=OUT,
        callbacks=list(callbacks),
    )


def weights(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def floats(metrics) -> list:
    return [{key: float(value) for key, value in sorted(m.items())} for m in metrics]


def main_case() -> None:
    dataset = Points()
    train = DataLoader(
        dataset,
        batch_size=4,
        collate_fn=collate,
        num_workers=1,
        multiprocessing_context="forkserver",
    )
    # Validation over the training dataset itself, spawned workers (they unpickle it).
    val = DataLoader(
        Subset(dataset, range(8)),
        batch_size=4,
        collate_fn=collate,
        num_workers=1,
        multiprocessing_context="spawn",
    )
    model, callback = Net(), Remember()
    fit = trainer(callbacks=[callback])
    fit.fit(model, train, val)
    outcome["fit.global_step"] = fit.global_step
    outcome["fit.weights"] = weights(model)
    outcome["fit.callback_batches"] = callback.batches
    outcome["after.types"] = [type(train).__name__, type(dataset).__name__]
    outcome["after.loader_attributes"] = [
        train.collate_fn is collate,
        train.worker_init_fn is None,
    ]
    round_trips(
        "after",
        {
            "dataset": dataset,
            "collate_fn": collate,
            "loader": train,
            "model": model,
            "callback": callback,
        },
    )
    outcome["after.callbacks.types"] = [type(c).__name__ for c in fit.callbacks]
    attempt("after.callbacks.pickle", lambda: len(pickle.loads(pickle.dumps(fit.callbacks))))
    held_out = DataLoader(Subset(dataset, range(8)), batch_size=4, collate_fn=collate)
    outcome["after.validate"] = floats(fit.validate(model, held_out, verbose=False))
    outcome["after.test"] = floats(fit.test(model, held_out, verbose=False))
    outcome["after.predict"] = [p.tolist() for p in fit.predict(model, held_out)]
    path = os.path.join(OUT, "model.ckpt")
    fit.save_checkpoint(path)
    with open(path, "rb") as file:
        outcome["checkpoint.mentions_traceml"] = b"traceml" in file.read()
    second = trainer()
    second.fit(Net(), DataLoader(dataset, batch_size=4, collate_fn=collate))
    outcome["second_fit.global_step"] = second.global_step
    attempt("after.set_start_method", lambda: multiprocessing.set_start_method("spawn"))
    outcome["after.start_method"] = multiprocessing.get_start_method(allow_none=True)


def gan_case() -> None:
    model = Gan()
    fit = trainer(epochs=2)
    fit.fit(model, DataLoader(Points(), batch_size=4, collate_fn=collate))
    outcome["gan.global_step"] = fit.global_step
    outcome["gan.weights"] = weights(model)


def dicts_case(workers: int = 0) -> None:
    """A plain fit, then what has a ``__dict__`` made: the main case's round trips (deepcopy
    and pickle read ``__dict__``) make one on everything they reach, untraced too. Batches come
    from this process (``dicts``) or from a forked worker (``dicts_workers``): input timing
    changes different objects in the two."""
    fit = trainer()
    loader = DataLoader(Points(), batch_size=4, collate_fn=collate, num_workers=workers)
    fit.fit(WithModel(), loader)
    outcome["dicts.made"] = dicts_made()


def resume_case() -> None:
    model = Net()
    fit = trainer(epochs=2)
    fit.fit(
        model,
        DataLoader(Points(), batch_size=4, collate_fn=collate),
        ckpt_path=os.environ["TR_RESUME_FROM"],
    )
    outcome["resume.global_step"] = fit.global_step
    outcome["resume.epoch"] = fit.current_epoch
    outcome["resume.weights"] = weights(model)


if __name__ == "__main__":
    {
        "main": main_case,
        "gan": gan_case,
        "resume": resume_case,
        "dicts": dicts_case,
        "dicts_workers": lambda: dicts_case(workers=1),
    }[CASE]()
    outcome["threads_left"] = threads_left()
    print("TR_OUTCOME " + json.dumps(outcome, sort_keys=True), flush=True)
