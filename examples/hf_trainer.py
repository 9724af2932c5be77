"""A Hugging Face Trainer on a tiny BERT built from a config (no download), traced with no code
change. Runs on CPU in a few seconds.

    traceml run examples/hf_trainer.py            # or: TRACEML=1 python examples/hf_trainer.py

What traceml measures here, and what not: docs/any_pytorch.md.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class RandomTexts(Dataset):
    """Random token ids and labels (the model learns nothing; the steps are real)."""

    def __init__(self, count: int, length: int = 32) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 1000, (count, length), generator=generator)
        self.labels = torch.randint(0, 2, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1)
    args = parser.parse_args()

    config = BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.grad_accum,
            eval_strategy="steps",
            eval_steps=20,  # evaluation between steps: not counted inside any step
            save_strategy="no",
            logging_steps=10,
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=RandomTexts(args.steps * args.batch_size * args.grad_accum),
            eval_dataset=RandomTexts(32),
        )
        trainer.train()


if __name__ == "__main__":
    main()
