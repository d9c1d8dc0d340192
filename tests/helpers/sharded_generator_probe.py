"""Probe for test_rollout_sharded_generator.py: the vLLM generator at rollout.tensor_parallel_size
t on this job's ranks. Each generator group gets batches of its own, different in size from the
other groups' (two rounds, then the reverse), sampled and greedy; then the engine's weight bytes
on this rank; then a weight sync of other weights (whole and partial) and the log-probs of a
fixed sequence. Writes sharded_rank<r>.json to --out.

    deepspeed --num_gpus 4 tests/helpers/sharded_generator_probe.py --out DIR --model M --data F \
        --generator-tp 2
    python tests/helpers/sharded_generator_probe.py --out DIR --model M --data F --generator-tp 1 --all-batches
"""
import argparse
import json
import os

import torch
from safetensors.torch import load_file

from megagrpo.cluster.distributed import init_distributed
from megagrpo.process_exit import exit_without_teardown
from megagrpo.rollout.generators import VLLMGenerator, sampling_seed
from megagrpo.validation import load_config

# (prompts, completions per prompt, max new tokens) of the batches; group g runs BATCHES[g % 2]
# in round 0 and the other one in round 1, so that the groups' engines step through different work
BATCHES = [(1, 2, 8), (5, 4, 40)]
# the partial stream: whole vLLM layers (q, k and v load into one fused layer, as a LoRA policy sends them)
PERTURBED = (*(f"model.layers.0.self_attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")),
             "model.layers.1.mlp.down_proj.weight")


def batch(prompts, index):
    count, n, max_tokens = BATCHES[index]
    start = 7 * index
    ids = [prompts[i] for i in range(start, start + count)]
    seeds = [sampling_seed(3, index, i) for i in range(start, start + count)]
    return ids, n, seeds, [max_tokens] * count


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--other-model", required=True, help="weights streamed in by the sync")
    p.add_argument("--data", required=True)
    p.add_argument("--generator-tp", type=int, required=True)
    p.add_argument("--all-batches", action="store_true", help="run every group's batches here (the tp 1 reference)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=0)
    args = p.parse_args()
    cfg = load_config("configs/tiny_arith.yaml", [
        f"model.name_or_path={args.model}", f"data.train_file={args.data}", "data.eval_file=null",
        f"rollout.tensor_parallel_size={args.generator_tp}", "rollout.max_new_tokens=40"])
    topology = init_distributed(generator_tp=args.generator_tp)
    generator = VLLMGenerator(cfg, args.model, seed=11 + topology.generator_ranks()[0])
    with open(args.data) as f:
        texts = [json.loads(line)["prompt"] for line in f][:16]
    from megagrpo.policy.models import load_tokenizer
    tokenizer = load_tokenizer(args.model)
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    group = topology.rank // args.generator_tp
    result = {"rank": topology.rank, "group": group, "rounds": []}
    for round_ in range(2):
        indices = [0, 1] if args.all_batches else [(group + round_) % 2]
        for index in indices:
            ids, n, seeds, caps = batch(prompts, index)
            for greedy in (False, True):
                out = generator.generate(ids, n=1 if greedy else n, seeds=seeds, greedy=greedy, max_tokens=caps)
                result["rounds"].append({"batch": index, "greedy": greedy,
                                         "tokens": [[c.token_ids for c in g] for g in out],
                                         "logprobs": [[c.logprobs for c in g] for g in out]})

    def weight_bytes(worker):
        model = worker.model_runner.get_model()
        return sum(t.numel() * t.element_size() for t in model.parameters())
    result["weight_bytes"] = generator.llm.collective_rpc(weight_bytes)[0]
    # the sync: the other model's weights, whole (every rank streams whole tensors; vLLM keeps
    # its own slice), then a partial stream of two of the original weights back
    sequence = prompts[0] + prompts[1]
    other = load_file(os.path.join(args.other_model, "model.safetensors"))
    generator.load_weights(iter(other.items()))
    result["other_logprobs"] = generator.logprobs([(sequence, len(prompts[0]))])[0]
    original = load_file(os.path.join(args.model, "model.safetensors"))
    generator.load_weights(((name, original[name]) for name in PERTURBED), partial=True)
    result["mixed_logprobs"] = generator.logprobs([(sequence, len(prompts[0]))])[0]
    result["sequence"], result["prompt_len"], result["perturbed"] = sequence, len(prompts[0]), PERTURBED
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"sharded_rank{topology.rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # the interpreter's teardown costs seconds a rank
