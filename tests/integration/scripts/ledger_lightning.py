"""A Lightning training that keeps its own ledger of finished steps, for the crash-bound test.

Plain Lightning, no traceml import (the test runs it with TRACEML=1). After every training
batch the module appends ``<batch index> <CLOCK_MONOTONIC ns>`` to LEDGER_PATH with one
unbuffered write. The module's ``on_train_batch_end`` runs after every callback's (Lightning
calls callbacks first), so a step in the ledger has been handed to traceml already. It trains
until it is killed (LEDGER_BATCHES, default 1,000,000 batches of LEDGER_STEP_MS each).
"""

from __future__ import annotations

import os
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

STEP_S = float(os.environ.get("LEDGER_STEP_MS", "2")) / 1000.0


class Module(pl.LightningModule):
    def __init__(self, ledger_fd: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.ledger_fd = ledger_fd

    def training_step(self, batch, batch_idx):
        time.sleep(STEP_S)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        os.write(self.ledger_fd, f"{batch_idx} {time.monotonic_ns()}\n".encode())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    torch.set_num_threads(1)
    batches = int(os.environ.get("LEDGER_BATCHES", "1000000"))
    ledger_fd = os.open(os.environ["LEDGER_PATH"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    data = TensorDataset(torch.ones(batches, 4), torch.ones(batches, 1))
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(Module(ledger_fd), DataLoader(data, batch_size=None))


if __name__ == "__main__":
    main()
