"""Packed vs padded training step on a skewed completion-length distribution, same tokens.

    python bench/packing.py                 # builds a small Qwen2 (hidden 256, 4 layers) locally

Both variants run forward + backward of the GRPO loss over the same 32 sequences (prompt 32
tokens, completions 16..1024 tokens with a long tail), fused log-probs on in both:
  padded: micro-batches of 8 sequences, padded to the longest in each (the fixed-count path)
  packed: token-budget micro-batches (max_tokens_per_microbatch), no padding
Prints a table with the ratio, writes JSON.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megagrpo.algorithm import grpo  # noqa: E402
from megagrpo.policy.batch import Completion, make_batch
from megagrpo.policy.logprobs import completion_logprobs, install_logprob_head  # noqa: E402
from megagrpo.policy.packing import balanced_microbatches  # noqa: E402


def skewed_lengths(n, low, high, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.exp(4.5 + 0.9 * torch.randn(n, generator=gen))  # log-normal: a long tail
    return lengths.clamp(low, high).long().tolist()


def step(model, batch, groups, packing):
    normalisers = {"num_sequences": len(batch), "num_tokens": float(batch.completion_mask.sum()),
                   "max_sampled_tokens": 1024}
    start = time.perf_counter()
    for rows in groups:
        mb = batch.select(rows)
        logp, _ = completion_logprobs(model, mb, 1.0, packing=packing, fused=True)
        token = grpo.per_token_loss(logp, logp.detach(), mb.advantages, 0.2, 0.2)
        grpo.aggregate(token.loss, mb.completion_mask, "dapo", **normalisers).backward()
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="HF folder; default: build a small Qwen2 locally")
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=4096, help="packed token budget")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="bench/results/packing.json")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM
    path = args.model
    if path is None:
        path = os.path.join(tempfile.mkdtemp(), "model")
        subprocess.run([sys.executable, f"{ROOT}/tools/make_tiny_model.py", "--out", path,
                        "--hidden-size", "256", "--layers", "4", "--heads", "4", "--kv-heads", "2",
                        "--intermediate-size", "768", "--vocab-size", "512"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    install_logprob_head(model, 1024)
    lengths = skewed_lengths(args.sequences, 16, 1024, seed=0)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    completions = [Completion(torch.randint(3, vocab, (n,), generator=gen).tolist(), [0.0] * n, False)
                   for n in lengths]
    prompts = [torch.randint(3, vocab, (32,), generator=gen).tolist() for _ in lengths]
    batch = make_batch(prompts, completions, torch.randn(len(lengths), generator=gen), pad_id=0)
    padded_groups = [list(range(s, min(s + 8, len(lengths)))) for s in range(0, len(lengths), 8)]
    packed_groups = balanced_microbatches(batch.token_counts(), args.max_tokens)
    real = sum(batch.token_counts())
    padded_tokens = sum(len(g) * max(batch.token_counts()[i] for i in g) for g in padded_groups)
    times = {"padded": [], "packed": []}
    for _ in range(args.repeats):
        times["padded"].append(step(model, batch, padded_groups, packing=False))
        times["packed"].append(step(model, batch, packed_groups, packing=True))
    result = {
        "lengths": {"min": min(lengths), "median": sorted(lengths)[len(lengths) // 2], "max": max(lengths)},
        "real_tokens": real, "padded_tokens": padded_tokens,
        "padded_s": min(times["padded"]), "packed_s": min(times["packed"]),
        "micro_batches": {"padded": len(padded_groups), "packed": len(packed_groups)},
    }
    result["speedup"] = result["padded_s"] / result["packed_s"]
    print(f"\ncompletion lengths min/median/max {result['lengths']}; real tokens {real}, "
          f"with padding {padded_tokens}")
    print(f"{'variant':<8}{'micro':>7}{'seconds':>10}")
    for name in ("padded", "packed"):
        print(f"{name:<8}{result['micro_batches'][name]:>7}{result[name + '_s']:>10.2f}")
    print(f"packed speed-up: {result['speedup']:.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
