#!/usr/bin/env bash
# A venv of its own for a hub whose package cannot live in megagrpo's .venv (docs/environments.md):
#   bash launch/install_hub.sh verifiers                     # .venv-verifiers: verifiers, openenv, uv
#   bash launch/install_hub.sh verifiers path/to/my_env      # and an environment package of yours
# verifiers 0.4 pins openai<3, which the agent frameworks in megagrpo's venv do not allow; its
# harness programs run with uv, which it would otherwise fetch with curl; openenv is the OpenEnv
# client (and server kit) its `openenv` taskset drives OpenEnv servers with (0.4.1: what pip
# resolves beside verifiers' mcp pin). megagrpo starts the venv's
# python as the environment's runner (rollout.verifiers_python). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
HUB="${1:-}"
case "$HUB" in
  verifiers) PACKAGES=("verifiers[openenv]==0.4.0" "openenv==0.4.1" "uv==0.13.9") ;;
  *) echo "usage: bash launch/install_hub.sh verifiers [ENVIRONMENT_PACKAGE ...]" >&2; exit 2 ;;
esac
shift
VENV=".venv-$HUB"
PYTHON="${PYTHON:-python3}"
WANT="${PACKAGES[*]} $*"
STAMP="$VENV/.megagrpo-installed"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "megagrpo: $VENV is up to date ($WANT)"
  exit 0
fi
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet "${PACKAGES[@]}" "$@"
echo "$WANT" > "$STAMP"
echo "megagrpo: $VENV holds $WANT (install took $(( $(date +%s) - start )) s)"
