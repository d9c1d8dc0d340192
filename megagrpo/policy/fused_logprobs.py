"""Per-token log-probs (and entropy) straight from the last hidden states, in chunks of tokens.

The naive path materialises all N x V logits, their log_softmax and, in
backward, their gradient: for N=8192 tokens and a 152k vocabulary that is ~5 GB per copy in
float32. Here the logits of at most `chunk_size` tokens exist at a time:

    forward:   z = hidden_c @ weight.T / T     lse_c = logsumexp(z)     logp_c = z[target] - lse_c
               entropy_c = -sum_j p_j log p_j  (p = softmax(z)), when asked
    backward:  recompute z,  dz = g_c * (onehot(target) - p) / T  [- gH_c * p * (log p + H_c) / T]
               grad_hidden_c = dz @ weight     grad_weight += dz.T @ hidden_c

Only hidden, weight, targets and lse (N floats) are kept for backward. The matmuls run in the
inputs' dtype on an accelerator (as the model's lm_head would) and in float32 on a CPU for
bfloat16/float16 inputs (see _matmul_dtype); softmax, logsumexp and the sum of grad_weight over
chunks run in float32 (float64 for float64 inputs).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable


def _matmul_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype of the head's products: the tensor's own on an accelerator; float32 on a CPU,
    where bfloat16/float16 matmuls without native support run 6-140x slower than float32 at a
    150k-token vocabulary (bench/fused_logprobs.py --dtype bfloat16)."""
    if tensor.device.type == "cpu" and tensor.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return tensor.dtype


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """(n, H) x (V, H) -> (n, V) logits / temperature, in at least float32; `weight` is already
    in the matmul dtype, `hidden` is cast to it."""
    acc = torch.promote_types(weight.dtype, torch.float32)
    return (hidden.to(weight.dtype) @ weight.T).to(acc).div_(temperature)


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _in_shard(targets: torch.Tensor, offset: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local column of each target in this vocabulary shard (clamped) and whether it is here."""
    local = targets - offset
    inside = (local >= 0) & (local < size)
    return local.clamp(0, size - 1), inside


class _FusedLogprobs(torch.autograd.Function):
    """With `group` set, `weight` holds the rows [offset, offset + V_local) of the vocabulary
    and the softmax statistics are completed across the group (max, sum of exp, target logit):
    the vocab-parallel log-softmax of tensor parallelism, never gathering the full vocabulary."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy, group, offset):
        N, V_local = hidden.shape[0], weight.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)
        logp = torch.empty(N, dtype=acc, device=hidden.device)
        lse = torch.empty(N, dtype=acc, device=hidden.device)
        entropy = torch.empty(N if with_entropy else 0, dtype=acc, device=hidden.device)
        w = weight.to(_matmul_dtype(weight))  # (a float32 copy of a low-precision head on CPU)
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            logits = _chunk_logits(hidden[s:e], w, temperature)
            if group is None:
                lse[s:e] = logits.logsumexp(dim=-1)
            else:
                peak = _all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX, group)
                total = _all_reduce((logits - peak[:, None]).exp().sum(dim=-1), dist.ReduceOp.SUM, group)
                lse[s:e] = peak + total.log()
            local, inside = _in_shard(targets[s:e], offset, V_local)
            target_logit = logits.gather(-1, local[:, None]).squeeze(-1) * inside
            logp[s:e] = _all_reduce(target_logit, dist.ReduceOp.SUM, group) - lse[s:e]
            if with_entropy:
                logits.sub_(lse[s:e, None])  # now log-probs
                entropy[s:e] = -_all_reduce(logits.exp().mul_(logits).sum(dim=-1), dist.ReduceOp.SUM, group)
            del logits  # before the next chunk's logits exist
        del w
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.group, ctx.offset = temperature, chunk_size, group, offset
        ctx.set_materialize_grads(False)  # no entropy gradient to compute unless the loss uses it
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        if grad_entropy is not None and not bool(grad_entropy.any()):
            grad_entropy = None  # the caller stacked (logp, entropy) and uses logp only
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        N, T, V_local = hidden.shape[0], ctx.temperature, weight.shape[0]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
                       if need_weight else None)
        w = weight.to(_matmul_dtype(weight))
        for s in range(0, N, ctx.chunk_size):
            e = min(s + ctx.chunk_size, N)
            scale = (grad_logp[s:e] / T).to(lse.dtype)[:, None]   # (n, 1)
            # dz = scale * (onehot - softmax), built in place in the recomputed logits
            log_p = _chunk_logits(hidden[s:e], w, T).sub_(lse[s:e, None])
            if grad_entropy is None:
                dz = log_p.exp_().mul_(-scale)
            else:  # dH/dz_j = -p_j (log p_j + H) / T
                h_scale = (grad_entropy[s:e] / T).to(lse.dtype)[:, None]
                dz = log_p.exp() * -(scale + h_scale * (log_p + entropy[s:e, None]))
                del log_p
            local, inside = _in_shard(targets[s:e], ctx.offset, V_local)
            dz.scatter_add_(1, local[:, None], scale * inside[:, None])
            dz = dz.to(w.dtype)
            if need_hidden:
                grad_hidden[s:e] = dz @ w
            if need_weight:
                h = hidden[s:e].to(w.dtype)
                if grad_weight.dtype == dz.dtype:
                    grad_weight.addmm_(dz.T, h)
                else:  # low-precision product (accelerator), summed over chunks in float32
                    grad_weight += dz.T @ h
            del dz
        if need_hidden:  # every vocabulary shard contributes to the (replicated) hidden state
            grad_hidden = _all_reduce(grad_hidden, dist.ReduceOp.SUM, ctx.group)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def fused_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         temperature: float = 1.0, chunk_size: int = 1024,
                         with_entropy: bool = False, vocab_group=None,
                         vocab_offset: int = 0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log softmax(hidden @ weight.T / temperature)[target] per token, and the entropy of the
    distribution when asked (both differentiable). hidden (..., H), weight (V, H), targets
    (...) -> float32 (...), with at most chunk_size x V logits alive at a time in forward and
    backward.

    Vocab-parallel: with `vocab_group` (a torch.distributed group), `weight` is this rank's
    shard, rows vocab_offset .. vocab_offset + len(weight) of the vocabulary; targets are
    vocabulary ids; every rank of the group gets the full result (and the summed hidden grad)."""
    shape = targets.shape
    logp, entropy = _FusedLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                         targets.reshape(-1), temperature, chunk_size, with_entropy,
                                         vocab_group, vocab_offset)
    return logp.view(shape), (entropy.view(shape) if with_entropy else None)


def naive_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         temperature: float = 1.0,
                         with_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Reference: the same quantities through the full (..., V) logits."""
    logp, entropy = logprobs_from_logits(hidden @ weight.T, targets, temperature)
    return logp, (entropy if with_entropy else None)


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor,
                         temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature)[target] and the entropy, in at least float32: the
    full-logits path."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    logp_all = (logits.to(acc) / temperature).log_softmax(dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp, entropy
