"""Routing replay on a mixture of experts, measured: the MoE quickstart (the tiny Qwen3-MoE
warm-started on the demo task, 2 CPU ranks, ZeRO-3, vLLM co-located, several update passes a
step) trained with each rollout.routing_replay the engine allows, side by side in one run:

  - the mean |sampler log-prob - trainer log-prob| of the sampled tokens (the old-policy pass);
  - the share of tokens whose experts in an update pass differ from the old-policy pass's
    (moe/route_flips), and the share whose router chose differently (moe/route_flips_own);
  - the share of tokens the PPO clip caught, and the held-out accuracy before and after.

    python bench/moe_mismatch.py [--run-dir runs/moe] [--steps 30] [--iterations 4] [--ep 2]

r3 (the sampler's routes replayed) needs an engine that returns routes: vLLM's Model Runner V2,
not the CPU build; it is listed as unavailable there. Needs the MoE quickstart's model and data
(MOE=1 bash launch/quickstart.sh builds runs/moe). Prints a table, writes JSON.
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
           "route flips (used)": "train/moe/route_flips", "route flips (router's own)": "train/moe/route_flips_own",
           "clipped tokens": "train/clip_ratio/region_mean", "expert load entropy": "train/moe/load_entropy"}


def train(args, replay: str, port: int) -> dict:
    """bench/objectives.py's launch of the quickstart config on the MoE run's model and data,
    with this replay; its metrics' means over the steps beside the held-out accuracy."""
    launch = SimpleNamespace(tiny=args.run_dir, ranks=args.ranks, steps=args.steps, out_dir=args.out_dir)
    result = train_quickstart(launch, replay, [f"grpo.num_iterations={args.iterations}",
                                               f"rollout.routing_replay={replay}",
                                               f"parallel.expert_parallel_size={args.ep}",
                                               f"grpo.learning_rate={args.lr}"], port)
    series = read_series(os.path.join(args.out_dir, replay))
    result["means"] = {name: sum(v for _, v in series[key]) / len(series[key])
                       for name, key in METRICS.items() if series.get(key)}
    return result


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
    for i, replay in enumerate(["none", "r2"]):
        results[replay] = train(args, replay, 29750 + i)
        print(f"{replay}: {results[replay]['before']:.3f} -> {results[replay]['after']:.3f} "
              f"in {results[replay]['seconds']:.0f} s", flush=True)
    results["r3"] = "unavailable: vLLM returns routes only under Model Runner V2 (Triton), not on the CPU build"
    print(f"\n{'mean over the steps':<30}" + "".join(f"{name:>12}" for name in ("none", "r2")))
    for name in METRICS:
        print(f"{name:<30}" + "".join(f"{results[r]['means'].get(name, float('nan')):>12.6f}" for r in ("none", "r2")))
    print(f"{'held-out before -> after':<30}" + "".join(
        f"{results[r]['before']:>5.2f}->{results[r]['after']:<5.2f}" for r in ("none", "r2")))
    print(f"r3: {results['r3']}")
    results["setup"] = vars(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
