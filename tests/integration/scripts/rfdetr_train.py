"""An ordinary RF-DETR script (no traceml import) at the smallest size that still trains.

RFD_MODE=train (default): train, then evaluate the trained model.
RFD_MODE=evaluate: only evaluate a fresh model (no training at all).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "integrations" / "rfdetr_minimal.py"
spec = importlib.util.spec_from_file_location("rfdetr_minimal", EXAMPLE)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def main() -> int:
    work = Path(os.environ.get("RFD_WORKDIR") or tempfile.mkdtemp())
    images = int(os.environ.get("RFD_TRAIN_IMAGES", "16"))
    dataset = example.make_demo_dataset(
        work / "dataset", seed=0, sizes={"train": images, "valid": 2, "test": 2}
    )
    if os.environ.get("LOOP_TIMER"):  # benchmarks/overhead.py only
        import loop_timer

        loop_timer.install("pytorch_lightning")
    from rfdetr import RFDETRNano

    model = RFDETRNano(pretrain_weights=None, num_queries=20, num_select=20, group_detr=1)
    common = dict(
        dataset_dir=str(dataset),
        output_dir=str(work / "out"),
        batch_size=2,
        num_workers=0,
        resolution=64,
        device="cpu",
    )
    if os.environ.get("RFD_MODE", "train") == "train":
        model.train(
            epochs=int(os.environ.get("RFD_EPOCHS", "1")),
            grad_accum_steps=int(os.environ.get("RFD_GRAD_ACCUM", "1")),
            run_test=bool(os.environ.get("RFD_RUN_TEST")),  # a test pass inside the fit's end
            multi_scale=False,
            tensorboard=False,
            **common,
        )
    if os.environ.get("RFD_SKIP_EVAL"):
        return 0
    metrics = model.evaluate(split="val", **common)
    print(f"RFD_DONE evaluated={bool(metrics)}")
    from rfdetr import training  # traced: traceml's wrapper armed, for a test to prove it

    print(f"RFD_TRAINER_WRAPPED {hasattr(training.build_trainer, '__wrapped__')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
