"""List modules over 400 lines and functions over 60 lines in traceml/ (the layout's limits).

Usage: python scripts/code_shape.py [--max-module N] [--max-function N]; exit 1 when any.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def violations(max_module: int = 400, max_function: int = 60) -> list[str]:
    found = []
    for path in sorted((ROOT / "traceml").rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(ROOT)
        lines = source.count("\n") + 1
        if lines > max_module:
            found.append(f"{name}: {lines} lines (module limit {max_module})")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > max_function:
                    found.append(
                        f"{name}:{node.lineno} {node.name}: {length} lines "
                        f"(function limit {max_function})"
                    )
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-module", type=int, default=400)
    parser.add_argument("--max-function", type=int, default=60)
    args = parser.parse_args()
    found = violations(args.max_module, args.max_function)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
