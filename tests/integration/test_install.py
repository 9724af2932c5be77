"""The package as users install it: a fresh venv, `pip install .` and `pip install -e .`.

Checks the start-up hook end to end: nothing happens without TRACEML, activation with it, one
warning line for bad settings, no stray start-up errors after uninstall or with a broken install.
"""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import pytest

from procs import ROOT, clean_env

PROBE = (
    "import sys\n"
    "b = sys.modules.get('traceml.capture.bootstrap')\n"
    "hooks = sys.modules.get('traceml.capture.import_hooks')\n"
    "print('traceml loaded:', 'traceml' in sys.modules)\n"
    "print('active:', b is not None and b.active_settings() is not None)\n"
    "print('waiting on:', sorted(hooks.pending_hooks()) if hooks else [])\n"
)


def python_in(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def site_packages(env_dir: Path) -> Path:
    return next((env_dir / "lib").glob("python3*/site-packages"))


def sh(args, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        env=env or clean_env(),
        cwd=cwd,
        timeout=600,
    )


@pytest.fixture(scope="module", params=["wheel", "editable"])
def installed(request, tmp_path_factory):
    env_dir = tmp_path_factory.mktemp(f"venv-{request.param}")
    venv.EnvBuilder(with_pip=True).create(env_dir)
    target = ["-e", str(ROOT)] if request.param == "editable" else [str(ROOT)]
    result = sh([python_in(env_dir), "-m", "pip", "install", "--quiet", *target])
    assert result.returncode == 0, result.stderr[-3000:]
    return env_dir


def test_startup_files_are_installed(installed):
    names = {p.name for p in site_packages(installed).iterdir()}
    assert {"traceml_bootstrap.pth", "traceml_bootstrap.start", "traceml_bootstrap.py"} <= names


def test_nothing_happens_without_traceml(installed, tmp_path):
    result = sh([python_in(installed), "-c", PROBE], cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.splitlines() == [
        "traceml loaded: False",
        "active: False",
        "waiting on: []",
    ]


def test_activation_with_traceml(installed, tmp_path):
    result = sh([python_in(installed), "-c", PROBE], clean_env(TRACEML="1"), tmp_path)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.splitlines() == [
        "traceml loaded: True",
        "active: True",
        "waiting on: ['accelerate.launchers', 'lightning.pytorch', 'pytorch_lightning', "
        "'rfdetr.training', 'torch', 'transformers.trainer']",
    ]
    assert not (tmp_path / "logs").exists()  # activation alone writes nothing


def test_plain_import_prints_nothing_extra(installed, tmp_path):
    result = sh(
        [python_in(installed), "-c", "import json; print('ok')"], clean_env(TRACEML="1"), tmp_path
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "ok\n", "")


def test_broken_setting_is_one_warning_and_the_program_runs(installed, tmp_path):
    env = clean_env(TRACEML="1", TRACEML_TRACE_MAX_STEPS="abc")
    result = sh([python_in(installed), "-c", "print('still running')"], env, tmp_path)
    assert result.returncode == 0
    assert result.stdout == "still running\n"
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("traceml: TRACEML_TRACE_MAX_STEPS='abc' is not a whole")


def test_start_entry_point_does_the_same(installed, tmp_path):
    # Python 3.15+ calls traceml_bootstrap:start instead of running the .pth line. Here the
    # interpreter starts with TRACEML unset (the .pth does nothing) and the call is made by hand.
    code = (
        "import os, sys, traceml_bootstrap\n"
        "traceml_bootstrap.start()\n"
        "print('traceml' in sys.modules)\n"
        "os.environ['TRACEML'] = '1'\n"
        "traceml_bootstrap.start()\n"
        "print(sys.modules['traceml.capture.bootstrap'].active_settings() is not None)\n"
    )
    result = sh([python_in(installed), "-c", code], clean_env(), tmp_path)
    assert (result.stdout, result.stderr) == ("False\nTrue\n", "")


def test_broken_install_never_breaks_python_start(installed, tmp_path):
    # A copy of the .pth next to a site-packages without traceml: as after a botched removal.
    broken = tmp_path / "broken-venv"
    venv.EnvBuilder(with_pip=False).create(broken)
    pth = site_packages(installed) / "traceml_bootstrap.pth"
    (site_packages(broken) / "traceml_bootstrap.pth").write_text(pth.read_text())
    quiet = sh([python_in(broken), "-c", "print('ok')"], clean_env(), tmp_path)
    assert (quiet.stdout, quiet.stderr) == ("ok\n", "")
    loud = sh([python_in(broken), "-c", "print('ok')"], clean_env(TRACEML="1"), tmp_path)
    assert loud.stdout == "ok\n"
    assert "Error processing line" not in loud.stderr
    assert loud.stderr.count("\n") == 1
    assert loud.stderr.startswith("traceml: tracing disabled, could not start")


def test_uninstall_removes_the_startup_hook(installed, tmp_path):
    # Last in this module for each install kind: it removes what the others use.
    result = sh([python_in(installed), "-m", "pip", "uninstall", "--yes", "traceml"])
    assert result.returncode == 0, result.stderr
    names = {p.name for p in site_packages(installed).iterdir()}
    assert not names & {"traceml_bootstrap.pth", "traceml_bootstrap.start", "traceml_bootstrap.py"}
    after = sh([python_in(installed), "-c", "print('ok')"], clean_env(TRACEML="1"), tmp_path)
    assert (after.returncode, after.stdout, after.stderr) == (0, "ok\n", "")
