#!/usr/bin/env bash
# The main job: install the Python packages (once, into ./.venv; no system packages), then train
# RF-DETR Nano for one epoch on a synthetic dataset, on the CPU, under `traceml run`, and print
# the diagnosis. Files: the run directory logs/rfdetr_minimal-<time>/ (rank file and summary,
# well under 1 MB); the dataset and RF-DETR's checkpoints (about 0.7 GB) go to a temporary
# directory that is removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
TRACEML_SYSTEM_TOOLS=0 bash scripts/env.sh
out=$(mktemp -d "${TMPDIR:-/tmp}/traceml-demo.XXXXXX")
trap 'rm -rf "$out"' EXIT
.venv/bin/traceml run examples/integrations/rfdetr_minimal.py --logs-dir "${TRACEML_DEMO_LOGS_DIR:-${TRACEML_LOGS_DIR:-logs}}" \
  --args --demo --output-dir "$out/rfdetr" --epochs 1 --accelerator cpu "$@"
