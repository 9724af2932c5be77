"""scripts/env.sh says what it installs before installing it, and scripts/demo.sh installs no
system packages (issue 25). Real bash, with a PATH where tmux and chromium are missing and
apt-get is a recorder, in a copy of the scripts whose virtualenv is already up to date."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sandbox(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("pyproject.toml", "traceml_bootstrap.pth", "traceml_bootstrap.py"):
        shutil.copy(ROOT / name, repo / name)
    for extra in ROOT.glob("traceml_bootstrap.*"):
        shutil.copy(extra, repo / extra.name)
    shutil.copy(ROOT / "scripts" / "env.sh", repo / "scripts" / "env.sh")
    venv_bin = repo / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text("#!/bin/sh\nexit 0\n")
    (venv_bin / "python").chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("cat", "sha256sum", "cut", "dirname", "id", "bash", "sh"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    (bin_dir / "apt-get").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/apt-calls\n")
    (bin_dir / "apt-get").chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    # The virtualenv is up to date: the same stamp env.sh computes.
    stamp = subprocess.run(
        ["bash", "-c", "cat pyproject.toml scripts/env.sh traceml_bootstrap.* | sha256sum"],
        cwd=repo, env=env, capture_output=True, text=True, check=True,
    ).stdout.split()[0]  # fmt: skip
    (repo / ".venv" / ".traceml-installed").write_text(stamp + "\n")
    return repo, env


def test_env_sh_says_what_it_installs_before_installing(tmp_path):
    if os.getuid() != 0:
        return  # without root env.sh only says the tools are missing
    repo, env = sandbox(tmp_path)
    done = subprocess.run(
        ["bash", "scripts/env.sh"], cwd=repo, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    said = done.stdout
    assert "installing tmux chromium with apt-get" in said
    assert "TRACEML_SYSTEM_TOOLS=0" in said  # and how to skip it
    assert "install" in (tmp_path / "apt-calls").read_text()


def test_demo_installs_no_system_packages(tmp_path):
    repo, env = sandbox(tmp_path)
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert "TRACEML_SYSTEM_TOOLS=0 bash scripts/env.sh" in demo
    done = subprocess.run(
        ["bash", "scripts/env.sh"],
        cwd=repo,
        env={**env, "TRACEML_SYSTEM_TOOLS": "0"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "apt-calls").exists()
    assert "apt-get" not in done.stdout and "up to date" in done.stdout
