"""The GRPO algorithm: group advantages, KL(k3), clipped policy loss, aggregation.

Pure tensor math with no distributed code, checkable against the formulas by reading it:

    A_i   = (r_i - mean(r_group)) [/ std]                      group_advantages
    ratio = exp(logp - logp_old)                               per-token
    L_tok = -min(ratio * A, clip(ratio, 1-eps, 1+eps_high) * A) * w_is + kl_coef * KL_k3
    KL_k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1
    L     = aggregate(L_tok, mask, loss_type)

`w_is` is the truncated importance weight min(pi_old / pi_sampler, C) that corrects for the
sampler (vLLM) and the trainer computing slightly different probabilities.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group",
                     batch_std: Optional[torch.Tensor] = None, eps: float = 1e-4) -> torch.Tensor:
    """Rewards (N,) laid out group after group -> advantages (N,). With scale="batch" the
    divisor is `batch_std` (the std over all ranks' rewards) or, if None, these rewards' std."""
    grouped = rewards.view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centered = centered / ((rewards.std() if batch_std is None else batch_std) + eps)
    elif scale != "none":
        raise ValueError(f"scale_rewards: unknown value {scale!r}")
    return centered.reshape(-1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token unbiased, non-negative KL(pi || pi_ref) estimator k3 (Schulman)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def truncated_importance_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor,
                                 cap: float) -> torch.Tensor:
    """min(pi_trainer / pi_sampler, cap) per token, without gradient."""
    return torch.exp(old_logp - sampler_logp).clamp(max=cap).detach()


@dataclass
class TokenLoss:
    loss: torch.Tensor          # (B, T) per-token loss
    ratio: torch.Tensor         # (B, T) pi / pi_old
    kl: Optional[torch.Tensor]  # (B, T) or None
    clipped_low: torch.Tensor   # (B, T) bool: ratio < 1-eps with A < 0
    clipped_high: torch.Tensor  # (B, T) bool: ratio > 1+eps_high with A > 0


def per_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                   epsilon: float, epsilon_high: float, kl_coef: float = 0.0,
                   ref_logp: Optional[torch.Tensor] = None,
                   is_weights: Optional[torch.Tensor] = None) -> TokenLoss:
    """Clipped surrogate plus KL penalty per token. Shapes (B, T); advantages (B,)."""
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * adv, clipped * adv)
    if is_weights is not None:
        loss = loss * is_weights
    kl = None
    if kl_coef != 0.0:
        kl = k3_kl(logp, ref_logp)
        loss = loss + kl_coef * kl
    return TokenLoss(loss=loss, ratio=ratio, kl=kl,
                     clipped_low=(ratio < 1 - epsilon) & (adv < 0),
                     clipped_high=(ratio > 1 + epsilon_high) & (adv > 0))


def aggregate(token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, *,
              num_sequences: int, num_tokens: float, max_completion_length: int) -> torch.Tensor:
    """Reduce a micro-batch's per-token loss to its share of the optimizer step's loss.

    The normalisers describe the whole step (not the micro-batch), so the shares of any split
    into micro-batches sum to the same loss:
      grpo:    sum_i mean_t(L_it) / num_sequences
      bnpo/dapo: sum_it L_it / num_tokens  (the caller picks rank-local or global tokens)
      dr_grpo: sum_it L_it / (num_sequences * max_completion_length)
    """
    masked = token_loss * mask
    if loss_type == "grpo":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_seq.sum() / num_sequences
    if loss_type in ("bnpo", "dapo"):
        return masked.sum() / max(num_tokens, 1.0)
    if loss_type == "dr_grpo":
        return masked.sum() / (num_sequences * max_completion_length)
    raise ValueError(f"loss_type: unknown value {loss_type!r}")
