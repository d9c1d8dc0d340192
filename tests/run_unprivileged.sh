#!/usr/bin/env bash
# The tests whose code paths differ without root, run again as an unprivileged user, as a SLURM
# job runs: the sandbox (no uid per execution, no cgroups: docs/sandbox.md, Without root), the
# adversarial suite, the hostile-program tests, and a 2-rank GRPO run whose code reward judges
# honest and hostile programs. Run as root after tests/run.sh (it installs what the tests need);
# .ci/run does. It creates the user (MEGAGRPO_TEST_USER, default megagrpo-ci) and lets it read the
# checkout and the interpreter (adding o+x to their folders, /root's included: meant for CI
# machines and the like) and write DeepSpeed's op build folder (the build's lock file).
#   bash tests/run_unprivileged.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "tests/run_unprivileged.sh: run as root (it creates the test user)" >&2; exit 1; }
TEST_USER="${MEGAGRPO_TEST_USER:-megagrpo-ci}"
id -u "$TEST_USER" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$TEST_USER"

traversable() {  # every folder above $1 searchable by others
  local dir
  dir="$(dirname "$(realpath "$1")")"
  while [ "$dir" != / ]; do chmod o+x "$dir"; dir="$(dirname "$dir")"; done
}
traversable "$(pwd)/README.md"
traversable .venv/bin/python
mkdir -p .venv/torch_extensions && chmod -R o+rX . && chmod -R a+rwX .venv/torch_extensions
su "$TEST_USER" -c "git config --global --add safe.directory '$(pwd)'"  # conftest's git status check
# the tiny model and task of tests/run.sh's session, when there is one (building them takes a minute)
TINY="" BUILT="${MEGAGRPO_TEST_BASETEMP:-/tmp/megagrpo-suite}/tiny"
if [ -n "$BUILT" ] && [ -f "$BUILT/warm/config.json" ]; then
  TINY="/tmp/megagrpo-unprivileged-tiny"
  rm -rf "$TINY" && cp -r "$BUILT" "$TINY" && chown -R "$TEST_USER" "$TINY"
fi

exec env -u MEGAGRPO_TEST_LAUNCH_LOG MEGAGRPO_TEST_TINY="$TINY" su "$TEST_USER" -c "cd '$(pwd)' && \
  PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m pytest -v -rs --timeout=900 \
  -p no:cacheprovider tests/test_sandbox.py tests/test_sandbox_modes.py tests/test_rewards_code_adversarial.py \
  tests/test_rewards_hostile.py tests/test_evaluation.py::test_grpo_with_code_reward_and_reward_model $*"
