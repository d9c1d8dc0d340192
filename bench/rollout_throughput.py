"""Rollout tokens/s: the vLLM engine against the transformers (hf) engine, same model, same
prompts, same sampling settings, measured side by side in one process.

    python bench/rollout_throughput.py --model runs/tiny/model --prompts runs/tiny/data/train.jsonl

A randomly initialised model rarely emits EOS, so every completion runs to max_new_tokens
and both engines generate the same number of tokens. Prints a table, writes JSON.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megagrpo.cluster.distributed import init_distributed  # noqa: E402
from megagrpo.config.schema import Config, DataConfig, ModelConfig, RolloutConfig  # noqa: E402
from megagrpo.data import load_prompts  # noqa: E402
from megagrpo.policy.models import load_tokenizer  # noqa: E402
from megagrpo.rollout.generators import HFGenerator, VLLMGenerator  # noqa: E402


def measure(engine, prompt_ids, n, repeats):
    engine.generate(prompt_ids[:2], n=2, seeds=[0, 1])  # warm-up
    tokens, start = 0, time.perf_counter()
    for r in range(repeats):
        groups = engine.generate(prompt_ids, n=n, seeds=[r * 1000 + i for i in range(len(prompt_ids))])
        tokens += sum(len(c.token_ids) for g in groups for c in g)
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="bench/results/rollout_throughput.json")
    args = p.parse_args()

    init_distributed()
    cfg = Config(model=ModelConfig(name_or_path=args.model, dtype="float32"),
                 data=DataConfig(train_file=args.prompts, max_prompt_length=128),
                 rollout=RolloutConfig(max_new_tokens=args.max_new_tokens))
    tokenizer = load_tokenizer(args.model)
    prompts, _ = load_prompts(args.prompts, tokenizer, 128)
    prompt_ids = [pr.token_ids for pr in prompts[:args.num_prompts]]
    results = {}
    for name, engine_class in (("hf", HFGenerator), ("vllm", VLLMGenerator)):
        engine = engine_class(cfg, args.model, seed=0)
        results[name] = measure(engine, prompt_ids, args.num_generations, args.repeats)
        del engine
    results["vllm_over_hf"] = results["vllm"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    results["setup"] = vars(args)
    print(f"\n{'engine':<8}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}")
    for name in ("hf", "vllm"):
        r = results[name]
        print(f"{name:<8}{r['tokens']:>10}{r['seconds']:>10.2f}{r['tokens_per_s']:>12.0f}")
    print(f"vLLM / hf: {results['vllm_over_hf']:.1f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
