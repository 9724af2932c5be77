"""Train RF-DETR Nano the standard way: ``RFDETRNano(...)`` then ``model.train(...)``.

There is no traceml import here on purpose: run it under ``traceml run`` (or with
``TRACEML=1``) and the training is traced with no code change.

    traceml run examples/integrations/rfdetr_minimal.py --args --demo --output-dir out/demo
    traceml run examples/integrations/rfdetr_minimal.py --args --dataset-dir my_coco_export \
        --output-dir out/real --epochs 10 --batch-size 8 --num-workers 4

``--demo`` makes a small synthetic dataset (coloured boxes on noise, Roboflow COCO layout) in a
temporary directory and removes it afterwards. RF-DETR writes its checkpoints (about 0.7 GB per
run) into ``--output-dir``; the script removes them at the end, saying how many and how big,
unless ``--keep-checkpoints``. Synthetic-data timings prove the integration
works; they are not benchmark evidence for real training.

Under a launcher (``traceml run --nproc-per-node N``, ``torchrun``) the script reads
WORLD_SIZE / LOCAL_WORLD_SIZE and trains with DDP; ``--batch-size`` is per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

# Demo-sized model: few queries, one query group, small images; about a minute per epoch of
# the 32-image demo on a 2-core CPU. For real data drop these and use RF-DETR's defaults.
DEMO_MODEL = {"num_queries": 20, "num_select": 20, "group_detr": 1}
DEMO_RESOLUTION = 128
DEFAULT_RESOLUTION = 384
CLASSES = ("red", "green", "blue")
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 80, 230)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--demo", action="store_true", help="train on a synthetic dataset")
    source.add_argument("--dataset-dir", help="a Roboflow COCO export (train/ valid/ test/)")
    parser.add_argument(
        "--output-dir",
        required=True,
        help="a new directory for RF-DETR's output; its checkpoints (about 0.7 GB a run) are "
        "removed at the end unless --keep-checkpoints",
    )
    parser.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep the checkpoints (*.pth) RF-DETR writes into --output-dir",
    )
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=2, help="per rank")
    parser.add_argument("--grad-accum-steps", type=int, default=1)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument(
        "--resolution",
        type=int,
        default=None,
        help=f"input size, a multiple of 32 (default {DEFAULT_RESOLUTION}; "
        f"{DEMO_RESOLUTION} with --demo)",
    )
    parser.add_argument(
        "--read-latency-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="wait MS before every image read, as a network filesystem or object store does "
        "(0): the case more DataLoader workers help, since they wait beside the training",
    )
    parser.add_argument("--accelerator", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--pretrained",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start from RF-DETR's pretrained weights (default); offline, train from scratch",
    )
    return parser.parse_args(argv)


def fail(message: str) -> None:
    print(f"rfdetr_minimal: error: {message}", file=sys.stderr)
    sys.exit(2)


# ----------------------------------------------------------------------------------------------
# Synthetic dataset


def make_demo_dataset(root: Path, seed: int, sizes: dict[str, int] | None = None) -> Path:
    """Roboflow-style COCO export: train/ valid/ test/, images + _annotations.coco.json."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    sizes = sizes or {"train": 32, "valid": 4, "test": 4}
    # Roboflow exports a parent "supercategory" with id 0 that no box uses.
    categories = [{"id": 0, "name": "shapes", "supercategory": "none"}] + [
        {"id": i + 1, "name": name, "supercategory": "shapes"} for i, name in enumerate(CLASSES)
    ]
    for split, count in sizes.items():
        folder = root / split
        folder.mkdir(parents=True)
        images, annotations = [], []
        for index in range(count):
            width, height = 160, 128
            image = Image.new(
                "RGB", (width, height), tuple(rng.randrange(60, 120) for _ in range(3))
            )
            draw = ImageDraw.Draw(image)
            for _box in range(rng.randint(1, 3)):
                name = rng.choice(CLASSES)
                w, h = rng.randint(20, 60), rng.randint(20, 50)
                x, y = rng.randint(0, width - w), rng.randint(0, height - h)
                draw.rectangle([x, y, x + w, y + h], fill=COLOURS[name])
                annotations.append(
                    {
                        "id": len(annotations) + 1,
                        "image_id": index,
                        "category_id": CLASSES.index(name) + 1,
                        "bbox": [x, y, w, h],
                        "area": w * h,
                        "iscrowd": 0,
                    }
                )
            file_name = f"{split}_{index:04d}.jpg"
            image.save(folder / file_name, quality=90)
            images.append({"id": index, "file_name": file_name, "width": width, "height": height})
        coco = {"images": images, "annotations": annotations, "categories": categories}
        (folder / "_annotations.coco.json").write_text(json.dumps(coco))
    return root


