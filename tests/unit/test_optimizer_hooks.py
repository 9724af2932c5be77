"""Removing a global optimizer step hook from inside the step that runs it (real torch)."""

from __future__ import annotations

import torch
from torch.optim import optimizer as optim_module

from traceml.capture.optimizer_hooks import remove_hook


def one_step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    optimizer.param_groups[0]["params"][0].sum().backward()
    optimizer.step()


def test_a_hook_removing_itself_before_a_users_hook_breaks_no_step():
    # handle.remove() there raised "OrderedDict mutated during iteration" out of the user's
    # optimizer.step() (helper review, stop 60): a loop refused at its first step, with a
    # global pre-hook of the user's registered after traceml's.
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    calls: list[str] = []
    handle = None

    def ours(*_):
        calls.append("ours")
        remove_hook(handle, iterating=True)

    handle = optim_module.register_optimizer_step_pre_hook(ours)
    users = optim_module.register_optimizer_step_pre_hook(lambda *_: calls.append("user"))
    hooks = optim_module._global_optimizer_pre_hooks
    try:
        one_step(optimizer)
        assert calls == ["ours", "user"]
        assert handle.id in hooks  # a no-op in its place while the user's follows it
        one_step(optimizer)
        assert calls == ["ours", "user", "user"]
        users.remove()
        one_step(optimizer)  # now the last entry: it deletes itself
        assert handle.id not in hooks and users.id not in hooks
    finally:
        users.remove()
        hooks.pop(handle.id, None)


def test_the_last_hook_or_one_outside_a_step_is_deleted_at_once():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    handle = None

    def ours(*_):
        remove_hook(handle, iterating=True)

    handle = optim_module.register_optimizer_step_pre_hook(ours)
    one_step(optimizer)
    assert handle.id not in optim_module._global_optimizer_pre_hooks
    other = optim_module.register_optimizer_step_post_hook(lambda *_: None)
    later = optim_module.register_optimizer_step_post_hook(lambda *_: None)
    remove_hook(other, iterating=False)
    assert other.id not in optim_module._global_optimizer_post_hooks
    later.remove()
    remove_hook(other, iterating=True)  # gone already: nothing to do
