"""Ordinary RF-DETR user operations, each one's outcome printed as JSON (issue 20): train,
look at the checkpoints it wrote, export the trained model, resume training from a checkpoint
(TR_RESUME_FROM, written by the traced run). Run untraced and with TRACEML=1 by
tests/integration/test_transparency.py; the two JSON lines must be identical.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "integrations" / "rfdetr_minimal.py"
spec = importlib.util.spec_from_file_location("rfdetr_minimal", EXAMPLE)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

WORK = Path(os.environ.get("TR_OUT", "."))
outcome: dict[str, object] = {}


def describe(value) -> str:
    if isinstance(value, BaseException):
        return f"raised {type(value).__name__}"
    return f"{type(value).__module__}.{type(value).__qualname__}"


def checkpoints(directory: Path) -> dict[str, object]:
    """Each checkpoint's name, whether it mentions traceml, and its epoch / global_step."""
    found = {}
    for path in sorted(directory.glob("*.ckpt")) + sorted(directory.glob("*.pth")):
        data = path.read_bytes()
        state = torch.load(path, map_location="cpu", weights_only=False)
        found[path.name] = {
            "mentions_traceml": b"traceml" in data,
            "epoch": state.get("epoch"),
            "global_step": state.get("global_step"),
        }
    return found


def drop(directory: Path, keep: Path | None = None) -> None:
    """Delete the checkpoints once read: each is 0.1-0.4 GB, and a CI machine's disk is small."""
    for path in list(directory.glob("*.ckpt")) + list(directory.glob("*.pth")):
        if path != keep:
            path.unlink()


def main() -> None:
    from rfdetr import RFDETRNano

    dataset = example.make_demo_dataset(
        WORK / "dataset", seed=0, sizes={"train": 8, "valid": 2, "test": 2}
    )
    common = dict(
        dataset_dir=str(dataset),
        batch_size=2,
        num_workers=0,
        resolution=64,
        device="cpu",
        multi_scale=False,
        tensorboard=False,
    )

    def model():
        return RFDETRNano(pretrain_weights=None, num_queries=20, num_select=20, group_detr=1)

    trained = model()
    trained.train(epochs=1, grad_accum_steps=1, output_dir=str(WORK / "out"), **common)
    outcome["train.checkpoints"] = checkpoints(WORK / "out")
    try:
        outcome["export"] = describe(trained.export(output_dir=str(WORK / "export")))
    except Exception as exc:  # e.g. onnx not installed: the same either way
        outcome["export"] = describe(exc)
    resume_from = os.environ.get("TR_RESUME_FROM") or str(WORK / "out" / "last.ckpt")
    # The checkpoint to resume from stays (the traced run's last.ckpt: the untraced run resumes
    # from it too, and the test deletes it after).
    drop(WORK / "out", keep=Path(resume_from))
    resumed = model()
    resumed.train(
        epochs=2,
        grad_accum_steps=1,
        output_dir=str(WORK / "resumed"),
        resume=resume_from,
        **common,
    )
    outcome["resume.checkpoints"] = checkpoints(WORK / "resumed")
    drop(WORK / "resumed")


if __name__ == "__main__":
    main()
    outcome["threads_left"] = sorted(
        t.name for t in threading.enumerate() if t is not threading.main_thread()
    )
    print("TR_OUTCOME " + json.dumps(outcome, sort_keys=True), flush=True)
