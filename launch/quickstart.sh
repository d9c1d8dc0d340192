#!/usr/bin/env bash
# The quickstart: install the CPU stack, build the tiny model and the demo task, warm-start it,
# and run a real GRPO job on 2 CPU ranks through the DeepSpeed launcher (ZeRO-3, a vLLM engine
# co-located in each rank). Prints held-out accuracy before and after, and where the logs are.
#
#   bash launch/quickstart.sh                 # everything
#   NUM_RANKS=1 bash launch/quickstart.sh     # one rank
#   bash launch/quickstart.sh grpo.max_steps=80 rollout.engine=hf   # any config override
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR="${RUN_DIR:-runs/tiny}"
NUM_RANKS="${NUM_RANKS:-2}"
MASTER_PORT="${MASTER_PORT:-29500}"

bash launch/install.sh
source .venv/bin/activate
export PYTHONUNBUFFERED=1

if [ ! -f "$RUN_DIR/warm/config.json" ]; then
  echo "== 1/3 demo task and tiny model"
  python tools/make_demo_data.py --out "$RUN_DIR/data"
  python tools/make_tiny_model.py --out "$RUN_DIR/model" --corpus "$RUN_DIR/data/sft.jsonl"
  echo "== 2/3 warm start (supervised, separate step; see tools/warm_start.py)"
  python tools/warm_start.py --model "$RUN_DIR/model" --data "$RUN_DIR/data/sft.jsonl" --out "$RUN_DIR/warm"
fi

echo "== 3/3 GRPO: deepspeed --num_gpus $NUM_RANKS (CPU ranks), ZeRO-3, vLLM co-located"
rm -rf "$RUN_DIR/grpo"  # the quickstart starts over each time (real runs resume: see docs/outputs-and-checkpoints.md)
START=$(date +%s)
deepspeed --num_gpus "$NUM_RANKS" --master_port "$MASTER_PORT" --module megagrpo.train \
  --config configs/tiny_arith.yaml \
  model.name_or_path="$RUN_DIR/warm" data.train_file="$RUN_DIR/data/train.jsonl" \
  data.eval_file="$RUN_DIR/data/eval.jsonl" output_dir="$RUN_DIR/grpo" checkpoint.resume=none "$@"
echo "GRPO took $(( $(date +%s) - START ))s"
python - "$RUN_DIR/grpo/eval_results.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
before, after = r["before"]["rewards/answer_match"], r["after"]["rewards/answer_match"]
print(f"held-out accuracy: {100 * before:.1f}% before GRPO -> {100 * after:.1f}% after")
PY
echo "TensorBoard: tensorboard --logdir $RUN_DIR/grpo/tensorboard"
