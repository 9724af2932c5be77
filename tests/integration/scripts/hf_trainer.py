"""A Hugging Face Trainer on a tiny BERT built from a config (no download), injected costs.

Environment: HF_STEPS (max_steps, default 6), HF_ACCUM (gradient_accumulation_steps),
HF_GETITEM_MS / HF_FORWARD_MS / HF_BACKWARD_MS / HF_OPTIMIZER_MS (sleeps per sample, forward,
backward, optimizer step), HF_EVAL_STEPS (evaluate every N steps; 0: never), HF_RAISE_AT (raise
from the model's forward at this call), HF_OOM_AT (an out-of-memory error at this call, with
auto_find_batch_size: the Trainer retries with half the batch), HF_SANITY=1 (a forward in
train mode before train(): a sanity check of the model), HF_CALLBACK_RAISE_AT (a callback's
on_step_end raises at this global step, after its optimizer step), HF_OPTIMIZER_CALLBACK_MS (a
callback's on_optimizer_step sleeps, as an EMA update would).
Prints ``HF_RESULT global_step=<n>``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
from dicts_probe import print_outcome_if_asked
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


def env_ms(name: str) -> float:
    return float(os.environ.get(name, 0)) / 1000.0


class Texts(Dataset):
    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 100, (count, 8), generator=generator)
        self.labels = torch.randint(0, 2, (count,), generator=generator)
        self.sleep = env_ms("HF_GETITEM_MS")

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        if self.sleep:
            time.sleep(self.sleep)
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(env_ms("HF_BACKWARD_MS"))
        return grad


class SlowBert(BertForSequenceClassification):
    calls = 0

    def forward(self, *args, **kwargs):
        SlowBert.calls += 1
        if SlowBert.calls == int(os.environ.get("HF_OOM_AT", 0)):
            # What the Trainer's auto_find_batch_size retries on with a smaller batch.
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory (injected)")
        if SlowBert.calls == int(os.environ.get("HF_RAISE_AT", 0)):
            raise RuntimeError(f"hf_trainer: failing on purpose at batch {SlowBert.calls}")
        time.sleep(env_ms("HF_FORWARD_MS"))
        if os.environ.get("RANK") == os.environ.get("HF_SLOW_RANK", "-"):
            time.sleep(env_ms("HF_SLOW_FORWARD_MS"))
        output = super().forward(*args, **kwargs)
        if output.loss is not None and self.training:
            output.loss = SlowBackward.apply(output.loss)
        return output


class SlowSGD(torch.optim.SGD):
    def step(self, closure=None):
        time.sleep(env_ms("HF_OPTIMIZER_MS"))
        return super().step(closure)


class RoundTrip(TrainerCallback):
    """HF_ROUND_TRIP=1: the user's callback pickles, deep-copies and torch.saves the model
    after the second step (as an EMA or checkpointing callback would)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 2:
            from plain_loop import round_trip  # the same checks as the hand-written loop's

            round_trip(model)


class RaiseAtStepEnd(TrainerCallback):
    """HF_CALLBACK_RAISE_AT=N: a logging or checkpointing callback that fails at step N."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == int(os.environ["HF_CALLBACK_RAISE_AT"]):
            raise RuntimeError(f"callback failed at step {state.global_step}'s end")


class SlowAfterOptimizerStep(TrainerCallback):
    """HF_OPTIMIZER_CALLBACK_MS: an EMA update or a gradient logger, after each update."""

    def on_optimizer_step(self, args, state, control, **kwargs):
        time.sleep(env_ms("HF_OPTIMIZER_CALLBACK_MS"))


def print_weights(model: torch.nn.Module, global_step: int) -> None:
    """The fault-injection suite compares these with an untraced run's, bit for bit."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    print(f"TINY_WEIGHTS global_step={global_step} sha256={digest.hexdigest()}", flush=True)


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    steps = int(os.environ.get("HF_STEPS", 6))
    accum = int(os.environ.get("HF_ACCUM", 1))
    eval_steps = int(os.environ.get("HF_EVAL_STEPS", 0))
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=2,
    )
    model = SlowBert(config)
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            max_steps=steps,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=4,
            gradient_accumulation_steps=accum,
            eval_strategy="steps" if eval_steps else "no",
            eval_steps=eval_steps or None,
            save_strategy="no",
            logging_strategy="no",
            report_to=[],
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
            remove_unused_columns=False,
            auto_find_batch_size=bool(os.environ.get("HF_OOM_AT")),
        )
        optimizer = SlowSGD(model.parameters(), lr=0.01)
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=Texts(steps * accum * 4),
            eval_dataset=Texts(8),
            optimizers=(optimizer, None),
            callbacks=[RoundTrip()] if os.environ.get("HF_ROUND_TRIP") else None,
        )
        if os.environ.get("HF_CALLBACK_RAISE_AT"):  # (before traceml's, added at train())
            trainer.add_callback(RaiseAtStepEnd())
        if os.environ.get("HF_OPTIMIZER_CALLBACK_MS"):
            trainer.add_callback(SlowAfterOptimizerStep())
        if os.environ.get("HF_SANITY"):
            sample = Texts(1)[0]
            model(**{key: value[None] for key, value in sample.items()})
        try:
            trainer.train()
            if os.environ.get("HF_TRAIN_TWICE"):  # a second training: untraced, said once
                trainer.train()
        finally:
            print_weights(model, trainer.state.global_step)
    print(f"HF_RESULT global_step={trainer.state.global_step}", flush=True)
    print_outcome_if_asked()  # the transparency suite's line, the trainer alive
    if os.environ.get("TR_CASE"):
        print_callbacks_after_train(trainer)
    return 0


def print_callbacks_after_train(trainer) -> None:
    """The transparency suite's: the trainer's callbacks once train() returned, and whether
    they pickle (what a hyperparameter search does with a trainer)."""
    import json
    import pickle

    callbacks = trainer.callback_handler.callbacks
    try:
        pickled = f"{len(pickle.dumps(callbacks)) > 0}"
    except Exception as exc:
        pickled = f"{type(exc).__name__}"
    outcome = {
        "after_train.callbacks": [type(callback).__name__ for callback in callbacks],
        "after_train.pickle_callbacks": pickled,
    }
    print("TR_OUTCOME " + json.dumps(outcome), flush=True)


if __name__ == "__main__":
    sys.exit(main())
