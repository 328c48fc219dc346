#!/usr/bin/env bash
# The project's test command: set up .venv, lint, type-check, run every test
# (unit, simulation, integration with real processes), then a 300-seed
# simulation sweep. CI (.ci/run) runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "==> ruff"
.venv/bin/ruff check .
echo "==> mypy --strict (dledger, dledger_app, broker_adapter, controller, http_api, jepsen_like, pipeline)"
.venv/bin/mypy --strict dledger dledger_app broker_adapter controller http_api jepsen_like pipeline
echo "==> pytest"
.venv/bin/python -m pytest -p no:cacheprovider "$@"
echo "==> simulation sweep: 300 seeds of real nodes, 3- and 5-voter mixes with learners and every fault kind"
# ~1 min on 2 idle cores (~2 min shared).
.venv/bin/python -m dledger.sim --seeds 300 --steps 5000 --first-seed 100001 --jobs 2
