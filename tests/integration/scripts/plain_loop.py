"""A hand-written PyTorch training loop (and its Accelerate twin), with injected costs.

Environment: LOOP_STEPS (optimizer steps, default 8), LOOP_ACCUM (microbatches per step),
LOOP_GETITEM_MS / LOOP_FORWARD_MS / LOOP_BACKWARD_MS / LOOP_OPTIMIZER_MS (sleeps per sample,
per forward, per backward, per optimizer step), LOOP_VALIDATE_EVERY (a validation pass every N
steps), LOOP_ACCELERATE=1 (the same loop through accelerate.Accelerator(cpu=True)),
LOOP_SLOW_RANK / LOOP_SLOW_FORWARD_MS (one DDP rank slower in forward), LOOP_WORKERS (the
training DataLoader's num_workers), LOOP_REGISTER_HOOK_AT (DDP: the user's comm hook after
that step), LOOP_CLOSURE=1 (each step through optimizer.step(closure), the forward and backward
inside the closure, as L-BFGS needs), LOOP_IMPORT_LIGHTNING=1 (Lightning's seed_everything
first: a loop that only imports Lightning), LOOP_CRASH_RANK_AT_END / LOOP_CRASH_DELAY_MS (DDP:
that rank dies after its loop, once the delay has passed, with no exit handler run),
LOOP_FAIL_ONCE_MARKER (the last rank raises at its third batch unless that file exists,
which it creates first), LOOP_CTRL_C_AT_EXIT_IN (a KeyboardInterrupt at exit, in the first
call of the function of that name), LOOP_FSDP=1|2 (under torchrun: FSDP's
FullyShardedDataParallel or fully_shard instead of DDP). Under
torchrun (2 ranks) it trains with DDP on gloo.
Prints ``LOOP_RESULT steps=<optimizer steps>``; with TR_CASE set, the transparency probe's line too.
"""

from __future__ import annotations

import gc
import json
import os
import time
import weakref

import torch
from dicts_probe import print_outcome_if_asked
from torch import nn
from torch.utils.data import DataLoader, Dataset


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def env_ms(name: str) -> float:
    return float(os.environ.get(name, 0)) / 1000.0


BATCH = 4


class Samples(Dataset):
    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(count, 16, generator=generator)
        self.y = torch.randn(count, 1, generator=generator)
        self.sleep = env_ms("LOOP_GETITEM_MS")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        if self.sleep:
            time.sleep(self.sleep)
        return self.x[index], self.y[index]


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(env_ms("LOOP_BACKWARD_MS"))
        return grad


class Net(nn.Module):
    def __init__(self, forward_s: float) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.forward_s = forward_s

    def forward(self, x):
        if self.forward_s:
            self._sleep()
        return self._slow_backward(self.body(x))

    # Left to Python by torch.jit.script: the transparency suite scripts the trained model.
    @torch.jit.ignore
    def _sleep(self):  # (no annotations: TorchScript reads them as strings here)
        time.sleep(self.forward_s)

    @torch.jit.ignore
    def _slow_backward(self, y):
        return SlowBackward.apply(y)


class SlowSGD(torch.optim.SGD):
    def step(self, closure=None):
        time.sleep(env_ms("LOOP_OPTIMIZER_MS"))
        return super().step(closure)


def print_weights(model: nn.Module, stepped: int) -> None:
    """The fault-injection suite compares these with an untraced run's, bit for bit."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP's DTensor
        digest.update(local.detach().cpu().contiguous().numpy().tobytes())
    print(f"TINY_WEIGHTS global_step={stepped} sha256={digest.hexdigest()}", flush=True)


def round_trip(model: nn.Module) -> None:
    """LOOP_ROUND_TRIP=1: pickle, deepcopy and torch.save the model between two steps (after
    the first optimizer step, when the any-loop capture has its hooks on the root module)."""
    import copy
    import io
    import json
    import pickle

    pickled = pickle.dumps(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    copies = [
        pickle.loads(pickled),
        copy.deepcopy(model),
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=False),
    ]
    outcome = {
        "traceml_in_pickle": b"traceml" in pickled,
        "traceml_in_save": b"traceml" in buffer.getvalue(),
        "copies_hooks": [len(c._forward_hooks) + len(c._forward_pre_hooks) for c in copies],
        "copies_dict_keys_match": [
            sorted(vars(c)) == sorted(k for k in vars(model) if k != "__getstate__") for c in copies
        ],
        "copies_types": sorted({type(c).__qualname__ for c in copies}),
    }
    print(f"LOOP_ROUND_TRIP {json.dumps(outcome, sort_keys=True)}", flush=True)


def register_comm_hook(model: nn.Module) -> None:
    """LOOP_REGISTER_HOOK_AT=<step> (DDP): the user's own comm hook, registered after that
    optimizer step (DDP takes one; a traced run stopped at its step limit before it)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    try:
        model.register_comm_hook(None, allreduce_hook)
        outcome = "ok"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    print(f"LOOP_REGISTER {outcome}", flush=True)


def closure(model: nn.Module, optimizer, loss_fn, x, y) -> torch.Tensor:
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss


def validate(model: nn.Module, loader: DataLoader) -> None:
    model.eval()
    with torch.no_grad():
        for x, _y in loader:
            model(x)
    model.train()


