"""An ordinary RF-DETR training (no traceml import) with a slower dataset, for issue 16's
input-pipeline attribution: each sample's __getitem__ sleeps RFI_GETITEM_SLEEP_MS more (the
stand-in for a slow decode or augmentation), with RFI_NUM_WORKERS DataLoader workers."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "integrations" / "rfdetr_minimal.py"
spec = importlib.util.spec_from_file_location("rfdetr_minimal", EXAMPLE)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def slow_down_the_dataset(sleep_s: float) -> None:
    from rfdetr.datasets.coco import CocoDetection

    original = CocoDetection.__getitem__

    def slow_getitem(self, idx):
        time.sleep(sleep_s)
        return original(self, idx)

    CocoDetection.__getitem__ = slow_getitem


def main() -> int:
    work = Path(os.environ.get("RFD_WORKDIR") or tempfile.mkdtemp())
    dataset = example.make_demo_dataset(
        work / "dataset", seed=0, sizes={"train": 16, "valid": 2, "test": 2}
    )
    slow_down_the_dataset(float(os.environ.get("RFI_GETITEM_SLEEP_MS", "0")) / 1000.0)
    from rfdetr import RFDETRNano

    model = RFDETRNano(pretrain_weights=None, num_queries=20, num_select=20, group_detr=1)
    model.train(
        dataset_dir=str(dataset),
        output_dir=str(work / "out"),
        batch_size=2,
        num_workers=int(os.environ.get("RFI_NUM_WORKERS", "0")),
        resolution=64,
        device="cpu",
        epochs=1,
        grad_accum_steps=1,
        multi_scale=False,
        tensorboard=False,
    )
    print("RFI_DONE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
