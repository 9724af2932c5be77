"""Activation: process roles, once-only, fail-open, and the post-import hook mechanism."""

import sys
import types

import pytest

from traceml import console
from traceml.capture import bootstrap, import_hooks


@pytest.fixture(autouse=True)
def clean_state():
    bootstrap.reset_for_tests()
    console.reset_for_tests()
    yield
    bootstrap.reset_for_tests()
    console.reset_for_tests()


@pytest.mark.parametrize(
    ("argv", "role"),
    [
        (["python", "train.py"], "worker"),
        (["python", "-u", "train.py", "-m", "torch.distributed.run"], "worker"),
        (["python", "/venv/bin/torchrun", "--nproc-per-node", "2", "train.py"], "agent"),
        (["python", "-m", "torch.distributed.run", "train.py"], "agent"),
        (["python", "-mtorch.distributed.launch", "train.py"], "agent"),
        (["python", "-m", "mypkg.train"], "worker"),
        (
            [
                "python",
                "-c",
                "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)",
                "--multiprocessing-fork",
            ],
            "helper",
        ),
        (["python", "-c", "from multiprocessing.resource_tracker import main;main(5)"], "helper"),
        (["python", "-c", "import rfdetr"], "worker"),
    ],
)
def test_process_role(argv, role):
    assert bootstrap.process_role(argv) == role


