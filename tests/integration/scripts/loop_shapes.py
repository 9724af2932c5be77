"""A hand-written loop in the shapes that confused the any-loop capture's attribution:

* two DataLoaders zipped, the slow one first (both waits are the step's Input Wait);
* a frozen teacher called in eval mode on the batch before the student (the fetch is still the
  student's Input Wait, and no "not a DataLoader" note);
* a loss module with no parameters called after the model, sleeping SHAPES_LOSS_MS (Residual,
  not Forward, as the loss is with Lightning);
* SHAPES_EPOCHS epochs over a loader with persistent workers (one iterator object for every
  epoch) and an odd number of batches with 2 microbatches a step: a microbatch is left without
  an optimizer step at each epoch's end;
* a validation of SHAPES_VALIDATION_MS after each epoch, in eval mode (the next step's gap; not
  in the leftover microbatch's record);
* in the first epoch, after its first optimizer step, an evaluation over the training
  DataLoader object itself (a new pass over it, taken by no training forward: no epoch turns,
  and its fetches are no step's Input Wait).

Prints ``SHAPES_RESULT steps=<optimizer steps>``.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

BATCH, BATCHES, ACCUM = 2, 5, 2


def env_ms(name: str) -> float:
    return float(os.environ.get(name, 0)) / 1000.0


class Samples(Dataset):
    def __init__(self, sleep_s: float) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(BATCH * BATCHES, 8, generator=generator)
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.x[index]


class Sleeping(nn.Module):
    def __init__(self, sleep_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)
        self.sleep_s = sleep_s

    def forward(self, x):
        time.sleep(self.sleep_s)
        return self.linear(x)


class SlowLoss(nn.Module):
    """A criterion of the user's own: a module with no parameters."""

    def forward(self, prediction, target):
        time.sleep(env_ms("SHAPES_LOSS_MS"))
        return ((prediction - target) ** 2).mean()


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    slow = DataLoader(Samples(env_ms("SHAPES_GETITEM_MS")), batch_size=BATCH)
    fast = DataLoader(Samples(0.0), batch_size=BATCH, num_workers=1, persistent_workers=True)
    student = Sleeping(env_ms("SHAPES_FORWARD_MS"))
    teacher = Sleeping(0.0).eval().requires_grad_(False)
    validator = Sleeping(env_ms("SHAPES_VALIDATION_MS"))
    optimizer = torch.optim.SGD(student.parameters(), lr=0.01)
    loss_fn = SlowLoss()
    stepped = 0
    for _epoch in range(int(os.environ.get("SHAPES_EPOCHS", 3))):
        for index, (a, b) in enumerate(zip(slow, fast, strict=False)):
            with torch.no_grad():
                target = teacher(a + b)
            loss = loss_fn(student(a + b), target) / ACCUM
            loss.backward()
            if (index + 1) % ACCUM == 0:
                optimizer.step()
                optimizer.zero_grad()
                stepped += 1
            if _epoch == 0 and index == 1:
                with torch.no_grad():
                    for seen in slow:
                        teacher(seen)
        validator.eval()
        with torch.no_grad():
            validator(torch.zeros(1, 8))
        optimizer.zero_grad()  # the leftover microbatch's gradients, as a loop would drop them
    print(f"SHAPES_RESULT steps={stepped}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
