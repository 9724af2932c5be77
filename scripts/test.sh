#!/usr/bin/env bash
# The test command: install what the tests need (once), lint, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
echo "==> ruff"
.venv/bin/ruff check .
echo "==> import-linter (the process boundary)"
.venv/bin/lint-imports
echo "==> pytest"
exec .venv/bin/python -m pytest "$@"
