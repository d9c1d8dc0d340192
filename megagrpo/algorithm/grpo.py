"""The GRPO algorithm: group advantages, KL(k3), the policy objectives, aggregation.

Pure tensor math with no distributed code, checkable against the formulas by reading it:

    A_i    = (r_i - mean(r_group)) [/ std]                      group_advantages
    A_it   = w_task * A_i + coef * (logp_teacher - logp_old)    distillation_advantages (a teacher)
    ratio  = exp(logp - logp_old)                   token level (GRPO/DAPO)
           = exp(mean_t(logp - logp_old))           sequence level (GSPO), one per sequence
    policy term per token, by loss_type:
      grpo, bnpo, dapo, dr_grpo: -min(min(ratio, delta) * A, clip(ratio, 1-eps, 1+eps_high) * A)
      cispo:  -sg(min(ratio, 1+eps_high)) * A * logp            (MiniMax-M1)
      sapo:   -sigmoid(tau * (ratio - 1)) * 4/tau * A,  tau = tau_pos if A > 0 else tau_neg
    L_tok  = policy * keep * w_is + kl_coef * KL_k3 [* ratio]    (ratio: KL bias correction)
    KL_k3  = exp(logp_ref - logp) - (logp_ref - logp) - 1
    L      = aggregate(L_tok, mask, loss_type) - entropy_coef * mean_t(H)

`w_is` corrects for the sampler (vLLM) and the trainer computing slightly different
probabilities: the truncated weight min(pi_old / pi_sampler, C) per token, or one weight per
sequence (truncated, or the sequence masked out past C): importance_weights. `keep` drops
tokens from the policy term: sequences too far off-policy (off_policy_keep) and tokens below
the entropy quantile (high_entropy_keep).
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


def distillation_advantages(advantages: torch.Tensor, old_logp: torch.Tensor, teacher_logp: torch.Tensor,
                            coef: float, task_weight: float) -> torch.Tensor:
    """On-policy distillation's per-token advantages (B, T): the group advantages (B,) weighted
    by task_weight, plus coef x (log p_teacher - log p_old) on each sampled token, the negative
    of the per-token reverse KL(policy || teacher) estimate. Without gradient."""
    return (task_weight * advantages.unsqueeze(1) + coef * (teacher_logp - old_logp)).detach()


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token unbiased, non-negative KL(pi || pi_ref) estimator k3 (Schulman)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def truncated_importance_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor,
                                 cap: float) -> torch.Tensor:
    """min(pi_trainer / pi_sampler, cap) per token, without gradient."""
    return torch.exp(old_logp - sampler_logp).clamp(max=cap).detach()


def importance_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                       mode: str, cap: float) -> torch.Tensor:
    """The sampler correction, without gradient: token_truncate (B, T) min(w_t, cap); per
    sequence (B, 1) with w = exp(sum_t (logp_old - logp_sampler)): sequence_truncate min(w, cap),
    sequence_mask w where w <= cap, else 0 (the sequence is left out)."""
    if mode == "token_truncate":
        return truncated_importance_weights(old_logp, sampler_logp, cap)
    weight = torch.exp(((old_logp - sampler_logp) * mask).sum(dim=1, keepdim=True)).detach()
    if mode == "sequence_truncate":
        return weight.clamp(max=cap)
    if mode == "sequence_mask":
        return weight.masked_fill(weight > cap, 0.0)
    raise ValueError(f"importance_sampling_correction: unknown mode {mode!r}")


def off_policy_keep(logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B, 1): 0 for a sequence with a negative advantage whose mean KL(sampler || policy),
    mean_t(logp_sampler - logp), is above `threshold` (DeepSeek-V3.2's off-policy sequence
    mask), else 1."""
    kl = ((sampler_logp - logp.detach()) * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return ((advantages.unsqueeze(1) >= 0) | (kl <= threshold)).to(mask.dtype)


def high_entropy_keep(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """(B, T): 1 on the tokens whose entropy is at least the (1 - quantile) quantile of this
    batch's tokens (the "80/20" high-entropy minority, quantile 0.2), 0 elsewhere."""
    values = entropy[mask.bool()].float()
    if values.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(values, 1 - quantile)
    return ((entropy * mask >= threshold) & mask.bool()).to(mask.dtype)


@dataclass
class TokenLoss:
    loss: torch.Tensor          # (B, T) per-token loss
    ratio: torch.Tensor         # (B, T), or (B, 1) at sequence level: pi / pi_old
    kl: Optional[torch.Tensor]  # (B, T) or None
    clipped_low: torch.Tensor   # bool, as ratio: ratio < 1-eps with A < 0
    clipped_high: torch.Tensor  # bool, as ratio: ratio > 1+eps_high with A > 0


def per_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                   epsilon: float, epsilon_high: float, kl_coef: float = 0.0,
                   ref_logp: Optional[torch.Tensor] = None,
                   is_weights: Optional[torch.Tensor] = None, *,
                   mask: Optional[torch.Tensor] = None, loss_type: str = "grpo", level: str = "token",
                   delta: Optional[float] = None, sapo_temperatures: tuple[float, float] = (1.0, 1.05),
                   kl_bias_correction: bool = False, keep: Optional[torch.Tensor] = None) -> TokenLoss:
    """The policy term of `loss_type` plus the KL penalty per token (module docstring). Shapes
    (B, T); advantages (B,), or (B, T) per token (distillation); `mask` (needed at sequence
    level) marks the completion tokens."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = logp - old_logp
    if level == "sequence":
        log_ratio = (log_ratio * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    elif level != "token":
        raise ValueError(f"importance_sampling_level: unknown value {level!r}")
    ratio = torch.exp(log_ratio)
    if loss_type == "cispo":
        loss = -ratio.clamp(max=1 + epsilon_high).detach() * adv * logp
    elif loss_type == "sapo":
        temperature = torch.where(adv > 0, sapo_temperatures[0], sapo_temperatures[1])
        loss = -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * adv
    else:
        clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high)
        unclipped = ratio if delta is None else ratio.clamp(max=delta)
        loss = -torch.min(unclipped * adv, clipped * adv)
    if keep is not None:
        loss = loss * keep
    if is_weights is not None:
        loss = loss * is_weights
    kl = None
    if kl_coef != 0.0:
        kl = k3_kl(logp, ref_logp)
        if kl_bias_correction:
            kl = kl * ratio
        loss = loss + kl_coef * kl
    return TokenLoss(loss=loss.expand_as(logp), ratio=ratio, kl=kl,
                     clipped_low=(ratio < 1 - epsilon) & (adv < 0),
                     clipped_high=(ratio > 1 + epsilon_high) & (adv > 0))


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """This micro-batch's share of the step's mean token entropy: sum of H over `mask` /
    num_tokens (the step's tokens, so any split into micro-batches sums to the same)."""
    return (entropy * mask).sum() / max(num_tokens, 1.0)


def aggregate(token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, *,
              num_sequences: int, num_tokens: float, max_sampled_tokens: int) -> torch.Tensor:
    """Reduce a micro-batch's per-token loss to its share of the optimizer step's loss.

    The normalisers describe the whole step (not the micro-batch), so the shares of any split
    into micro-batches sum to the same loss:
      grpo, sapo:  sum_i mean_t(L_it) / num_sequences
      bnpo, dapo, cispo: sum_it L_it / num_tokens  (the caller picks rank-local or global tokens)
      dr_grpo:     sum_it L_it / (num_sequences * max_sampled_tokens), the most tokens the model
                   samples in one completion (max_new_tokens x max_turns)
    """
    masked = token_loss * mask
    if loss_type in ("grpo", "sapo"):
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_seq.sum() / num_sequences
    if loss_type in ("bnpo", "dapo", "cispo"):
        return masked.sum() / max(num_tokens, 1.0)
    if loss_type == "dr_grpo":
        return masked.sum() / (num_sequences * max_sampled_tokens)
    raise ValueError(f"loss_type: unknown value {loss_type!r}")
