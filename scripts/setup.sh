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
extras=${DLEDGER_EXTRAS:-dev,bench,spark}
hash=$(cat pyproject.toml | sha1sum | cut -c1-12)
stamp=.venv/.installed-$hash-$extras
# Up to date when an install of this pyproject.toml covered every extra asked
# for (the demo asks for fewer than the tests).
covered=0
for f in .venv/.installed-"$hash"-*; do
  [ -f "$f" ] || continue
  have=",${f##*-$hash-},"
  covered=1
  for x in ${extras//,/ }; do
    case "$have" in *",$x,"*) ;; *) covered=0 ;; esac
  done
  [ $covered = 1 ] && break
done
if [ $covered = 0 ]; then
  echo "==> installing dledger-py[$extras] into .venv"
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[$extras]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
