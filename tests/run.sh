#!/usr/bin/env bash
# Install what the tests need (launch/install_system.sh: Debian packages; launch/install.sh:
# .venv with the CPU stack) and run the suite.
#   bash tests/run.sh                 # everything
#   bash tests/run.sh -k swap -x      # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install_system.sh
MEGAGRPO_EXTRAS=test MEGAGRPO_OFFLOAD_OPS=1 bash launch/install.sh  # pytest, trl, wandb; CPU Adam for the offload tests
export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -v --durations=15 --timeout=900 tests "$@"
