"""RF-DETR Nano under torchrun (gloo, CPU) with a known cost injected on one rank.

An ordinary RF-DETR training otherwise: no traceml import. The injections stand for what makes
one rank of a real job slow, and for a slow interconnect:

    RFD_SLOW_RANK=1 RFD_SLOW_WHERE=dataset  RFD_SLOW_MS=150   per image, in the dataset
    RFD_SLOW_RANK=1 RFD_SLOW_WHERE=forward  RFD_SLOW_MS=300   per training forward
    RFD_SLOW_RANK=1 RFD_SLOW_WHERE=backward RFD_SLOW_MS=300   inside autograd (a tensor hook)
    RFD_COMM_DELAY_MS=40   every rank: a DDP communication hook that sleeps, then all-reduces
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "integrations" / "rfdetr_minimal.py"
spec = importlib.util.spec_from_file_location("rfdetr_minimal", EXAMPLE)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

RANK = int(os.environ.get("RANK", "0"))
SLOW = int(os.environ.get("RFD_SLOW_RANK", "-1")) == RANK
WHERE = os.environ.get("RFD_SLOW_WHERE", "")
SLOW_S = float(os.environ.get("RFD_SLOW_MS", "0")) / 1000.0
COMM_DELAY_S = float(os.environ.get("RFD_COMM_DELAY_MS", "0")) / 1000.0


def inject() -> None:
    if SLOW and WHERE == "dataset":
        from rfdetr.datasets.coco import CocoDetection

        original_getitem = CocoDetection.__getitem__

        def slow_getitem(self, index):
            time.sleep(SLOW_S)
            return original_getitem(self, index)

        CocoDetection.__getitem__ = slow_getitem
    if SLOW and WHERE in ("forward", "backward"):
        from rfdetr.models.lwdetr import LWDETR

        original_forward = LWDETR.forward

        def slow_forward(self, *args, **kwargs):
            training = self.training and torch.is_grad_enabled()
            if training and WHERE == "forward":
                time.sleep(SLOW_S)
            out = original_forward(self, *args, **kwargs)
            if training and WHERE == "backward":
                # Fires when autograd reaches the logits: the first thing backward does.
                out["pred_logits"].register_hook(lambda grad: (time.sleep(SLOW_S), grad)[1])
            return out

        LWDETR.forward = slow_forward
    if COMM_DELAY_S:
        from slow_network import install_slow_comm_hook

        install_slow_comm_hook(COMM_DELAY_S)


def main() -> int:
    torch.set_num_threads(1)
    inject()
    work = Path(os.environ.get("RFD_WORKDIR") or tempfile.mkdtemp()) / f"rank{RANK}"
    images = int(os.environ.get("RFD_TRAIN_IMAGES", "56"))
    dataset = example.make_demo_dataset(
        work / "dataset", seed=0, sizes={"train": images, "valid": 2, "test": 2}
    )
    from rfdetr import RFDETRNano

    # RFD_FREEZE_ENCODER=1: gradients (and DDP's all-reduce) only for the decoder, so the two
    # ranks' gloo threads steal less of this 2-core machine from the compute.
    frozen = {"freeze_encoder": True} if os.environ.get("RFD_FREEZE_ENCODER") else {}
    model = RFDETRNano(pretrain_weights=None, num_queries=20, num_select=20, group_detr=1, **frozen)
    try:
        model.train(
            dataset_dir=str(dataset),
            output_dir=str(work / "out"),
            epochs=1,
            batch_size=2,
            grad_accum_steps=1,
            num_workers=0,
            resolution=64,
            device="cpu",
            multi_scale=False,
            tensorboard=False,
            **example.distributed_layout(),
        )
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    print("RFD_DDP_DONE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
