"""Activation: decide whether this process traces, then wait for the libraries it traces.

Called from ``traceml_bootstrap.pth`` at interpreter start when ``TRACEML`` is set, or from
:func:`traceml.init`. It reads settings, picks the process's role and registers post-import
hooks; the integrations themselves load only when their library is imported. Fail-open: any
problem prints one line and leaves the program running untraced.
"""

from __future__ import annotations

# Loaded at interpreter start in every TRACEML=1 process: only modules already loaded by then.
import _thread
import os
import sys

from traceml import console
from traceml import settings as settings_module
from traceml.settings import Settings, SettingsError

# typing costs ~8 ms to import at start-up; annotations are strings (PEP 563) anyway.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from collections.abc import Mapping, MutableMapping, Sequence
    from typing import Any

# Module imported -> "module:function" run after it. Strings, so an integration's own module
# loads only when its library does.
INTEGRATION_HOOKS: dict[str, str] = {
    "rfdetr.training": "traceml.capture.frameworks.rfdetr:on_import",
    "pytorch_lightning": "traceml.capture.frameworks.lightning_attach:on_import",
    "lightning.pytorch": "traceml.capture.frameworks.lightning_attach:on_import",
    "torch": "traceml.capture.frameworks.torch_loop:on_import",
    "transformers.trainer": "traceml.capture.frameworks.hf_trainer:on_import",
    "accelerate.launchers": "traceml.capture.frameworks.torch_spawn:on_accelerate_launchers",
}

ENV_FAILED = "env-failed"  # the activation source where TRACEML=1 could not start
TURNED_OFF = "turned-off"  # the activation source once a failure turned tracing off
ROLE_WORKER = "worker"
ROLE_AGENT = "agent"
ROLE_HELPER = "helper"

_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


class _State:
    def __init__(self) -> None:
        self.activated = False
        self.role: str | None = None
        self.settings: Settings | None = None
        self.source: str | None = None  # "env" (TRACEML=1) or "init" (traceml.init())


_state = _State()
_lock = _thread.RLock()


def process_role(argv: Sequence[str]) -> str:
    """What this interpreter is, from ``sys.orig_argv``.

    ``agent``: torchrun's launcher process, which starts the workers and never trains.
    ``helper``: a multiprocessing child (DataLoader workers under spawn/forkserver, resource
    trackers); they import the user's modules but must stay untraced and cheap.
    ``worker``: everything else, i.e. a process that may train.
    """
    kind, target = settings_module.interpreter_target(argv)
    if kind == "module":
        return ROLE_AGENT if target in _TORCHRUN_MODULES else ROLE_WORKER
    if kind == "code":
        child = "from multiprocessing." in target or "--multiprocessing-fork" in argv
        return ROLE_HELPER if child else ROLE_WORKER
    if kind == "script" and os.path.basename(target) in ("torchrun", "torchrun.exe"):
        return ROLE_AGENT
    return ROLE_WORKER


def _own_command(argv: Sequence[str]) -> bool:
    """traceml's own command line (``traceml ...``, ``python -m traceml ...``): it never trains."""
    kind, target = settings_module.interpreter_target(argv)
    name = os.path.basename(target) if kind == "script" else target
    return kind in ("script", "module") and name == "traceml"


def activate(
    environ: MutableMapping[str, str] | None = None,
    argv: Sequence[str] | None = None,
) -> bool:
    """Turn tracing on for this process (once). Returns whether this process will trace."""
    env = os.environ if environ is None else environ
    args = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    with _lock:
        if _state.activated:
            return _state.role == ROLE_WORKER and _state.settings is not None
        _state.activated = True
        try:
            role = process_role(args)
            _state.role = role
            if role == ROLE_AGENT:
                settings_module.mark_launch(env)
                return False
            if role == ROLE_HELPER:
                _name_helper_training()
                return False
            if not _own_command(args):  # (`traceml run` sets TRACEML for its script)
                settings_module.check_enable(env)
            settings = settings_module.load_settings(env, args)
            settings_module.pin_run_name(settings, env)
            _state.settings = settings
            _state.source = "env"
            register_integrations()
            return True
        except SettingsError as exc:
            console.warn(f"{exc}; tracing disabled, the program runs untraced")
        except Exception as exc:
            console.warn(
                f"could not start ({type(exc).__name__}: {exc}); tracing disabled, "
                "the program runs untraced"
            )
        _state.settings = None
        _state.source = ENV_FAILED  # a later traceml.init() says nothing more
        return False


def _name_helper_training() -> None:
    """A training in a helper (a process multiprocessing started with spawn or forkserver)
    says, at its first optimizer step, that it runs untraced; nothing else is registered."""
    try:
        from traceml.capture.import_hooks import register_post_import_hook

        register_post_import_hook("torch.optim.optimizer", _helper_torch_optim)
    except Exception:
        pass  # a DataLoader worker must stay quiet: a warning there repeats per worker


def _helper_torch_optim(module: Any) -> None:
    import importlib  # (by name, as the integrations: that module reads this one's state)

    importlib.import_module("traceml.capture.untraced_children").on_helper_torch_optim(module)


def register_integrations(hooks: Mapping[str, str] | None = None) -> None:
    from traceml.capture import guard
    from traceml.capture.import_hooks import register_post_import_hook

    # A failing door with no owner turns tracing off for the process (traceml.capture.guard).
    guard.on_unowned_failure(deactivate)

    for module_name, target in (INTEGRATION_HOOKS if hooks is None else hooks).items():
        register_post_import_hook(module_name, _deferred(target))


def _deferred(target: str):
    module_name, _, function_name = target.partition(":")

    def hook(module):
        if _state.settings is None:
            return  # tracing was switched off (an earlier door failed): leave the library be
        import importlib

        handler = getattr(importlib.import_module(module_name), function_name)
        handler(module)

    return hook


def active_settings() -> Settings | None:
    """The settings tracing runs with in this process, or None when it does not trace."""
    return _state.settings


def activation_source() -> str | None:
    return _state.source


def activate_manually(settings: Settings) -> None:
    """Used by ``init()``: trace with explicit settings in a process started without TRACEML."""
    with _lock:
        _state.activated = True
        _state.role = ROLE_WORKER
        _state.settings = settings
        _state.source = "init"
    settings_module.pin_run_name(settings)
    register_integrations()


def deactivate() -> None:
    """Tracing off for the rest of this process (traceml.capture.guard, after a failure no callback
    owns): every later door finds no settings and leaves the training alone."""
    with _lock:
        _state.settings = None
        if _state.source is not None:
            _state.source = TURNED_OFF  # a later traceml.init() does not turn it on again


def reset_for_tests() -> None:
    with _lock:
        _state.activated = False
        _state.role = None
        _state.settings = None
        _state.source = None
