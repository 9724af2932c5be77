"""Is the per-step cost worse than at an older commit? Plain, traced now and traced at COMMIT,
on the Lightning stress loop, every variant once per round in rotating order, in one run.

The older traceml runs from a git worktree of COMMIT (made under the temporary directory),
activated at interpreter start by a ``sitecustomize`` that puts it first on ``sys.path`` (both
the old ``traceml.bootstrap`` and today's ``traceml.capture.bootstrap`` layouts); the stress
script, the loop timer and the venv are today's, so only traceml differs.

    python benchmarks/overhead_vs_commit.py fd29c30 --rounds 7 --clock p25
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from _common import PYTHON, ROOT, TINY, clean_env, run, values

SITECUSTOMIZE = """
import importlib, os, sys
if os.environ.get("OVERHEAD_OLD_TREE"):
    sys.path.insert(0, os.environ["OVERHEAD_OLD_TREE"])
    os.environ["TRACEML"] = "1"  # set only now: the installed start-up hook stays asleep
    for name in ("traceml.capture.bootstrap", "traceml.bootstrap"):
        try:
            bootstrap = importlib.import_module(name)
            break
        except ImportError:
            continue
    assert bootstrap.__file__.startswith(os.environ["OVERHEAD_OLD_TREE"]), bootstrap.__file__
    bootstrap.activate()
"""
FIELDS = {"wall": "seconds", "cpu": "cpu_seconds", "p25": "p25_seconds"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("commit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--clock", choices=sorted(FIELDS), default="p25")
    args = parser.parse_args()
    field = FIELDS[args.clock]
    with tempfile.TemporaryDirectory(prefix="traceml-vs-commit-") as tmp:
        work = Path(tmp)
        old_tree = work / "old"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old_tree), args.commit],
            check=True,
            capture_output=True,
        )
        try:
            site = work / "site"
            site.mkdir()
            (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
            per_batch = measure(work, old_tree, site, args.rounds, args.batches, field)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_tree)],
                capture_output=True,
            )
    report(per_batch, args.commit, args.clock)


def measure(work: Path, old_tree: Path, site: Path, rounds: int, batches: int, field: str):
    names = ["plain", "now", "old"]
    per_batch: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        order = names[index % 3 :] + names[: index % 3]
        for name in order:
            run_name = f"{name}{index}"
            base = {
                "LOOP_TIMER": "1",
                "TINY_VALIDATE": 0,
                "TINY_BATCHES": batches,
                "RFD_WORKDIR": work / f"work-{run_name}",
            }
            traced = {"TRACEML_REPORT": "0", "TRACEML_LOGS_DIR": work / "logs"}
            if name == "now":
                env = clean_env(**base, **traced, TRACEML="1", TRACEML_RUN_NAME=run_name)
            elif name == "old":
                env = clean_env(
                    **base,
                    **traced,
                    TRACEML_RUN_NAME=run_name,
                    OVERHEAD_OLD_TREE=old_tree,
                    PYTHONPATH=site,
                )
            else:
                env = clean_env(**base)
            result = run([PYTHON, TINY], env, work)
            if result.returncode != 0:
                raise RuntimeError(f"{name}: exit {result.returncode}\n{result.stderr[-2000:]}")
            if name != "plain" and not list((work / "logs" / run_name).glob("ranks/rank_*")):
                raise RuntimeError(f"{name}: not traced\n{result.stderr[-2000:]}")
            timer = values(result.stdout, "LOOP_TIMER")
            per_batch[name].append(timer[field] / timer["batches"] * 1e6)
        print(
            f"round {index}: "
            + ", ".join(f"{n} {per_batch[n][-1]:.0f} us" for n in names)
            + " per batch",
            flush=True,
        )
    return per_batch


def report(per_batch: dict[str, list[float]], commit: str, clock: str) -> None:
    plain = per_batch["plain"]
    median_plain = statistics.median(plain)
    print(f"stress loop, {clock} clock, {len(plain)} rounds; plain {median_plain:.0f} us per batch")
    for name, label in (("now", "traced now"), ("old", f"traced at {commit}")):
        added = [t - p for p, t in zip(plain, per_batch[name], strict=True)]
        print(
            f"  {label}: added per batch median {statistics.median(added):.1f} us "
            f"(min {min(added):.1f}, max {max(added):.1f})"
        )
    diff = [n - o for n, o in zip(per_batch["now"], per_batch["old"], strict=True)]
    print(
        f"  now - {commit}, per batch: median {statistics.median(diff):.1f} us "
        f"(min {min(diff):.1f}, max {max(diff):.1f}; negative: cheaper now)"
    )


if __name__ == "__main__":
    main()
