"""Hand-written loops that a review found mis-measured, one chosen by VARIANT (known sleeps:
a batch's fetch FETCH_MS, the model's forward 10 ms):

- ``scaler_two``: one AMP GradScaler for two optimizers (torch.amp's recipe), whose steps
  sleep 15 ms (the first, whose step ends traceml's step) and 25 ms;
- ``second_model``: 4 steps of one model, then 4 of a new model and optimizer;
- ``source_switch``: an epoch of a DataLoader, then an epoch of a Python generator;
- ``lbfgs_probe``: an L-BFGS loop that calls its closure once before ``step(closure)``;
- ``user_hooks``: the user's forward pre-hook (20 ms) and post-hook (35 ms) on the model;
  ROOT=own (the model's own class) or ROOT=sequential (``nn.Sequential``);
- ``fetch_ahead``: a loop that fetches the next batch before training on the current one
  (Accelerate's loader does), 2 DataLoader workers; prints ``RAN_OUT_MS <ms>``, the time of
  the ``next()`` that raised StopIteration (the workers' shutdown); EPOCHS epochs (1),
  PERSISTENT=1 with persistent workers, each batch trained on REPEAT times (1).

Prints ``VARIANT_DONE``.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

VARIANT = os.environ["VARIANT"]
FETCH_S = float(os.environ.get("FETCH_MS", "0")) / 1000.0


class Samples(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        if FETCH_S:
            time.sleep(FETCH_S)
        return torch.full((8,), float(index)), torch.ones(1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, x):
        time.sleep(0.01)
        return self.linear(x)


class Sleep(nn.Module):
    def forward(self, x):
        time.sleep(0.01)
        return x


def slow(optimizer_class, seconds: float):
    class Slow(optimizer_class):
        def step(self, *args, **kwargs):
            time.sleep(seconds)
            return super().step(*args, **kwargs)

    return Slow


def loader(**kwargs) -> DataLoader:
    return DataLoader(Samples(), batch_size=2, **kwargs)


def train(model, optimizer, batches) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def scaler_two() -> None:
    model = Net()
    first = slow(torch.optim.SGD, 0.015)([model.linear.weight], lr=0.01)
    second = slow(torch.optim.SGD, 0.025)([model.linear.bias], lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(2):
        for x, y in loader():
            first.zero_grad()
            second.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            scaler.step(first)
            scaler.step(second)
            scaler.update()
    print("SCALE", scaler.get_scale())


def second_model() -> None:
    for _ in range(2):
        model = Net()
        train(model, torch.optim.SGD(model.parameters(), lr=0.01), loader())


def source_switch() -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train(model, optimizer, loader())
    generated = ((torch.randn(2, 8), torch.ones(2, 1)) for _ in range(4))
    train(model, optimizer, generated)


def lbfgs_probe() -> None:
    model = Net()
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=2)
    for x, y in loader():

        def closure(x=x, y=y):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        print("LOSS", float(closure()))  # logged before the step
        optimizer.step(closure)


def user_hooks() -> None:
    model = Net() if os.environ["ROOT"] == "own" else nn.Sequential(Sleep(), nn.Linear(8, 1))
    model.register_forward_pre_hook(lambda module, args: time.sleep(0.02))
    model.register_forward_hook(lambda module, args, output: time.sleep(0.035))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        train(model, optimizer, loader())


def fetch_ahead() -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    persistent = os.environ.get("PERSISTENT") == "1"
    batches = loader(num_workers=2, persistent_workers=persistent)
    for _ in range(int(os.environ.get("EPOCHS", "1"))):
        iterator = iter(batches)
        upcoming = next(iterator)
        while upcoming is not None:
            batch = upcoming
            start = time.perf_counter()
            try:
                upcoming = next(iterator)
            except StopIteration:
                upcoming = None
                print("RAN_OUT_MS", (time.perf_counter() - start) * 1000.0, flush=True)
            train(model, optimizer, [batch] * int(os.environ.get("REPEAT", "1")))


if __name__ == "__main__":
    globals()[VARIANT]()
    print("VARIANT_DONE", flush=True)
