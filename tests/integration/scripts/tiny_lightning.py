"""A tiny Lightning training whose costs the tests choose through TINY_* variables.

Plain Lightning, no traceml import: the tests run it with TRACEML=1, under `traceml run`, or
under torchrun, and check what traceml recorded against what this script did.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def env_ms(name: str) -> float:
    return float(os.environ.get(name, "0")) / 1000.0


PACKAGE = os.environ.get("TINY_PACKAGE", "lightning.pytorch")
pl = importlib.import_module(PACKAGE)
if os.environ.get("LOOP_TIMER"):  # benchmarks/overhead.py only
    import loop_timer

    loop_timer.install(PACKAGE)

BATCHES = env_int("TINY_BATCHES", 12)
FETCH_SLEEP = env_ms("TINY_FETCH_SLEEP_MS")
FORWARD_SLEEP = env_ms("TINY_FORWARD_SLEEP_MS")
OPTIMIZER_SLEEP = env_ms("TINY_OPTIMIZER_SLEEP_MS")
# Every rank: this long more in backward (a gradient hook on the output) and in the batch
# transfer (on_after_batch_transfer, which traceml counts as H2D).
BACKWARD_SLEEP = env_ms("TINY_BACKWARD_SLEEP_MS")
TRANSFER_SLEEP = env_ms("TINY_TRANSFER_SLEEP_MS")
STEP_SLEEP = env_ms("TINY_STEP_SLEEP_MS")
RAISE_AFTER = env_int("TINY_RAISE_AFTER", -1)
SLOW_RANK = env_int("TINY_SLOW_RANK", -1)
# Where the slow rank's TINY_SLOW_RANK_EXTRA_MS goes: fetch (default), forward or backward.
SLOW_WHERE = os.environ.get("TINY_SLOW_WHERE", "fetch")
# Every rank: a DDP communication hook that sleeps this long per bucket, then all-reduces.
COMM_DELAY = env_ms("TINY_COMM_DELAY_MS")


def slow_here(where: str) -> float:
    if SLOW_RANK >= 0 and where == SLOW_WHERE and int(os.environ.get("RANK", "0")) == SLOW_RANK:
        return env_ms("TINY_SLOW_RANK_EXTRA_MS")
    return 0.0


class Batches(Dataset):
    """Each item is a whole batch (batch_size=None), so a sleep here is the per-batch fetch."""

    def __init__(self, count: int, sleep: float) -> None:
        self.count, self.sleep = count, sleep

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        sleep = self.sleep + slow_here("fetch")
        if sleep:
            time.sleep(sleep)
        generator = torch.Generator().manual_seed(index)
        return torch.randn(8, 16, generator=generator), torch.randn(8, 1, generator=generator)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def forward(self, x):
        extra = slow_here("forward") if torch.is_grad_enabled() else 0.0
        if FORWARD_SLEEP or extra:
            time.sleep(FORWARD_SLEEP + extra)
        out = self.layers(x)
        backward_extra = BACKWARD_SLEEP + slow_here("backward")
        if backward_extra and out.requires_grad:
            out.register_hook(lambda grad: (time.sleep(backward_extra), grad)[1])
        return out


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Net()
        self.seen = 0
        if os.environ.get("TINY_MANUAL"):
            self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        self.seen += 1
        if RAISE_AFTER >= 0 and self.seen > RAISE_AFTER:
            raise RuntimeError(f"tiny_lightning: failing on purpose at batch {self.seen}")
        if STEP_SLEEP:
            time.sleep(STEP_SLEEP)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def on_after_batch_transfer(self, batch, dataloader_idx):
        if TRANSFER_SLEEP and self.trainer.training:
            time.sleep(TRANSFER_SLEEP)
        return batch

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.model(x), y))

    def configure_optimizers(self):
        return SleepySGD(self.parameters(), lr=0.01)


class SleepySGD(torch.optim.SGD):
    """SGD whose update takes TINY_OPTIMIZER_SLEEP_MS longer (after the closure has run)."""

    def step(self, closure=None):
        loss = super().step(closure)
        if OPTIMIZER_SLEEP:
            time.sleep(OPTIMIZER_SLEEP)
        return loss


def install_slow_comm_hook() -> None:
    """Register a sleeping all-reduce hook on every DDP model built from now on (the user's
    own hook, as far as traceml is concerned)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    def slow_network(state, bucket):
        time.sleep(COMM_DELAY)
        return allreduce_hook(state, bucket)

    original_init = DistributedDataParallel.__init__

    def init_with_hook(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.register_comm_hook(None, slow_network)

    DistributedDataParallel.__init__ = init_with_hook


def main() -> int:
    torch.set_num_threads(1)
    if os.environ.get("TINY_INIT"):
        import traceml.integrations.rfdetr as traceml_init

        for _ in range(env_int("TINY_INIT_CALLS", 1)):
            traceml_init.init(run_name=os.environ["TINY_INIT"])
    layout = {}
    world = env_int("WORLD_SIZE", 1)
    if world > 1:
        local = env_int("LOCAL_WORLD_SIZE", world)
        layout = {"devices": local, "num_nodes": world // local, "strategy": "ddp"}
    if COMM_DELAY:
        install_slow_comm_hook()
    validate = env_int("TINY_VALIDATE", 1)
    trainer = pl.Trainer(
        max_epochs=env_int("TINY_EPOCHS", 1),
        accelerator="cpu",
        accumulate_grad_batches=env_int("TINY_ACCUM", 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=2 if validate else 0,
        limit_val_batches=2 if validate else 0,
        **layout,
    )
    workers = env_int("TINY_NUM_WORKERS", 0)
    train = DataLoader(Batches(BATCHES, FETCH_SLEEP), batch_size=None, num_workers=workers)
    val = DataLoader(Batches(4, 0.0), batch_size=None)
    module = Module()
    trainer.fit(module, train, val if validate else None)
    if os.environ.get("TINY_VALIDATE_AFTER"):
        trainer.validate(module, val, verbose=False)
    # Tear the process group down before exit: left to interpreter shutdown, gloo's threads
    # sometimes abort the process ("terminate called without an active exception").
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    callbacks = [
        type(cb).__name__ for cb in trainer.callbacks if "StepCallback" in type(cb).__name__
    ]
    print(f"TINY_RESULT global_step={trainer.global_step} traceml_callbacks={len(callbacks)}")
    return env_int("TINY_EXIT_CODE", 0)


if __name__ == "__main__":
    sys.exit(main())
