#!/usr/bin/env bash
# Create (once) and update (when pyproject.toml changes) the project's virtualenv in ./.venv:
# torch 2.14.1 + torchvision 0.29.1 + rfdetr[train] 1.10.1 + lightning + traceml (editable)
# + the test tools. pip, not uv/poetry: pip takes torch from this machine's local wheels.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PYTHON_BIN=${TRACEML_PYTHON:-}
if [ -z "$PYTHON_BIN" ]; then
  if command -v python3.11 >/dev/null 2>&1; then PYTHON_BIN=python3.11; else PYTHON_BIN=python3; fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV with $PYTHON_BIN"
  "$PYTHON_BIN" -m venv "$VENV"
fi

# System tools some tests drive (tmux: the live view in a real terminal; chromium: report.html
# in a real headless browser). Installed once, as root, from the distribution's packages;
# elsewhere those tests skip with a reason. TRACEML_SYSTEM_TOOLS=0 (scripts/demo.sh) skips
# this: the demo needs neither.
need=()
if [ "${TRACEML_SYSTEM_TOOLS:-1}" != 0 ]; then
  command -v tmux >/dev/null 2>&1 || need+=(tmux)
  command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
    || need+=(chromium)
fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "==> the tests drive tmux (the live view in a real terminal) and chromium (report.html"
    echo "    in a headless browser): installing ${need[*]} with apt-get, system-wide, as root"
    echo "    (chromium: a few hundred MB; TRACEML_SYSTEM_TOOLS=0 skips this, those tests skip)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq "${need[@]}" >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "${need[@]}" >/dev/null 2>&1; } \
      || echo "==> could not install ${need[*]}: the tests that need them will be skipped"
  else
    echo "==> ${need[*]} missing and not root: the tests that need them will be skipped"
  fi
fi

stamp="$VENV/.traceml-installed"
# The start-up files are copied into site-packages at install time: a change means reinstall.
want=$(cat pyproject.toml scripts/env.sh traceml_bootstrap.* | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "==> installing into $VENV (pip): traceml (editable) and its test dependencies: torch 2.14.1,"
  echo "    torchvision 0.29.1, rfdetr[train] 1.10.1, lightning, pytest, hypothesis, ruff,"
  echo "    import-linter (about 6 GB; the first run takes a few minutes)"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -e ".[test]"
  echo "$want" > "$stamp"
else
  echo "==> $VENV is up to date"
fi
