#!/usr/bin/env bash
# The GPU checks, as one prepared run for a machine with an NVIDIA GPU (no internet needed):
# vLLM sleep/wake around a train step, flash-attn packed log-probs against SDPA padded ones,
# 2 bf16 ZeRO-3 GRPO steps through the DeepSpeed launcher, weight-sync GB/s against a
# device-to-device copy, NCCL collectives. Each step runs in its own process under `timeout`;
# the whole run stays under GPU_CHECK_BUDGET_S (580 s). What each step does: bench/gpu_check.py.
#
#   bash bench/gpu_check.sh
#
# Writes one JSON: $OUT/gpu_check.json when OUT is set, else bench/results/gpu_check.json
# (GPU_CHECK_OUT overrides both), and prints it at the end. Nothing is downloaded: a step whose
# packages are absent (vllm's CUDA build, flash_attn, deepspeed, ...) says "missing: ..." and
# without a CUDA device every check says "no CUDA: ...". Wheels in GPU_CHECK_WHEELS (default
# .whl/, if there) are installed first with pip --no-index into the run's folder.
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
: > "$WORK/status.tsv"
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

PLAN="$("$PY" bench/gpu_check.py plan)" || { echo "gpu_check: $PY cannot run bench/gpu_check.py" >&2; exit 1; }
while read -r NAME LIMIT; do
  LEFT=$(( BUDGET - ($(date +%s) - START) - 15 ))   # 15 s kept for the merge
  if [ "$LEFT" -lt 10 ]; then
    printf '%s\tskipped\t0\t0\n' "$NAME" >> "$WORK/status.tsv"
    echo "== $NAME: not run (the ${BUDGET} s budget is spent)"
    continue
  fi
  [ "$LIMIT" -gt "$LEFT" ] && LIMIT=$LEFT
  echo "== $NAME (at most ${LIMIT} s)"
  T0=$(date +%s.%N)
  timeout -k 15 "$LIMIT" "$PY" bench/gpu_check.py step "$NAME" --work "$WORK" --budget "$LIMIT" \
    > "$WORK/logs/$NAME.log" 2>&1 < /dev/null
  RC=$?
  SECS=$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\t%s\n' "$NAME" "$RC" "$SECS" "$LIMIT" >> "$WORK/status.tsv"
  if [ "$RC" -eq 0 ]; then tail -n 1 "$WORK/logs/$NAME.log"
  else echo "gpu_check $NAME: exit code $RC after ${SECS} s (log: $WORK/logs/$NAME.log)"; fi
done <<< "$PLAN"

"$PY" bench/gpu_check.py merge --work "$WORK" --out "$RESULT" || { echo "gpu_check: merge failed" >&2; exit 1; }
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  tar -czf "$OUT/gpu_check_logs.tar.gz" -C "$WORK" logs status.tsv 2>/dev/null || true
fi
echo "== $RESULT (logs: $WORK/logs; $(( $(date +%s) - START )) s in all)"
cat "$RESULT"
