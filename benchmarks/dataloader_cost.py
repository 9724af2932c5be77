"""traceml's cost per sample inside the DataLoader (issue 16 target: <= 5 us per sample).

Iterates a dataset that does nothing, with and without traceml's worker-side timing, in the
main process (num_workers=0: the same code a worker runs), best of 5; prints us per sample.

    .venv/bin/python benchmarks/dataloader_cost.py [samples] [batch_size]
"""

from __future__ import annotations

import sys
import time

from torch.utils.data import DataLoader, Dataset

from traceml.capture.instruments import dataloader


class Nothing(Dataset):
    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        return index


class Owner:
    def _entry_failed(self, name: str, exc: BaseException) -> None:
        raise SystemExit(f"{name} failed: {exc!r}")


def best_of(loader: DataLoader, tries: int = 5) -> float:
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        for _batch in loader:
            pass
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    samples = int(sys.argv[1]) if len(sys.argv) > 1 else 50_000
    batch_size = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    plain = best_of(DataLoader(Nothing(samples), batch_size=batch_size, collate_fn=list))
    loader = DataLoader(Nothing(samples), batch_size=batch_size, collate_fn=list)
    timing, reason = dataloader.install_input_timing(loader, Owner())
    assert timing is not None, reason
    timed = best_of(loader)
    timing.uninstall()
    print(
        f"samples={samples} batch_size={batch_size} plain={plain / samples * 1e6:.2f} us/sample "
        f"timed={timed / samples * 1e6:.2f} us/sample "
        f"cost={(timed - plain) / samples * 1e6:.2f} us/sample"
    )


if __name__ == "__main__":
    main()
