"""Which module's forward is a Lightning training's "Forward"."""

from __future__ import annotations

from typing import Any


def forward_module(pl_module: Any) -> Any | None:
    """The network whose forward is "Forward": RF-DETR's (and many modules') ``self.model``;
    else the LightningModule itself where it defines a forward (run when ``training_step``
    calls ``self(x)``); else, with no forward of its own, its submodule with the most
    parameters (``self.net(x)``, ``self.backbone(x)``: the LightningModule's forward never
    runs, and Forward went unmeasured)."""
    try:
        import torch

        inner = getattr(pl_module, "model", None)
        if isinstance(inner, torch.nn.Module):
            return inner
        if not isinstance(pl_module, torch.nn.Module):
            return None
        if _defines_forward(type(pl_module)):
            return pl_module
        # The most parameters, frozen ones too: a frozen backbone under a trained head (linear
        # probing) is most of the forward's time, so the smaller part is the one in Residual.
        sized = [(_parameter_count(child), child) for _, child in _candidates(pl_module)]
        return max(sized, key=lambda pair: pair[0])[1] if sized else pl_module
    except Exception:
        return None


def forward_note(pl_module: Any, module: Any) -> str | None:
    """Which submodule's forward is Forward, where :func:`forward_module` had to choose one
    among several with parameters (the others' calls count as Residual)."""
    try:
        if module is pl_module or module is getattr(pl_module, "model", None):
            return None
        names = [name for name, _ in _candidates(pl_module)]
        chosen = [n for n, c in pl_module.named_children() if c is module]
        if len(names) < 2 or not chosen:
            return None
        others = ", ".join(f"self.{n}" for n in names if n != chosen[0])
        return (
            f"Forward is self.{chosen[0]}'s forward, the LightningModule's largest submodule "
            f"(it defines no forward of its own); calls of {others} count as Residual"
        )
    except Exception:
        return None


def _candidates(pl_module: Any) -> list[tuple[str, Any]]:
    """The submodules that may be Forward: those with parameters, a metric's network never
    (torchmetrics' FID runs an Inception net at validation)."""
    return [
        (name, child)
        for name, child in pl_module.named_children()
        if not type(child).__module__.startswith("torchmetrics.") and _parameter_count(child) > 0
    ]


def _defines_forward(cls: type) -> bool:
    """Whether a class below Lightning's own defines ``forward``."""
    for klass in cls.__mro__:
        if klass.__module__.startswith(("lightning.", "pytorch_lightning.", "torch.")):
            return False
        if "forward" in vars(klass):
            return True
    return False


def _parameter_count(module: Any) -> int:
    return sum(parameter.numel() for parameter in module.parameters())
