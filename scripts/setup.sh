#!/usr/bin/env bash
# Creates .venv at the repo root and installs the project with the extras named
# in $DLEDGER_EXTRAS (default: dev,bench,spark; the demo asks for dev only).
# Says what it installs, prints a line per package and one every 20 s while
# it waits; idempotent and silent when .venv is already up to date.
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
  # What each extra brings, so a first run says what it waits for.
  about="the project (aiohttp, lmdb, orjson: ~15 MB)"
  case ",$extras," in *,dev,*) about="$about, test tools (pytest, hypothesis, ruff, mypy: ~90 MB)" ;; esac
  case ",$extras," in *,bench,*) about="$about, PySyncObj and matplotlib (~40 MB)" ;; esac
  case ",$extras," in *,spark,*) about="$about, PySpark and pyarrow (~450 MB download, ~700 MB on disk)" ;; esac
  echo "==> installing dledger-py[$extras] into .venv: $about"
  case ",$extras," in
    *,spark,*) echo "    (a first install takes 2-5 minutes, mostly downloading PySpark)" ;;
    *) echo "    (a first install takes about a minute)" ;;
  esac
  started=$SECONDS
  # A line every 20 s while pip is quiet (a large download, building wheels).
  (while sleep 20; do echo "    ... still installing ($((SECONDS - started)) s)"; done) &
  ticker=$!
  trap 'kill "$ticker" 2>/dev/null || true' EXIT
  # setuptools' "Editable installation" warning box is advice for packagers,
  # not for someone running this script.
  export PYTHONWARNINGS="ignore:Editable installation"
  .venv/bin/python -m pip install --quiet --upgrade pip
  # One line per package as pip gets to it; errors (stderr) pass through.
  .venv/bin/python -m pip install --progress-bar off -e ".[$extras]" \
    | sed -u -n -E -e 's/ \(from [^)]*\)$//' \
      -e 's/^(Collecting|Downloading|Installing collected packages|Successfully installed)/    \1/p'
  kill "$ticker" 2>/dev/null || true
  trap - EXIT
  rm -f .venv/.installed-*
  touch "$stamp"
  echo "==> .venv ready ($((SECONDS - started)) s)"
fi
# The power-loss and disk-error nemeses mount a FUSE filesystem (pyfuse3,
# built from source over Debian's libfuse3: .ci/run installs fuse3,
# libfuse3-dev, pkg-config and gcc when it runs as root). Optional: without
# it those nemeses and their tests skip and say why.
case ",$extras," in
  *,dev,*)
    if ! .venv/bin/python -c "import pyfuse3, trio" >/dev/null 2>&1; then
      if command -v pkg-config >/dev/null 2>&1 && pkg-config --exists fuse3 2>/dev/null \
        && command -v cc >/dev/null 2>&1; then
        echo "==> installing the faultfs extra (pyfuse3, trio: the power-loss nemesis's FUSE filesystem)"
        PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install --quiet \
          --progress-bar off -e ".[faultfs]" \
          || echo "    pyfuse3 did not install: the power-loss and disk-error tests will skip"
      else
        echo "==> no libfuse3 headers (Debian: fuse3 libfuse3-dev pkg-config): the power-loss" \
          "and disk-error nemeses will be skipped"
      fi
    fi
    ;;
esac
