"""Probe for test_policy_vocab_parallel.py: each rank holds a vocabulary shard of the LM head; the
vocab-parallel fused log-probs, entropy and gradients are compared with the full-vocabulary
computation that every rank also runs locally. Writes vocab_parallel_rank<r>.json to the folder given.

    deepspeed --num_gpus 2 tests/helpers/vocab_parallel_probe.py OUT_DIR
"""
import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist

from megagrpo.cluster.distributed import release_shm_allreduce_name
from megagrpo.policy.fused_logprobs import fused_token_logprobs, naive_token_logprobs
from megagrpo.process_exit import exit_without_teardown


def parse_args(argv=None):
    """The output folder; the deepspeed launcher adds --local_rank=N (--local-rank=N in some
    versions) before it, which is accepted and unused (the rank comes from the environment)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="folder for vocab_parallel_rank<r>.json")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main():
    out_dir = parse_args().out_dir
    deepspeed.init_distributed()
    release_shm_allreduce_name()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for N, H, V, chunk, temperature in [(37, 16, 101, 8, 1.0), (64, 32, 257, 100, 0.7), (5, 8, 11, 2, 1.3)]:
        gen = torch.Generator().manual_seed(N * V)  # the same inputs on every rank
        hidden = torch.randn(N, H, generator=gen, dtype=torch.float64)
        weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.5
        targets = torch.randint(0, V, (N,), generator=gen)
        upstream = torch.randn(N, generator=gen, dtype=torch.float64)

        full_h, full_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        ref_logp, ref_entropy = naive_token_logprobs(full_h, full_w, targets, temperature, True)
        (ref_logp * upstream).sum().backward()

        shards = torch.tensor_split(weight, world)  # uneven when V is not divisible
        offset = sum(len(s) for s in shards[:rank])
        h = hidden.clone().requires_grad_()
        w = shards[rank].clone().requires_grad_()
        logp, entropy = fused_token_logprobs(h, w, targets, temperature, chunk, True,
                                             vocab_group=dist.group.WORLD, vocab_offset=offset)
        (logp * upstream).sum().backward()
        results.append({
            "shape": [N, H, V, chunk],
            "logp": (logp - ref_logp).abs().max().item(),
            "entropy": (entropy - ref_entropy).abs().max().item(),
            "grad_hidden": (h.grad - full_h.grad).abs().max().item(),
            "grad_weight_shard": (w.grad - full_w.grad[offset:offset + len(w)]).abs().max().item(),
            "grad_hidden_norm": h.grad.norm().item(),
        })
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"vocab_parallel_rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()  # leave together: a rank exiting with a live gloo group can abort the other
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # the interpreter's teardown costs seconds a rank