def test_activation_happens_once(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(bootstrap, "register_integrations", lambda hooks=None: calls.append(1))
    env = {"TRACEML": "1", "TRACEML_LOGS_DIR": str(tmp_path)}
    assert bootstrap.activate(env, ["python", "train.py"]) is True
    assert bootstrap.activate(env, ["python", "train.py"]) is True
    assert calls == [1]
    assert bootstrap.active_settings().logs_dir == tmp_path
    # The chosen run name is exported for processes this one starts (Lightning's DDP re-launch).
    assert env["TRACEML_RUN_NAME"] == bootstrap.active_settings().run_name
    assert env["TRACEML_RUN_NAME_DERIVED"] == "1"


def test_agent_only_leaves_a_launch_stamp(monkeypatch):
    monkeypatch.setattr(bootstrap, "register_integrations", lambda hooks=None: pytest.fail())
    env = {"TRACEML": "1"}
    assert bootstrap.activate(env, ["python", "-m", "torch.distributed.run", "t.py"]) is False
    assert env["TRACEML_LAUNCH_STAMP"]
    assert bootstrap.active_settings() is None


def test_helper_does_nothing(monkeypatch):
    # ... but wait for a first optimizer step, which only a training there makes
    # (tests/integration/test_any_loop.py: a training started with spawn is named).
    named = []
    monkeypatch.setattr(bootstrap, "_name_helper_training", lambda: named.append(1))
    monkeypatch.setattr(bootstrap, "register_integrations", lambda hooks=None: pytest.fail())
    env = {"TRACEML": "1"}
    code = "from multiprocessing.spawn import spawn_main"
    argv = ["python", "-c", code, "--multiprocessing-fork"]
    assert bootstrap.activate(env, argv) is False
    assert env == {"TRACEML": "1"}
    assert named == [1]


def test_bad_setting_warns_once_and_stays_off(capsys):
    env = {"TRACEML": "1", "TRACEML_TRACE_MAX_STEPS": "abc"}
    assert bootstrap.activate(env, ["python", "t.py"]) is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("traceml: TRACEML_TRACE_MAX_STEPS='abc' is not a whole number")
    assert "untraced" in err
    assert bootstrap.active_settings() is None


def test_unexpected_failure_is_fail_open(monkeypatch, capsys):
    def explode(hooks=None):
        raise RuntimeError("boom")

    monkeypatch.setattr(bootstrap, "register_integrations", explode)
    assert bootstrap.activate({"TRACEML": "1"}, ["python", "t.py"]) is False
    err = capsys.readouterr().err
    assert "could not start (RuntimeError: boom)" in err
    assert err.count("\n") == 1


def test_post_import_hook_fires_after_the_module_is_imported(tmp_path, monkeypatch):
    package = tmp_path / "traceml_hook_probe"
    package.mkdir()
    (package / "__init__.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    import_hooks.register_post_import_hook(
        "traceml_hook_probe", lambda module: seen.append(module.VALUE + 1)
    )
    assert seen == []
    assert import_hooks.pending_hooks().get("traceml_hook_probe") == 1
    import traceml_hook_probe  # noqa: F401

    assert seen == [42]
    assert "traceml_hook_probe" not in import_hooks.pending_hooks()
    module = sys.modules["traceml_hook_probe"]
    # The module keeps its real loader.
    assert "Chained" not in type(module.__loader__).__name__
    assert "Chained" not in type(module.__spec__.loader).__name__
    del sys.modules["traceml_hook_probe"]


def test_a_watched_module_found_before_its_import_has_its_loaders_protocol(tmp_path, monkeypatch):
    # importlib.util.find_spec of a watched module not yet imported returns traceml's loader;
    # runpy and pkgutil call get_code / get_source / is_package on it, which raised
    # AttributeError (helper review, stop 60). The hook still fires at the real import.
    import importlib.util
    import runpy

    (tmp_path / "traceml_hook_runpy.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    import_hooks.register_post_import_hook("traceml_hook_runpy", seen.append)
    try:
        loader = importlib.util.find_spec("traceml_hook_runpy").loader
        assert loader.is_package("traceml_hook_runpy") is False
        assert loader.get_source("traceml_hook_runpy") == "VALUE = 7\n"
        assert loader.get_filename("traceml_hook_runpy").endswith("traceml_hook_runpy.py")
        assert runpy.run_module("traceml_hook_runpy")["VALUE"] == 7
        assert seen == []
        import traceml_hook_runpy

        assert seen == [traceml_hook_runpy]
    finally:
        sys.modules.pop("traceml_hook_runpy", None)


def test_the_rss_reader_closes_its_descriptor():
    # A traced training left /proc/self/statm open after its end (helper review, stop 60).
    import os

    from traceml.capture import rss

    before = set(os.listdir("/proc/self/fd"))
    reader = rss.rss_reader()
    assert reader() > 0
    assert set(os.listdir("/proc/self/fd")) != before
    reader.close()
    assert set(os.listdir("/proc/self/fd")) == before
    assert reader() is None  # the number may name another file now: never read again
    reader.close()  # twice is fine


def test_post_import_hook_fires_at_once_for_an_imported_module():
    fake = types.ModuleType("traceml_already_there")
    sys.modules["traceml_already_there"] = fake
    try:
        seen = []
        import_hooks.register_post_import_hook("traceml_already_there", seen.append)
        assert seen == [fake]
    finally:
        del sys.modules["traceml_already_there"]


def test_a_failing_hook_never_breaks_the_import(tmp_path, monkeypatch, capsys):
    (tmp_path / "traceml_hook_bad.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def bad(module):
        raise ValueError("nope")

    import_hooks.register_post_import_hook("traceml_hook_bad", bad)
    import traceml_hook_bad

    assert traceml_hook_bad.X == 1
    err = capsys.readouterr().err
    assert "the import hook for traceml_hook_bad failed (ValueError: nope)" in err
    del sys.modules["traceml_hook_bad"]


def test_integration_registry_is_lazy():
    # Strings, so integration modules load only when their library does.
    for target in bootstrap.INTEGRATION_HOOKS.values():
        assert isinstance(target, str) and ":" in target


@pytest.mark.parametrize(
    "door", ["import_hooks.finder", "import_hooks.loader", "import_hooks.runner"]
)
def test_a_failing_import_door_still_runs_the_module_exactly_once(
    door, tmp_path, monkeypatch, capsys
):
    from traceml.capture import guard

    name = "traceml_hook_door_" + door.rsplit(".", 1)[1]
    (tmp_path / f"{name}.py").write_text(
        "import builtins\n"
        "builtins.traceml_door_runs = getattr(builtins, 'traceml_door_runs', 0) + 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(guard, "_inject", door)
    import builtins

    builtins.traceml_door_runs = 0
    try:
        import_hooks.register_post_import_hook(name, lambda module: None)
        module = __import__(name)
        assert builtins.traceml_door_runs == 1
        assert module.__loader__ is module.__spec__.loader
        assert "Chained" not in type(module.__loader__).__name__ or door == "import_hooks.loader"
        assert f"InjectedFault: fault injected into {door}" in capsys.readouterr().err
    finally:
        del builtins.traceml_door_runs
        sys.modules.pop(name, None)
        import_hooks._pending.pop(name, None)


class CostOwner:
    own_cost_ns = 0

    def _entry_failed(self, name, exc):
        raise AssertionError(name)


def test_own_cost_is_counted_per_thread():
    """An entry point on another thread, while the training thread is inside one, still adds
    its time to its own owner (the depth was process-wide: it added nothing)."""
    import threading

    from traceml.capture import guard

    inside, done = threading.Event(), threading.Event()

    @guard.entry_point("test.blocking_door", "a door that waits")
    def blocking(owner):
        inside.set()
        done.wait(10)

    @guard.entry_point("test.quick_door", "a door on another thread")
    def quick(owner):
        guard.clock_ns()

    try:
        training, background = CostOwner(), CostOwner()
        thread = threading.Thread(target=blocking, args=(training,))
        thread.start()
        assert inside.wait(10)
        quick(background)
        done.set()
        thread.join(10)
        assert background.own_cost_ns > 0 and training.own_cost_ns > 0
    finally:
        guard.ENTRY_POINTS.pop("test.blocking_door", None)
        guard.ENTRY_POINTS.pop("test.quick_door", None)


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("str() of this exception fails")


def test_a_failure_whose_message_cannot_be_formatted_stays_inside_traceml(monkeypatch):
    from traceml.capture import guard

    switched = []
    monkeypatch.setattr(guard, "_process_switches", [lambda: switched.append(True)])

    @guard.entry_point("test.unprintable_door", "a door raising an unprintable error", owner_arg=-1)
    def door():
        raise Unprintable()

    try:
        assert door() is None  # nothing raised into the caller
        assert switched == [True]
    finally:
        guard.ENTRY_POINTS.pop("test.unprintable_door", None)


def test_a_failure_with_no_owner_turns_tracing_off_for_the_process(monkeypatch):
    from traceml.capture import guard

    monkeypatch.setattr(guard, "_process_switches", [])
    bootstrap.reset_for_tests()
    try:
        bootstrap._state.settings = object()
        bootstrap.register_integrations({})
        guard.failed(None, "test door", ValueError("x"))
        assert bootstrap.active_settings() is None
    finally:
        bootstrap.reset_for_tests()
