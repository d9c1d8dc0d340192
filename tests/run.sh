#!/usr/bin/env bash
# Install what the tests need (launch/install_system.sh: Debian packages; launch/install.sh:
# .venv with the CPU stack) and run the suite.
#   bash tests/run.sh                 # everything
#   bash tests/run.sh -k swap -x      # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install_system.sh
bash launch/install.sh
export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -v --durations=15 --timeout=900 tests "$@"
