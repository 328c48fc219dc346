#!/usr/bin/env bash
# Creates .venv at the repo root and installs the project with the extras named
# in $DLEDGER_EXTRAS (default: dev,bench,spark). Idempotent and quiet when up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)-${DLEDGER_EXTRAS:-dev,bench,spark}
if [ ! -f "$stamp" ]; then
  echo "==> installing dledger-py[${DLEDGER_EXTRAS:-dev,bench,spark}] into .venv"
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[${DLEDGER_EXTRAS:-dev,bench,spark}]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
