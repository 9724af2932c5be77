"""What does the installed start-up hook cost a Python process?

1. TRACEML unset: ``python -c pass`` in two otherwise identical bare venvs, one with
   ``traceml_bootstrap.pth`` in site-packages and one without, alternating many times.
   Target: < 1 ms added.
2. TRACEML=1: ``python -c "import rfdetr"`` in this project's venv, with and without
   ``TRACEML=1``, alternating; whole-process wall time, and the in-process time of the import
   itself (which shows the cost of the post-import hooks). Target: < 20 ms added.

    python benchmarks/startup.py                   # ~3 minutes
    python benchmarks/startup.py --runs 100 --rfdetr-pairs 4
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
import venv
from pathlib import Path

from _common import PYTHON, ROOT, alternate, clean_env, describe


def wall(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(args, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def pth_cost(runs: int) -> float:
    with tempfile.TemporaryDirectory(prefix="traceml-startup-") as tmp:
        with_pth, without = Path(tmp) / "with", Path(tmp) / "without"
        for target in (with_pth, without):
            venv.EnvBuilder(with_pip=False).create(target)
        site = next((with_pth / "lib").glob("python3*/site-packages"))
        (site / "traceml_bootstrap.pth").write_text((ROOT / "traceml_bootstrap.pth").read_text())
        env = clean_env()
        for _ in range(10):  # warm the page cache
            wall([str(with_pth / "bin" / "python"), "-c", "pass"], env)
            wall([str(without / "bin" / "python"), "-c", "pass"], env)
        print(f"python -c pass, .pth installed vs not, TRACEML unset: {runs} pairs", flush=True)
        a, b = alternate(
            runs,
            lambda: wall([str(with_pth / "bin" / "python"), "-c", "pass"], env),
            lambda: wall([str(without / "bin" / "python"), "-c", "pass"], env),
        )
    diffs = [(x - y) * 1000 for x, y in zip(a, b, strict=True)]
    print(f"  with .pth:    {describe(a, ' ms', 1000)}")
    print(f"  without .pth: {describe(b, ' ms', 1000)}")
    print(f"  added: median of pairwise differences {statistics.median(diffs):+.3f} ms")
    line = (ROOT / "traceml_bootstrap.pth").read_text().strip()
    loops = 100_000
    start = time.perf_counter()
    namespace: dict = {}
    for _ in range(loops):
        exec(line, namespace)
    per_line_us = (time.perf_counter() - start) / loops * 1e6
    print(f"  the .pth line itself, executed in-process: {per_line_us:.2f} us")
    return statistics.median(diffs)


IMPORT_PROBE = (
    "import time; t = time.perf_counter(); import rfdetr; print('IMPORT', time.perf_counter() - t)"
)


def rfdetr_cost(pairs: int) -> tuple[float, float]:
    plain_env = clean_env()
    traced_env = clean_env(TRACEML="1")
    imports: dict[str, list[float]] = {"plain": [], "traced": []}

    def measure(kind: str, env: dict[str, str]) -> float:
        start = time.perf_counter()
        result = subprocess.run(
            [PYTHON, "-c", IMPORT_PROBE], env=env, check=True, capture_output=True, text=True
        )
        elapsed = time.perf_counter() - start
        imports[kind].append(float(result.stdout.split()[-1]))
        return elapsed

    measure("plain", plain_env)  # warm the page cache
    imports["plain"].clear()
    print(f'python -c "import rfdetr", TRACEML=1 vs unset: {pairs} pairs', flush=True)
    traced, plain = alternate(
        pairs,
        lambda: measure("traced", traced_env),
        lambda: measure("plain", plain_env),
        label="import rfdetr",
    )
    wall_diff = statistics.median([(t - p) * 1000 for t, p in zip(traced, plain, strict=True)])
    import_diff = statistics.median(
        [(t - p) * 1000 for t, p in zip(imports["traced"], imports["plain"], strict=True)]
    )
    print(f"  process wall, traced: {describe(traced, ' s')}")
    print(f"  process wall, plain:  {describe(plain, ' s')}")
    print(f"  added wall (median of pairwise differences): {wall_diff:+.1f} ms")
    print(f"  in-process `import rfdetr`, traced: {describe(imports['traced'], ' s')}")
    print(f"  in-process `import rfdetr`, plain:  {describe(imports['plain'], ' s')}")
    print(f"  added to the import itself: {import_diff:+.1f} ms")
    activation = statistics.median(
        [
            wall([PYTHON, "-c", "pass"], clean_env(TRACEML="1"))
            - wall([PYTHON, "-c", "pass"], clean_env())
            for _ in range(30)
        ]
    )
    print(f"  activation alone (python -c pass, TRACEML=1 vs unset): {activation * 1000:+.2f} ms")
    return wall_diff, activation * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--rfdetr-pairs", type=int, default=8)
    args = parser.parse_args()
    unset = pth_cost(args.runs)
    rfdetr_wall, activation = rfdetr_cost(args.rfdetr_pairs)
    print(
        f"SUMMARY startup: TRACEML unset {unset:+.3f} ms per process (target < 1 ms); "
        f"TRACEML=1 activation {activation:+.1f} ms, import rfdetr {rfdetr_wall:+.0f} ms "
        "wall (target < 20 ms; single-run noise is larger than that, see medians above)"
    )


if __name__ == "__main__":
    main()
