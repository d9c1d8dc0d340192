#!/usr/bin/env bash
# Install what the tests need (launch/install_system.sh: Debian packages; launch/install.sh:
# .venv with the CPU stack; launch/install_hub.sh: .venv-verifiers) and run the suite.
#   bash tests/run.sh                 # everything
#   bash tests/run.sh -k swap -x      # any pytest arguments
# Two pytest-xdist workers share the 2 cores (a file's tests run on one worker, the slowest files
# first; a test marked `alone` runs with nothing beside it): MEGAGRPO_TEST_WORKERS=0 runs the
# tests one at a time in this process. The run's folder is MEGAGRPO_TEST_BASETEMP (default
# /tmp/megagrpo-suite, emptied as the run starts): a passed test's own folder goes as it ends
# (pytest.ini), the shared fixtures (the tiny model, the converted SmolLM2) stay for
# tests/run_unprivileged.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install_system.sh
MEGAGRPO_EXTRAS=test MEGAGRPO_OFFLOAD_OPS=1 bash launch/install.sh  # pytest, trl, wandb; CPU Adam for the offload tests
bash launch/install_hub.sh verifiers  # .venv-verifiers: the verifiers environment tests (tests/test_hubs.py)
export PYTHONUNBUFFERED=1
# the workers' jobs share the 2 cores: their OpenMP threads wait passively, as the ranks of one
# node do (megagrpo/__init__.py sets it only where a launcher started several ranks)
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec .venv/bin/python -m pytest -v --durations=15 --timeout=900 -n "${MEGAGRPO_TEST_WORKERS:-2}" \
  --dist loadfile --no-loadscope-reorder --basetemp "${MEGAGRPO_TEST_BASETEMP:-/tmp/megagrpo-suite}" tests "$@"
