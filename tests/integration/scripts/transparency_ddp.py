"""Ordinary distributed user code on a real Lightning DDP training (2 gloo ranks under
torchrun), each rank's outcomes printed as JSON (issue 20): the same traced as untraced.

* The user registers their own DDP communication hook in ``on_train_start`` (Lightning's
  ``ddp_comm_hook=`` only does it on CUDA): it must be accepted and be the hook that runs.
* ``training_step`` launches async collectives and uses the handle: ``isinstance``,
  ``wait``, ``get_future``, ``is_completed``, ``exception``.
* A second fit registers its hook in ``on_fit_start`` (after the first fit left).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from dicts_probe import dicts_made
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import DataLoader, Dataset

outcome: dict[str, object] = {}
hook_calls = {"on_train_start": 0, "on_fit_start": 0}


class Points(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(32, 4, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index]


def counting_hook(where: str):
    def hook(state, bucket):
        hook_calls[where] += 1
        return allreduce_hook(state, bucket)

    return hook


class Net(pl.LightningModule):
    def __init__(self, hook_at: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.hook_at = hook_at

    def _register(self, where: str) -> None:
        if self.hook_at == where:
            try:
                self.trainer.strategy.model.register_comm_hook(None, counting_hook(where))
                outcome[f"register.{where}"] = "ok"
            except Exception as exc:
                outcome[f"register.{where}"] = f"raised {type(exc).__name__}: {exc}"

    def on_fit_start(self) -> None:
        self._register("on_fit_start")

    def on_train_start(self) -> None:
        self._register("on_train_start")

    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and self.hook_at == "on_train_start":
            self._async_collectives()
        return self.layer(batch).pow(2).mean()

    def _async_collectives(self) -> None:
        tensor = torch.ones(3) * (dist.get_rank() + 1)
        work = dist.all_reduce(tensor, async_op=True)
        outcome["async.isinstance_work"] = isinstance(work, dist.Work)
        outcome["async.type"] = type(work).__qualname__
        outcome["async.wait"] = work.wait()
        outcome["async.is_completed"] = work.is_completed()
        outcome["async.exception"] = repr(work.exception()) if hasattr(work, "exception") else None
        outcome["async.tensor"] = tensor.tolist()
        other = torch.ones(2)
        future = dist.all_reduce(other, async_op=True).get_future()
        outcome["async.future_value"] = [t.tolist() for t in future.wait()]
        gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
        handle = dist.all_gather(gathered, torch.tensor([float(dist.get_rank())]), async_op=True)
        handle.wait()
        outcome["async.all_gather"] = [t.tolist() for t in gathered]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def weights(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def fit(hook_at: str) -> None:
    model = Net(hook_at)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_train_batches=4,
    )
    trainer.fit(model, DataLoader(Points(), batch_size=4))
    outcome[f"{hook_at}.global_step"] = trainer.global_step
    outcome[f"{hook_at}.weights"] = weights(model)
    if hook_at == "on_fit_start":  # the last fit's trainer, strategy and model still alive
        outcome["dicts.made"] = dicts_made()


if __name__ == "__main__":
    fit("on_train_start")
    fit("on_fit_start")
    outcome["hook_calls"] = hook_calls
    outcome["threads_left"] = sorted(
        t.name for t in threading.enumerate() if t is not threading.main_thread()
    )
    rank = os.environ.get("RANK", "0")
    # A file per rank: two ranks printing to one pipe can interleave their lines.
    out = os.path.join(os.environ.get("TR_OUT", "."), f"outcome-rank{rank}.json")
    with open(out, "w") as file:
        json.dump(outcome, file, sort_keys=True)
    # Tear the process group down before exit, traced and untraced alike: left to interpreter
    # shutdown, gloo's threads sometimes abort the process ("terminate called without an active
    # exception"), an exit code that is neither run's doing.
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
