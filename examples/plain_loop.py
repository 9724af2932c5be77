"""A plain PyTorch training loop, traced with no code change. Runs on CPU in a few seconds.

    traceml run examples/plain_loop.py            # or: TRACEML=1 python examples/plain_loop.py

The dataset sleeps a little in ``__getitem__`` (a slow input pipeline), so the report names
Input Wait. What traceml measures here, and what not: docs/any_pytorch.md.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowSamples(Dataset):
    """Random regression samples, each taking ``delay_ms`` to "load"."""

    def __init__(self, count: int, delay_ms: float) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(count, 32, generator=generator)
        self.y = torch.randn(count, 1, generator=generator)
        self.delay_s = delay_ms / 1000.0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        time.sleep(self.delay_s)
        return self.x[index], self.y[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--delay-ms", type=float, default=1.0, help="per sample, in __getitem__")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(SlowSamples(args.steps * args.batch_size, args.delay_ms), args.batch_size)
    val_loader = DataLoader(SlowSamples(64, 0.0), batch_size=args.batch_size)

    for step, (x, y) in enumerate(loader, start=1):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if step % 20 == 0:  # validation between steps: not counted inside any step
            model.eval()
            with torch.no_grad():
                val = sum(nn.functional.mse_loss(model(x), y).item() for x, y in val_loader)
            model.train()
            print(f"step {step}: train loss {loss.item():.3f}, val loss {val:.3f}")


if __name__ == "__main__":
    main()
