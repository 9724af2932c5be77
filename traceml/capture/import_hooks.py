"""Run a callback right after a named module finishes importing.

This is the idea of ``wrapt.register_post_import_hook``, written small on purpose: importing
wrapt 2.x pulls in asyncio and importlib.metadata (about 60 ms on a 2-core machine, measured
with ``python -X importtime -c "import wrapt"``), and this module is loaded at interpreter
start in every ``TRACEML=1`` process, including ones that never train. Until a watched module
is imported the only cost is one dictionary look-up per import. wrapt itself is still used, later,
for the wrapping (it keeps signatures and introspection intact).
"""

from __future__ import annotations

import _thread
import sys

# typing costs ~8 ms to import at start-up; annotations are strings (PEP 563) anyway.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType

Hook = "Callable[[ModuleType], None]"

_lock = _thread.RLock()
_pending: dict[str, list[Hook]] = {}
_finder: _PostImportFinder | None = None


def register_post_import_hook(name: str, hook: Hook) -> None:
    """Call ``hook(module)`` once ``name`` is imported, or at once if it already is."""
    global _finder
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _pending.setdefault(name, []).append(hook)
            if _finder is None:
                _finder = _PostImportFinder()
                sys.meta_path.insert(0, _finder)
    if module is not None:
        hook(module)


def pending_hooks() -> dict[str, int]:
    """How many hooks wait on each module name (for tests and diagnostics)."""
    with _lock:
        return {name: len(hooks) for name, hooks in _pending.items()}


def _fire(module: ModuleType) -> None:
    """The hook runner: every hook waiting on ``module``, each guarded on its own."""
    from traceml.capture.guard import guarded_call

    hooks = guarded_call(_RUNNER, "the import hook runner", _take_hooks, module) or ()
    name = module.__name__
    # A module may replace itself in sys.modules while executing; hooks want the final object.
    module = sys.modules.get(name, module)
    for hook in hooks:
        # Never breaks the user's import.
        guarded_call(_IMPORT_HOOK, f"the import hook for {name}", hook, module)


def _take_hooks(module: ModuleType) -> list[Hook]:
    with _lock:
        return _pending.pop(module.__name__, [])


# Entry points (traceml.capture.guard) by name: registered there, called through guarded_call.
_IMPORT_HOOK = "import hook"
_RUNNER = "import_hooks.runner"
_FINDER = "import_hooks.finder"
_LOADER = "import_hooks.loader"


class _PostImportFinder:
    """A meta path finder (the protocol is duck-typed; importlib.abc costs ~8 ms to import).

    Between the import statement and the module's code: finding the spec is delegated to the
    other finders as untraced (their errors are the import's); traceml's part, putting a
    loader in front of the module's own, is guarded and leaves the spec as found if it fails.
    """

    def __init__(self) -> None:
        self._resolving: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _pending or fullname in self._resolving:
            return None
        self._resolving.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._resolving.discard(fullname)
        if spec is None or spec.loader is None or isinstance(spec.loader, _ChainedLoader):
            return spec
        from traceml.capture.guard import guarded_call

        guarded_call(_FINDER, "the import hook finder", _chain_loader, spec)
        return spec


def _chain_loader(spec: ModuleSpec) -> None:
    spec.loader = _ChainedLoader(spec.loader)


class _ChainedLoader:
    """The module's own loader runs the module exactly once; traceml's parts before (giving
    the module its real loader back) and after (the hooks) are guarded."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader

    def __getattr__(self, name: str):
        # The rest of the loader's protocol (get_code, get_source, is_package, the resource
        # reader...) is the module's own loader's: ``importlib.util.find_spec(...).loader`` of
        # a watched module not yet imported is this object, and runpy / pkgutil call those.
        if name == "_loader":  # (not set yet: a copy being made)
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        from traceml.capture.guard import guarded_call

        guarded_call(_LOADER, "the import hook loader", self._show_real_loader, module)
        self._loader.exec_module(module)  # the module's own code and errors, untouched
        _fire(module)

    def _show_real_loader(self, module: ModuleType) -> None:
        # The module must see its real loader (importlib.resources, pkgutil and reloads use it).
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
