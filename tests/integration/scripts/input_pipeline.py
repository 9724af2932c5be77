"""A Lightning training with a per-sample dataset whose input costs the tests choose (IP_*).

Plain Lightning, no traceml import: run it with TRACEML=1. Each sample sleeps
IP_GETITEM_SLEEP_MS in __getitem__, each batch IP_COLLATE_SLEEP_MS in collate_fn, each step
IP_STEP_SLEEP_MS in training_step, each worker IP_WORKER_START_MS in worker_init_fn; workers
started with IP_MP_CONTEXT (fork, spawn, forkserver; the platform's default when unset).
"""

from __future__ import annotations

import importlib
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset, default_collate


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def env_s(name: str) -> float:
    return float(os.environ.get(name, "0")) / 1000.0


pl = importlib.import_module(os.environ.get("IP_PACKAGE", "lightning.pytorch"))
GETITEM_SLEEP = env_s("IP_GETITEM_SLEEP_MS")
COLLATE_SLEEP = env_s("IP_COLLATE_SLEEP_MS")
STEP_SLEEP = env_s("IP_STEP_SLEEP_MS")
WORKER_START = env_s("IP_WORKER_START_MS")


class Samples(Dataset):
    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        if GETITEM_SLEEP:
            time.sleep(GETITEM_SLEEP)
        generator = torch.Generator().manual_seed(index)
        return torch.randn(16, generator=generator), torch.randn(1, generator=generator)


def slow_collate(samples):
    if COLLATE_SLEEP:
        time.sleep(COLLATE_SLEEP)
    return default_collate(samples)


def worker_start(_worker_id: int) -> None:
    if WORKER_START:
        time.sleep(WORKER_START)


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        # What the user receives is exactly what their collate_fn made.
        assert type(batch) is list and x.shape[1] == 16, type(batch)
        if STEP_SLEEP:
            time.sleep(STEP_SLEEP)
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> int:
    torch.set_num_threads(1)
    batch_size = env_int("IP_BATCH_SIZE", 4)
    workers = env_int("IP_NUM_WORKERS", 0)
    loader = DataLoader(
        Samples(env_int("IP_BATCHES", 12) * batch_size),
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=slow_collate,
        persistent_workers=bool(env_int("IP_PERSISTENT", 0)) and workers > 0,
        worker_init_fn=worker_start if workers else None,
        multiprocessing_context=(os.environ.get("IP_MP_CONTEXT") or None) if workers else None,
    )
    trainer = pl.Trainer(
        max_epochs=env_int("IP_EPOCHS", 1),
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    dataset = loader.dataset
    trainer.fit(Module(), loader)
    # Everything traceml installed is gone again.
    assert type(dataset) is Samples and loader.collate_fn is slow_collate
    assert loader.worker_init_fn is (worker_start if workers else None)
    print(f"IP_RESULT global_step={trainer.global_step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