def simulate_read_latency(milliseconds: float) -> None:
    """Every image read (RF-DETR's COCO dataset opens images with ``PIL.Image.open``) first waits
    ``milliseconds``. The wait uses no CPU, so DataLoader workers (forked with this patch) can
    overlap it with training even on two cores, as they do for slow storage."""
    import time

    from PIL import Image

    original = Image.open

    def slow_open(*args, **kwargs):
        time.sleep(milliseconds / 1000.0)
        return original(*args, **kwargs)

    Image.open = slow_open


# ----------------------------------------------------------------------------------------------
# Training


def distributed_layout() -> dict[str, object]:
    """Lightning settings for the launcher that started us (torchrun sets these variables)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return {}
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return {"devices": local, "num_nodes": max(1, world // local), "strategy": "ddp"}


def build_model(args: argparse.Namespace):
    from rfdetr import RFDETRNano

    options = dict(DEMO_MODEL) if args.demo else {}
    if args.pretrained:
        try:
            return RFDETRNano(**options)
        except Exception as exc:  # offline machines cannot fetch the weights
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            print(
                "rfdetr_minimal: pretrained weights are unavailable "
                f"({type(exc).__name__}{': ' + reason[:120] if reason else ''}); "
                "training from random initialisation",
                file=sys.stderr,
            )
    return RFDETRNano(pretrain_weights=None, **options)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    output_dir = Path(args.output_dir)
    # Under a launcher every rank runs this script: only the first process of the job creates
    # the directory; the refusal below is for a second run into the same place.
    first_process = os.environ.get("RANK", "0") == "0"
    if first_process and output_dir.exists():
        fail(f"output directory {output_dir} already exists; choose a new --output-dir")
    if args.dataset_dir and not (Path(args.dataset_dir) / "train").is_dir():
        fail(f"{args.dataset_dir} has no train/ folder (expected a Roboflow COCO export)")
    resolution = args.resolution or (DEMO_RESOLUTION if args.demo else DEFAULT_RESOLUTION)
    if resolution % 32:
        fail(f"--resolution {resolution} is not a multiple of 32")

    accelerator = args.accelerator
    if accelerator == "auto":
        import torch

        accelerator = "cuda" if torch.cuda.is_available() else "cpu"

    if args.read_latency_ms > 0:
        simulate_read_latency(args.read_latency_ms)
    temp_root = None
    try:
        if args.demo:
            # One dataset per rank: the ranks never race on a shared temporary folder.
            temp_root = Path(tempfile.mkdtemp(prefix="rfdetr-demo-"))
            dataset_dir = make_demo_dataset(temp_root / "dataset", args.seed)
        else:
            dataset_dir = Path(args.dataset_dir)
        model = build_model(args)
        model.train(
            dataset_dir=str(dataset_dir),
            output_dir=str(output_dir),
            epochs=args.epochs,
            batch_size=args.batch_size,
            grad_accum_steps=args.grad_accum_steps,
            num_workers=args.num_workers,
            resolution=resolution,
            device=accelerator,
            seed=args.seed,
            multi_scale=False,
            tensorboard=False,
            **distributed_layout(),
        )
    finally:
        if temp_root is not None:
            shutil.rmtree(temp_root, ignore_errors=True)
        _close_process_group()
    if first_process:
        _report_checkpoints(output_dir, keep=args.keep_checkpoints)
    return 0


def _report_checkpoints(output_dir: Path, *, keep: bool) -> None:
    """Say where the checkpoints went and how big they are; remove them unless asked to keep
    them (a demo run leaves ~0.7 GB of them, which adds up over repeated runs)."""
    found = sorted(p for pattern in ("*.pth", "*.ckpt") for p in output_dir.rglob(pattern))
    size_mb = sum(p.stat().st_size for p in found if p.is_file()) / 2**20
    if not found:
        return
    if keep:
        print(
            f"rfdetr_minimal: {len(found)} checkpoints ({size_mb:.0f} MB) in {output_dir}",
            file=sys.stderr,
        )
        return
    for path in found:
        path.unlink(missing_ok=True)
    print(
        f"rfdetr_minimal: removed {len(found)} checkpoints ({size_mb:.0f} MB) from {output_dir} "
        "(--keep-checkpoints keeps them)",
        file=sys.stderr,
    )


def _close_process_group() -> None:
    """Left to interpreter shutdown, gloo's threads sometimes abort the process at exit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
