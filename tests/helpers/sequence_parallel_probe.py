"""Probe for test_policy_sequence_parallel.py: the tiny model's log-probs, entropies and gradients
with each packed row split over an sp group (Ulysses attention, policy/sequence_parallel.py)
against the same model on one rank, for every loss type. Rank 0 prints one JSON line.

    torchrun --nproc_per_node 2 tests/helpers/sequence_parallel_probe.py MODEL_FOLDER
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from megagrpo.algorithm.loss import LossInputs, StepStats, declare_stats, micro_batch_loss
from megagrpo.cluster.distributed import init_distributed
from megagrpo.config.schema import GRPOConfig
from megagrpo.policy.batch import Completion, make_batch
from megagrpo.policy.logprobs import completion_logprobs, install_logprob_head
from megagrpo.policy.packing import pack
from megagrpo.policy.sequence_parallel import SequenceParallel, slice_row, use_ulysses_attention
from megagrpo.process_exit import exit_without_teardown

OBJECTIVES = {
    "grpo": dict(loss_type="grpo"), "bnpo": dict(loss_type="bnpo"), "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo+entropy": dict(loss_type="dapo", entropy_coef=0.01), "cispo": dict(loss_type="cispo"),
    "sapo": dict(loss_type="sapo"),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
}
# (prompt, completion) lengths: uneven, the first longer than half of the packed row
LENGTHS = [(9, 130), (5, 3), (7, 21), (3, 1), (6, 17), (4, 29)]


def model(folder: str, sp=None, checkpointing=False):
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    install_logprob_head(m, chunk_size=16)
    if sp is not None:
        use_ulysses_attention(m, sp)
    if checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return m.train()


def batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    prompts = [draw(p) for p, _ in LENGTHS]
    completions = [Completion(draw(c), (torch.rand(c, generator=g) * -2).tolist(), False) for _, c in LENGTHS]
    advantages = torch.randn(len(LENGTHS), generator=g)
    b = make_batch(prompts, completions, advantages, pad_id=0)
    b.old_logp = b.sampler_logp + 0.05 * torch.randn(b.sampler_logp.shape, generator=g)
    b.ref_logp = b.sampler_logp - 0.1
    return b


def losses_and_grads(m, b, sp, objective):
    g = GRPOConfig(kl_coef=0.04, **OBJECTIVES[objective])
    m.zero_grad(set_to_none=True)
    logp, entropy = completion_logprobs(m, b, temperature=0.9, sp=sp)
    inputs = LossInputs(b.completion_mask, b.advantages, b.sampler_logp, b.old_logp, b.ref_logp)
    normalisers = {"num_sequences": len(b), "num_tokens": float(b.completion_mask.sum()), "max_sampled_tokens": 160}
    stats = StepStats()
    declare_stats(stats, g)
    loss = micro_batch_loss(g, logp, entropy, inputs, normalisers, 1.0, stats)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in m.parameters()])
    if sp is not None:  # DeepSpeed sums the gradients over the sp group (and averages over dp)
        dist.all_reduce(grads, group=sp.group)
    return float(loss.detach()), grads


def main():
    folder = sys.argv[1]
    topology = init_distributed(sp_size=int(os.environ["WORLD_SIZE"]))
    sp = SequenceParallel.of(topology)
    plain, split = model(folder), model(folder, sp)
    b = batch(plain.config.vocab_size)
    prompts, completions = b.sequences()
    row = slice_row(pack(prompts, completions), sp)
    out = {"sp": sp.size, "row": sum(len(p) + len(c) for p, c in zip(prompts, completions)),
           "longest": max(len(p) + len(c) for p, c in zip(prompts, completions)),
           "share": row.input_ids.shape[1], "counts": row.counts}
    with torch.no_grad():
        for fused in (True, False):
            a, ea = completion_logprobs(plain.eval(), b, 0.9, fused=fused)
            s, es = completion_logprobs(split.eval(), b, 0.9, fused=fused, sp=sp)
            out[f"logp_difference_fused_{fused}"] = float((a - s).abs().max())
            out[f"entropy_difference_fused_{fused}"] = float((ea - es).abs().max())
        local, _ = completion_logprobs(plain, b, 0.9, sp=sp)  # the control: each rank attends to its slice only
        out["without_ulysses_difference"] = float((local - a).abs().max())
        plain.train(), split.train()
    out["objectives"] = {}
    for objective in OBJECTIVES:
        loss, grads = losses_and_grads(plain, b, None, objective)
        sp_loss, sp_grads = losses_and_grads(split, b, sp, objective)
        out["objectives"][objective] = {"loss": loss, "loss_difference": abs(loss - sp_loss),
                                        "grad_norm": float(grads.norm()), "sp_grad_norm": float(sp_grads.norm()),
                                        "grad_difference": float((grads - sp_grads).abs().max())}
    checkpointed = model(folder, sp, checkpointing=True)
    _, grads = losses_and_grads(plain, b, None, "grpo")
    _, sp_grads = losses_and_grads(checkpointed, b, sp, "grpo")
    out["checkpointing_grad_difference"] = float((grads - sp_grads).abs().max())
    if topology.rank == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
    dist.barrier()
    exit_without_teardown(0)
