"""A tiny Lightning training whose costs the tests choose through TINY_* variables.

Plain Lightning, no traceml import: the tests run it with TRACEML=1, under `traceml run`, or
under torchrun, and check what traceml recorded against what this script did.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import os
import sys
import time

import torch
import torch.utils.checkpoint
from torch.utils.data import DataLoader, Dataset


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def env_ms(name: str) -> float:
    return float(os.environ.get(name, "0")) / 1000.0


# TINY_FAULT_INJECT_BY_RANK=a,b: rank 0 breaks traceml entry point a, rank 1 entry point b
# (TRACEML_FAULT_INJECT per rank; set before Lightning's import loads traceml.capture.guard).
if os.environ.get("TINY_FAULT_INJECT_BY_RANK"):
    points = os.environ["TINY_FAULT_INJECT_BY_RANK"].split(",")
    os.environ["TRACEML_FAULT_INJECT"] = points[int(os.environ.get("RANK", "0"))]
    if "traceml.capture.guard" in sys.modules:
        sys.modules["traceml.capture.guard"].reload_injection()
# Make one Lightning package unimportable (as if only the other one were installed).
BLOCKED = os.environ.get("TINY_BLOCK_PACKAGE")
if BLOCKED:
    sys.modules[BLOCKED] = None  # type: ignore[assignment]  # import raises ImportError
PACKAGE = os.environ.get("TINY_PACKAGE", "lightning.pytorch")
pl = importlib.import_module(PACKAGE)
if os.environ.get("LOOP_TIMER"):  # benchmarks/overhead.py only
    import loop_timer

    loop_timer.install(PACKAGE)

BATCHES = env_int("TINY_BATCHES", 12)
FETCH_SLEEP = env_ms("TINY_FETCH_SLEEP_MS")
FORWARD_SLEEP = env_ms("TINY_FORWARD_SLEEP_MS")
OPTIMIZER_SLEEP = env_ms("TINY_OPTIMIZER_SLEEP_MS")
# Every rank: this long more in backward (a gradient hook on the output) and in the batch
# transfer (on_after_batch_transfer, which traceml counts as H2D).
BACKWARD_SLEEP = env_ms("TINY_BACKWARD_SLEEP_MS")
TRANSFER_SLEEP = env_ms("TINY_TRANSFER_SLEEP_MS")
STEP_SLEEP = env_ms("TINY_STEP_SLEEP_MS")
RAISE_AFTER = env_int("TINY_RAISE_AFTER", -1)
SLOW_RANK = env_int("TINY_SLOW_RANK", -1)
# Where the slow rank's TINY_SLOW_RANK_EXTRA_MS goes: fetch (default), forward or backward.
SLOW_WHERE = os.environ.get("TINY_SLOW_WHERE", "fetch")
# Every rank: a DDP communication hook that sleeps this long per bucket, then all-reduces.
COMM_DELAY = env_ms("TINY_COMM_DELAY_MS")
# A memory leak: every training step keeps a tensor of this many KiB (filled, so its pages are
# resident) in a list that is never cleared.
LEAK_KIB = env_int("TINY_LEAK_KIB", 0)
# Several ranks: training_step also runs a synchronous all_reduce and an async_op=True one
# (then wait()), on copies, so the weights are the same as without them.
COLLECTIVES = env_int("TINY_COLLECTIVES", 0)
# sgd (default: SGD, with TINY_OPTIMIZER_SLEEP_MS) or lbfgs (LBFGS, max_iter=3: the closure,
# so training_step, forward and backward, runs several times per optimizer step).
OPTIMIZER = os.environ.get("TINY_OPTIMIZER", "sgd")
# Activation checkpointing of the whole model: its forward (TINY_FORWARD_SLEEP_MS included)
# runs again inside backward.
CHECKPOINT = env_int("TINY_CHECKPOINT", 0)


def slow_here(where: str) -> float:
    if SLOW_RANK >= 0 and where == SLOW_WHERE and int(os.environ.get("RANK", "0")) == SLOW_RANK:
        return env_ms("TINY_SLOW_RANK_EXTRA_MS")
    return 0.0


class Batches(Dataset):
    """Each item is a whole batch (batch_size=None), so a sleep here is the per-batch fetch."""

    def __init__(self, count: int, sleep: float) -> None:
        self.count, self.sleep = count, sleep

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        sleep = self.sleep + slow_here("fetch")
        if sleep:
            time.sleep(sleep)
        generator = torch.Generator().manual_seed(index)
        return torch.randn(8, 16, generator=generator), torch.randn(8, 1, generator=generator)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )
        self.training_calls = 0  # forward calls with grad enabled (LBFGS runs several)

    def forward(self, x):
        if torch.is_grad_enabled():
            self.training_calls += 1
        extra = slow_here("forward") if torch.is_grad_enabled() else 0.0
        if FORWARD_SLEEP or extra:
            time.sleep(FORWARD_SLEEP + extra)
        out = self.layers(x)
        backward_extra = BACKWARD_SLEEP + slow_here("backward")
        if backward_extra and out.requires_grad:
            out.register_hook(lambda grad: (time.sleep(backward_extra), grad)[1])
        return out


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Net()
        self.seen = 0
        self.batch_end_dispatches = -1
        self.traceml_callbacks = 0
        self.leaked: list[torch.Tensor] = []
        self.lr = 0.01
        if os.environ.get("TINY_MANUAL"):
            self.automatic_optimization = False

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # How many of traceml's callbacks Lightning dispatches its batch-end hook to (none
        # while traceml ends the step just before this hook instead). Once an epoch: the
        # overhead benchmarks run this script, and this loop is not traceml's cost.
        if batch_idx:
            return
        ours = [cb for cb in self.trainer.callbacks if "StepCallback" in type(cb).__name__]
        self.batch_end_dispatches = sum(callable(cb.on_train_batch_end) for cb in ours)
        # During the fit: traceml's callback leaves trainer.callbacks when fit returns.
        self.traceml_callbacks = len(ours)

    def training_step(self, batch, batch_idx):
        self.seen += 1
        if LEAK_KIB:
            self.leaked.append(torch.ones(LEAK_KIB * 256))  # float32: 256 per KiB
        if RAISE_AFTER >= 0 and self.seen > RAISE_AFTER:
            raise RuntimeError(f"tiny_lightning: failing on purpose at batch {self.seen}")
        if STEP_SLEEP:
            time.sleep(STEP_SLEEP)
        x, y = batch
        if CHECKPOINT:  # the model's forward runs again inside backward (a recomputation)
            out = torch.utils.checkpoint.checkpoint(self.model, x, use_reentrant=False)
        else:
            out = self.model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        if COLLECTIVES and torch.distributed.is_initialized():
            total = loss.detach().clone()
            torch.distributed.all_reduce(total)
            work = torch.distributed.all_reduce(total.clone(), async_op=True)
            work.wait()
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def on_after_batch_transfer(self, batch, dataloader_idx):
        if TRANSFER_SLEEP and self.trainer.training:
            time.sleep(TRANSFER_SLEEP)
        return batch

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.model(x), y))

    def configure_optimizers(self):
        if OPTIMIZER == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)
        return SleepySGD(self.parameters(), lr=self.lr)


class TunedModule(Module):
    """What Lightning's Tuner needs: the DataLoader from the module, a batch_size attribute
    (scale_batch_size) and lr (lr_find) that configure_optimizers reads."""

    def __init__(self, batches: int) -> None:
        super().__init__()
        self.batches = batches
        self.batch_size = 2

    def train_dataloader(self):
        return DataLoader(Batches(self.batches, FETCH_SLEEP), batch_size=None)

    def val_dataloader(self):
        return DataLoader(Batches(4, 0.0), batch_size=None)


class SleepySGD(torch.optim.SGD):
    """SGD whose update takes TINY_OPTIMIZER_SLEEP_MS longer (after the closure has run)."""

    def step(self, closure=None):
        loss = super().step(closure)
        if OPTIMIZER_SLEEP:
            time.sleep(OPTIMIZER_SLEEP)
        return loss


def fail_rank_file_writes(spec: str) -> None:
    """TINY_FAIL_WRITE=ENOSPC:4 (or EIO:4): after 4 successful writes to a traceml rank file,
    every further os.write to it fails with that error, like a full disk or a dying one."""
    name, _, after = spec.partition(":")
    code = getattr(errno, name)
    allowed = int(after or 0)
    original_write = os.write
    writes = 0

    def write(fd, data):
        nonlocal writes
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if "/ranks/rank_" in target:
            if writes >= allowed:
                raise OSError(code, os.strerror(code))
            writes += 1
        return original_write(fd, data)

    os.write = write


def weights_sha256(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def tune(trainer, module) -> None:
    from importlib import import_module

    tuner = import_module(PACKAGE + ".tuner").Tuner(trainer)
    for method in os.environ["TINY_TUNER"].split(","):
        if method == "lr_find":
            tuner.lr_find(module, num_training=4, update_attr=True)
        elif method == "scale_batch_size":
            tuner.scale_batch_size(module, steps_per_trial=2, max_trials=2)
        else:
            raise ValueError(f"TINY_TUNER: unknown tuner method {method!r}")


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(env_int("TINY_SEED", 0))
    if os.environ.get("TINY_FAIL_WRITE"):
        fail_rank_file_writes(os.environ["TINY_FAIL_WRITE"])
    if os.environ.get("TINY_INIT"):
        import traceml.capture.frameworks.rfdetr as traceml_init

        for _ in range(env_int("TINY_INIT_CALLS", 1)):
            traceml_init.init(run_name=os.environ["TINY_INIT"])
    layout = {}
    world = env_int("WORLD_SIZE", 1)
    if world > 1:
        local = env_int("LOCAL_WORLD_SIZE", world)
        layout = {"devices": local, "num_nodes": world // local, "strategy": "ddp"}
    if COMM_DELAY:
        from slow_network import install_slow_comm_hook

        install_slow_comm_hook(COMM_DELAY)
    validate = env_int("TINY_VALIDATE", 1)
    trainer_class = pl.Trainer
    if os.environ.get("TINY_TRAINER_SUBCLASS"):

        class ScriptTrainer(pl.Trainer):  # a Trainer subclass of the user's (in __main__)
            pass

        trainer_class = ScriptTrainer
    trainer = trainer_class(
        max_epochs=env_int("TINY_EPOCHS", 1),
        accelerator="cpu",
        accumulate_grad_batches=env_int("TINY_ACCUM", 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=2 if validate else 0,
        limit_val_batches=2 if validate else 0,
        **layout,
    )
    workers = env_int("TINY_NUM_WORKERS", 0)
    train = DataLoader(Batches(BATCHES, FETCH_SLEEP), batch_size=None, num_workers=workers)
    val = DataLoader(Batches(4, 0.0), batch_size=None)
    tuner = os.environ.get("TINY_TUNER")
    module = TunedModule(BATCHES) if tuner else Module()
    fds = len(os.listdir("/proc/self/fd"))  # fds_added: what the fit left open
    try:
        if tuner:
            tune(trainer, module)
            trainer.fit(module)
        else:
            trainer.fit(module, train, val if validate else None)
    finally:
        # TINY_WEIGHTS_HASH=1: the weights, also when training raised (printed before the
        # traceback), for bit-for-bit comparisons with other runs.
        if os.environ.get("TINY_WEIGHTS_HASH"):
            # One write of one whole line: under torchrun both ranks share the pipe, and a
            # print's text and newline can interleave with the other rank's.
            line = f"TINY_WEIGHTS global_step={trainer.global_step} sha256={weights_sha256(module)}"
            sys.stdout.flush()
            os.write(sys.stdout.fileno(), (line + "\n").encode())
    fds = len(os.listdir("/proc/self/fd")) - fds
    if os.environ.get("TINY_VALIDATE_AFTER"):
        trainer.validate(module, val, verbose=False)
    # Tear the process group down before exit: left to interpreter shutdown, gloo's threads
    # sometimes abort the process ("terminate called without an active exception").
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    extra = ""
    if OPTIMIZER != "sgd":
        extra = f" forward_calls={module.model.training_calls}"
    print(
        f"TINY_RESULT global_step={trainer.global_step}"
        f" traceml_callbacks={module.traceml_callbacks}"
        f" batch_end_dispatches={module.batch_end_dispatches} fds_added={fds}{extra}"
    )
    if os.environ.get("TINY_KILL_ITSELF"):  # as the OOM killer would, after the training
        import signal

        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return env_int("TINY_EXIT_CODE", 0)


if __name__ == "__main__":
    sys.exit(main())
