#!/usr/bin/env bash
# The main job: install everything (once), then train RF-DETR Nano for one epoch on a synthetic
# dataset, on the CPU, under `traceml run`, and print the diagnosis.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
out=$(mktemp -d "${TMPDIR:-/tmp}/traceml-demo.XXXXXX")
trap 'rm -rf "$out"' EXIT
.venv/bin/traceml run examples/integrations/rfdetr_minimal.py --logs-dir "${TRACEML_DEMO_LOGS_DIR:-logs}" \
  --args --demo --output-dir "$out/rfdetr" --epochs 1 --accelerator cpu "$@"
