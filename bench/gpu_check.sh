#!/usr/bin/env bash
# The GPU checks, as one prepared run for a machine with an NVIDIA GPU (no internet needed): the
# tests marked `gpu_check` (pytest.ini) in tests/test_gpu_checks.py (packed log-probs, SDPA and
# flash-attn; NCCL collectives; a vLLM engine's sleep/wake-up around a train step and its weight
# sync), tests/test_train_configurations.py (bf16 ZeRO-3 through the DeepSpeed launcher against
# float32) and tests/test_rollout_sharded_generator.py (vLLM at tp=2 against tp=1, 2 GPUs).
# The ordinary suite runs the same tests on CPU; here they run on CUDA where torch sees it.
#
#   bash bench/gpu_check.sh [pytest arguments, e.g. -k collectives]
#
# pytest does the work: each test under pytest-timeout's limit (GPU_CHECK_TEST_TIMEOUT_S: 300 s
# with a GPU, 900 without), CUDA-only parts and absent packages skipped with their reason
# ("missing: flash_attn"; -rs lists them), numbers recorded with record_property into
# --junitxml, which bench/gpu_check_json.py turns into one JSON: $OUT/gpu_check.json when OUT is set, else bench/results/gpu_check.json
# (GPU_CHECK_OUT overrides both). The whole run stays under GPU_CHECK_BUDGET_S (570 s with a GPU;
# 1800 without, where every check runs its CPU part): past it `timeout` interrupts pytest
# (SIGINT: its session still ends and writes the XML). Nothing is downloaded: wheels in
# GPU_CHECK_WHEELS (default .whl/, if there; bench/gpu_wheels.sh makes them) are installed first
# with pip --no-index into the run's folder. Exit code: pytest's (0 when nothing failed; skips
# do not count), 124 when the budget stopped pytest, 1 without a JSON.
#
# Environment: GPU_CHECK_PYTHON (default: the first of .venv/bin/python and python3 whose torch
# sees CUDA, else the first that has torch), GPU_CHECK_WORK (pytest's temporary folders and the
# XML; default a new /tmp/gpu_check.*).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
START=$(date +%s)
WORK="${GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}"
mkdir -p "$WORK"
if [ -n "${GPU_CHECK_OUT:-}" ]; then RESULT="$GPU_CHECK_OUT"
elif [ -n "${OUT:-}" ]; then RESULT="$OUT/gpu_check.json"
else RESULT="$ROOT/bench/results/gpu_check.json"; fi
mkdir -p "$(dirname "$RESULT")"
TESTS=(tests/test_gpu_checks.py tests/test_train_configurations.py tests/test_rollout_sharded_generator.py)

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
       --target "$WORK/site" "$WHEELS"/*.whl > "$WORK/wheels.log" 2>&1; then
    SITE="$WORK/site:"
    echo "gpu_check: installed the wheels in $WHEELS into $WORK/site"
  else
    echo "gpu_check: installing the wheels in $WHEELS failed (see $WORK/wheels.log)"
  fi
fi
export PYTHONPATH="${SITE}$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
# every job and rank starts cold: the tests' warm servers preload vLLM's CPU modules (tests/conftest.py)
export MEGAGRPO_TEST_COLD_RANKS=1
# nothing is fetched: local model folders only, no usage statistics
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  BUDGET="${GPU_CHECK_BUDGET_S:-570}" TEST_TIMEOUT="${GPU_CHECK_TEST_TIMEOUT_S:-300}"
  echo "gpu_check: CUDA: $("$PY" -c 'import torch; print(torch.cuda.device_count(), "x", torch.cuda.get_device_name(0))')"
else
  BUDGET="${GPU_CHECK_BUDGET_S:-1800}" TEST_TIMEOUT="${GPU_CHECK_TEST_TIMEOUT_S:-900}"
  echo "gpu_check: torch sees no CUDA device: each check runs its CPU part (as the ordinary suite does);"
  echo "gpu_check: its CUDA-only parts are skipped, with their reasons in pytest's short summary (-rs)"
fi
echo "gpu_check: runs the tests marked gpu_check in ${TESTS[*]}"
LIMIT=(--timeout="$TEST_TIMEOUT")
if ! "$PY" -c "import pytest_timeout" >/dev/null 2>&1; then  # bench/gpu_wheels.sh carries it
  LIMIT=()
  echo "gpu_check: missing: pytest-timeout: the tests run without a limit each; the run's budget still holds"
fi
LEFT=$(( BUDGET - ($(date +%s) - START) - 20 ))  # 20 s for the JSON
[ "$LEFT" -lt 30 ] && LEFT=30                      # (`timeout 0` would mean no limit at all)
rm -f "$RESULT" "$WORK/junit.xml"
# --foreground: the SIGINT reaches pytest alone (once), whose session then ends and writes the XML
timeout --foreground -s INT -k 30 "$LEFT" "$PY" -m pytest -m gpu_check -v -rs --tb=short -p no:cacheprovider \
  "${LIMIT[@]}" --basetemp="$WORK/tmp" --junitxml="$WORK/junit.xml" \
  "${TESTS[@]}" "$@" < /dev/null
RC=$?
"$PY" bench/gpu_check_json.py "$WORK/junit.xml" "$RESULT" --exit-code "$RC" \
  || { echo "gpu_check: no junit XML (pytest exited $RC; work folder $WORK)" >&2; }
[ -f "$RESULT" ] || { echo "gpu_check: no result written" >&2; exit 1; }
echo "== $RESULT ($(( $(date +%s) - START )) s in all; pytest's exit code $RC)"
cat "$RESULT"
exit "$RC"
