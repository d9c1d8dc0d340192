#!/usr/bin/env bash
# The GPU checks, as one prepared run for a machine with an NVIDIA GPU (no internet needed):
# vLLM sleep/wake around a train step, flash-attn packed log-probs against SDPA padded ones,
# 2 bf16 ZeRO-3 GRPO steps through the DeepSpeed launcher, weight-sync GB/s against a
# device-to-device copy, NCCL collectives. They are the tests of tests/test_gpu.py (marker gpu;
# the checks themselves: bench/gpu_check.py), run by tests/helpers/gpu_report.py: the `env` step,
# then `pytest -m gpu tests/test_gpu.py`, each check in its own process under its time limit,
# with a plugin that writes the JSON. The whole run stays under GPU_CHECK_BUDGET_S (580 s).
#
#   bash bench/gpu_check.sh [pytest arguments, e.g. -k nccl]
#
# Writes one JSON: $OUT/gpu_check.json when OUT is set, else bench/results/gpu_check.json
# (GPU_CHECK_OUT overrides both), and prints it at the end. Nothing is downloaded: a check whose
# packages are absent (vllm's CUDA build, flash_attn, deepspeed, ...) says "missing: ..." and
# without a CUDA device every check says "no CUDA: ...". Wheels in GPU_CHECK_WHEELS (default
# .whl/, if there; bench/gpu_wheels.sh makes them) are installed first with pip --no-index into
# the run's folder. Exit code:
# pytest's (0 when no check failed; skipped ones do not count), 1 without pytest or without a
# JSON, 124 when `timeout` stopped the runner.
#
# Environment: GPU_CHECK_PYTHON (the interpreter; default: the first of .venv/bin/python and
# python3 whose torch sees CUDA, else the first that has torch), GPU_CHECK_WORK (models, runs
# and logs; default a new /tmp/gpu_check.*), GPU_CHECK_BUDGET_S, GPU_CHECK_SYNC_LAYERS (8).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
BUDGET="${GPU_CHECK_BUDGET_S:-580}"
START=$(date +%s)
WORK="${GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}"
mkdir -p "$WORK/logs" "$WORK/parts"
if [ -n "${GPU_CHECK_OUT:-}" ]; then RESULT="$GPU_CHECK_OUT"
elif [ -n "${OUT:-}" ]; then RESULT="$OUT/gpu_check.json"
else RESULT="$ROOT/bench/results/gpu_check.json"; fi

pick_python() {
  local candidates=() py
  [ -n "${GPU_CHECK_PYTHON:-}" ] && { echo "$GPU_CHECK_PYTHON"; return; }
  [ -x .venv/bin/python ] && candidates+=(.venv/bin/python)
  command -v python3 >/dev/null 2>&1 && candidates+=(python3)
  for py in "${candidates[@]}"; do
    if timeout 60 "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
      echo "$py"; return
    fi
  done
  for py in "${candidates[@]}"; do
    if timeout 60 "$py" -c "import torch" >/dev/null 2>&1; then echo "$py"; return; fi
  done
  echo "${candidates[0]:-python3}"
}
PY="$(pick_python)"
echo "gpu_check: python $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1)), work folder $WORK"

# Install what is reachable: wheels carried beside the repository, never the network.
SITE=""
WHEELS="${GPU_CHECK_WHEELS:-.whl}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  if timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
       --target "$WORK/site" "$WHEELS"/*.whl > "$WORK/logs/wheels.log" 2>&1; then
    SITE="$WORK/site:"
    export GPU_CHECK_WHEELS_INSTALLED="$(cd "$WHEELS" && ls -- *.whl | tr '\n' ' ')"
    echo "gpu_check: installed the wheels in $WHEELS into $WORK/site"
  else
    echo "gpu_check: installing the wheels in $WHEELS failed (see $WORK/logs/wheels.log)"
  fi
fi
export PYTHONPATH="${SITE}$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# nothing is fetched: local model folders only, no usage statistics
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

LEFT=$(( BUDGET - ($(date +%s) - START) ))   # what the wheels and the interpreter's choice left
[ "$LEFT" -lt 30 ] && LEFT=30                # (`timeout 0` would mean no limit at all)
rm -f "$RESULT"
# the runner keeps to --budget by itself; `timeout` is for a runner that hangs
timeout -k 15 "$LEFT" "$PY" tests/helpers/gpu_report.py --work "$WORK" --out "$RESULT" \
  --budget $(( LEFT - 15 )) "$@" < /dev/null
RC=$?
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  tar -czf "$OUT/gpu_check_logs.tar.gz" -C "$WORK" logs parts 2>/dev/null || true
fi
[ -f "$RESULT" ] || { echo "gpu_check: no result written (the runner exited $RC; logs: $WORK/logs)" >&2; exit 1; }
echo "== $RESULT (logs: $WORK/logs; $(( $(date +%s) - START )) s in all; exit code $RC)"
cat "$RESULT"
exit "$RC"
