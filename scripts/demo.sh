#!/usr/bin/env bash
# The main job for a newcomer: set up .venv, then start a real local 3-node
# cluster, write through it, read back from every replica, kill the leader,
# and stop everything again.
set -euo pipefail
cd "$(dirname "$0")/.."
# The demo needs no Spark or benchmark extras; the test command installs those.
DLEDGER_EXTRAS=${DLEDGER_EXTRAS:-dev} bash scripts/setup.sh
.venv/bin/python -m dledger_app.demo "$@"