def shard(model: nn.Module, kind: str) -> nn.Module:
    """FSDP on CPU (gloo): ``1`` FullyShardedDataParallel, ``2`` fully_shard (in place)."""
    from torch.distributed import fsdp

    if kind == "1":
        return fsdp.FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    fsdp.fully_shard(model)
    return model


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if os.environ.get("LOOP_IMPORT_LIGHTNING"):
        from lightning.pytorch import seed_everything

        seed_everything(0, verbose=False)
    world = env_int("WORLD_SIZE", 1)
    rank = env_int("RANK", 0)
    if world > 1:
        torch.distributed.init_process_group("gloo")
    steps, accum = env_int("LOOP_STEPS", 8), env_int("LOOP_ACCUM", 1)
    forward_s = env_ms("LOOP_FORWARD_MS")
    if world > 1 and rank == env_int("LOOP_SLOW_RANK", -1):
        forward_s += env_ms("LOOP_SLOW_FORWARD_MS")
    model = Net(forward_s)
    dataset = Samples(steps * accum * BATCH * world)
    sampler = None
    if world > 1:
        sampler = torch.utils.data.distributed.DistributedSampler(dataset, shuffle=False)
    workers = env_int("LOOP_WORKERS", 0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=workers)
    val_loader = DataLoader(Samples(8), batch_size=4)
    optimizer = SlowSGD(model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()
    validate_every = env_int("LOOP_VALIDATE_EVERY", 0)
    if os.environ.get("LOOP_ACCELERATE"):
        return accelerate_loop(model, optimizer, loader, val_loader, loss_fn, accum, validate_every)
    fsdp = os.environ.get("LOOP_FSDP")
    if world > 1 and fsdp:
        model = shard(model, fsdp)
        optimizer = SlowSGD(model.parameters(), lr=0.01)
    elif world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    # LOOP_SCALER=1: AMP's GradScaler (CPU), whose step skips optimizer.step() on the step
    # LOOP_OVERFLOW_AT (the loss made infinite there).
    scaler = torch.amp.GradScaler("cpu") if os.environ.get("LOOP_SCALER") else None
    overflow_at = env_int("LOOP_OVERFLOW_AT", -1)
    stepped = 0
    closure_steps = os.environ.get("LOOP_CLOSURE")
    fail_once = os.environ.get("LOOP_FAIL_ONCE_MARKER")
    for index, (x, y) in enumerate(loader):
        if fail_once and rank == world - 1 and index == 2 and not os.path.exists(fail_once):
            open(fail_once, "w").close()  # torchrun --max-restarts: the next attempt trains on
            raise RuntimeError("the last rank fails its first attempt")
        if closure_steps:
            optimizer.step(lambda x=x, y=y: closure(model, optimizer, loss_fn, x, y))
            stepped += 1
            continue
        loss = loss_fn(model(x), y) / accum
        if stepped == overflow_at:
            loss = loss * float("inf")
        (scaler.scale(loss) if scaler else loss).backward()
        if (index + 1) % accum == 0:
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
            stepped += 1
            if stepped == 2 and os.environ.get("LOOP_ROUND_TRIP"):
                round_trip(model)
            if validate_every and stepped % validate_every == 0:
                validate(model, val_loader)
            if stepped == env_int("LOOP_REGISTER_HOOK_AT", -1):
                register_comm_hook(model)
    print(f"LOOP_RESULT steps={stepped}", flush=True)
    print_weights(model, stepped)
    print_outcome_if_asked()  # the transparency suite's line, objects alive
    if world > 1:
        if fsdp:  # gloo may abort a rank whose peer leaves while its last gather still reads
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        if rank == env_int("LOOP_CRASH_RANK_AT_END", -1):  # once the other rank is at exit
            time.sleep(env_ms("LOOP_CRASH_DELAY_MS"))
            os._exit(1)  # as a crash: no exit handler, no footer
    elif os.environ.get("TR_CASE"):
        held = after_loop(model)
        del model
        print_freed(held)
    if os.environ.get("LOOP_CTRL_C_AT_EXIT_IN"):
        ctrl_c_at_exit(os.environ["LOOP_CTRL_C_AT_EXIT_IN"])
    return 0


def ctrl_c_at_exit(function: str) -> None:
    """A Ctrl-C pressed as the script ends, landing at exit in the first call of ``function``
    (a KeyboardInterrupt raised there, as the signal's handler would)."""
    import sys

    def tracer(frame, event, _arg):
        if event == "call" and frame.f_code.co_name == function:
            sys.settrace(None)
            raise KeyboardInterrupt
        return None

    sys.settrace(tracer)


def after_loop(model: nn.Module) -> weakref.ref:
    """The transparency suite's: what a script does with its model once the loop is over
    (scripts it; drops it, see :func:`print_freed`)."""
    try:
        scripted = type(torch.jit.script(model)).__name__
    except Exception as exc:
        scripted = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    print("TR_OUTCOME " + json.dumps({"after_loop.jit_script": scripted}), flush=True)
    return weakref.ref(model)


def print_freed(held: weakref.ref) -> None:
    gc.collect()
    print("TR_OUTCOME " + json.dumps({"after_loop.model_freed": held() is None}), flush=True)


def accelerate_loop(model, optimizer, loader, val_loader, loss_fn, accum, validate_every) -> int:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum)
    model, optimizer, loader, val_loader = accelerator.prepare(model, optimizer, loader, val_loader)
    stepped = 0
    for index, (x, y) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if (index + 1) % accum == 0:
            stepped += 1
            if validate_every and stepped % validate_every == 0:
                validate(model, val_loader)
    print(f"LOOP_RESULT steps={stepped}", flush=True)
    print_outcome_if_asked()  # the transparency suite's line, objects alive
    if os.environ.get("TR_CASE"):
        after_loop(model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
