"""Weight-sync cost: streaming the trainer's parameters into the co-located vLLM engine in place,
against a plain copy of the same bytes into preallocated tensors, side by side in one process.

    python bench/weight_sync.py --model runs/tiny/model --model /tmp/small

Reports seconds per million parameters for both and their ratio (goal: sync <= 2x copy).
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megagrpo.cluster.distributed import init_distributed  # noqa: E402
from megagrpo.config.schema import Config, ModelConfig, RolloutConfig  # noqa: E402
from megagrpo.policy.weight_gather import named_full_tensors  # noqa: E402
from megagrpo.rollout.generators import VLLMGenerator  # noqa: E402
from megagrpo.rollout.weight_sync import sync_weights  # noqa: E402


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="HF folder (repeatable)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench/results/weight_sync.json")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM
    init_distributed()
    rows = []
    for path in args.model:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        cfg = Config(model=ModelConfig(name_or_path=path, dtype="float32"),
                     rollout=RolloutConfig(max_new_tokens=16))
        engine = VLLMGenerator(cfg, path, seed=0)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        targets = [t.clone() for _, t in named_full_tensors(model)]

        def plain_copy():
            for dst, (_, src) in zip(targets, named_full_tensors(model)):
                dst.copy_(src)

        sync = best_of(lambda engine=engine: sync_weights(named_full_tensors(model), engine), args.repeats)
        copy = best_of(plain_copy, args.repeats)
        rows.append({"model": path, "mparams": params, "sync_s": sync, "copy_s": copy,
                     "sync_s_per_mparam": sync / params, "copy_s_per_mparam": copy / params,
                     "ratio": sync / copy})
        del engine
    print(f"\n{'model':<28}{'Mparams':>9}{'sync s/M':>11}{'copy s/M':>11}{'ratio':>8}")
    for r in rows:
        print(f"{r['model'][-28:]:<28}{r['mparams']:>9.2f}{r['sync_s_per_mparam']:>11.5f}"
              f"{r['copy_s_per_mparam']:>11.5f}{r['ratio']:>8.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
