"""Lightning fits of unusual shapes, one chosen by SHAPE; plain Lightning, no traceml import.

- ``cut_short``: ``on_train_batch_start`` returns -1 at the fifth batch (Lightning ends the
  epoch after that fetch), and each epoch's end sleeps 100 ms; 2 epochs, 8 steps.
- ``mid_window``: 4 microbatches a step and a 60 ms validation every 2 batches, so each one
  runs inside an open step; 4 steps.
- ``reloading``: the DataLoader (2 workers) made anew each epoch; a callback prints how many
  child processes are alive at each epoch's start.
- ``callback_raises``: a callback's ``on_train_batch_end`` raises at the sixth step, after
  its optimizer step (the script prints the global step, then exits 1 with the traceback).
- ``optimizer_step_raises``: the module's ``optimizer_step`` raises at the sixth step, after
  the optimizer's step returned (Lightning counts 5 steps).
- ``test_at_fit_end``: a callback's ``on_fit_end`` runs ``trainer.test`` (as RF-DETR's
  ``run_test=True`` does); prints the callbacks' types after the fit.
- ``stopped_mid_window``: 3 microbatches a step; a validation after the seventh batch (the
  first microbatch of the third window) stops the fit (``should_stop``): 2 optimizer steps.
"""

from __future__ import annotations

import os
import time

import lightning.pytorch as pl
import psutil
import torch
from torch.utils.data import DataLoader, TensorDataset

SHAPE = os.environ["SHAPE"]


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, _index):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def on_train_batch_start(self, batch, index):
        if SHAPE == "cut_short" and index == 4:
            return -1  # Lightning: skip the rest of this epoch
        return None

    def on_train_epoch_end(self) -> None:
        if SHAPE == "cut_short":
            time.sleep(0.1)  # a checkpoint, a log flush: between steps

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Validating(Module):
    def validation_step(self, batch, _index) -> None:
        time.sleep(0.03)


class Reloading(Module):
    def train_dataloader(self):
        return DataLoader(points(4), batch_size=4, num_workers=2)


class CountChildren(pl.Callback):  # runs before traceml's own hook, as the user's callbacks do
    def on_train_epoch_start(self, trainer, pl_module) -> None:
        alive = len(psutil.Process().children(recursive=True))
        print("EPOCH", trainer.current_epoch, "CHILDREN", alive, flush=True)


class RaiseAfterStepping(Module):
    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.trainer.global_step == 5:  # Lightning counts this step once the hook returns
            print("STEPPED", self.trainer.global_step + 1, flush=True)
            raise RuntimeError("callback failed at the sixth step's end")


class RaiseAtBatchEnd(pl.Callback):  # a checkpoint or logging callback that fails
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, index) -> None:
        if trainer.global_step == 6:
            print("STEPPED", trainer.global_step, flush=True)
            raise RuntimeError("callback failed at the sixth step's end")


class Testing(Module):
    def test_step(self, batch, _index) -> None:
        pass


class TestAtFitEnd(pl.Callback):
    def on_fit_end(self, trainer, pl_module) -> None:
        trainer.test(pl_module, DataLoader(points(2), 4), verbose=False)


class StopAfterValidation(pl.Callback):  # early stopping, as EarlyStopping decides it
    def on_validation_end(self, trainer, pl_module) -> None:
        trainer.should_stop = True


def points(batches: int) -> TensorDataset:
    return TensorDataset(torch.randn(4 * batches, 4), torch.randn(4 * batches, 1))


QUIET = dict(
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)

if __name__ == "__main__":
    if SHAPE == "cut_short":
        trainer = pl.Trainer(max_epochs=2, limit_val_batches=0, **QUIET)
        trainer.fit(Module(), DataLoader(points(9), batch_size=4))
    elif SHAPE == "mid_window":
        trainer = pl.Trainer(
            max_epochs=1,
            num_sanity_val_steps=0,
            accumulate_grad_batches=4,
            val_check_interval=2,
            limit_val_batches=2,
            **QUIET,
        )
        trainer.fit(Validating(), DataLoader(points(16), 4), DataLoader(points(2), 4))
    elif SHAPE == "reloading":
        trainer = pl.Trainer(
            max_epochs=3,
            limit_val_batches=0,
            reload_dataloaders_every_n_epochs=1,
            callbacks=[CountChildren()],
            **QUIET,
        )
        trainer.fit(Reloading())
    elif SHAPE == "callback_raises":
        trainer = pl.Trainer(
            max_epochs=1, limit_val_batches=0, callbacks=[RaiseAtBatchEnd()], **QUIET
        )
        trainer.fit(Module(), DataLoader(points(9), batch_size=4))
    elif SHAPE == "optimizer_step_raises":
        trainer = pl.Trainer(max_epochs=1, limit_val_batches=0, **QUIET)
        trainer.fit(RaiseAfterStepping(), DataLoader(points(9), batch_size=4))
    elif SHAPE == "test_at_fit_end":
        trainer = pl.Trainer(max_epochs=1, limit_val_batches=0, callbacks=[TestAtFitEnd()], **QUIET)
        trainer.fit(Testing(), DataLoader(points(4), batch_size=4))
        print("CALLBACKS", sorted(type(c).__name__ for c in trainer.callbacks))
    elif SHAPE == "stopped_mid_window":
        trainer = pl.Trainer(
            max_epochs=1,
            num_sanity_val_steps=0,
            accumulate_grad_batches=3,
            val_check_interval=7,
            limit_val_batches=2,
            callbacks=[StopAfterValidation()],
            **QUIET,
        )
        trainer.fit(Validating(), DataLoader(points(12), 4), DataLoader(points(2), 4))
    else:
        raise SystemExit(f"unknown SHAPE {SHAPE!r}")
    print("STEPS", trainer.global_step)
