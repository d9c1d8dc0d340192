"""The GRPO loss of one micro-batch, and the step statistics it records (StepStats). One
function serves both policies: the ZeRO policy's loop and the last stage of a pipeline
(policy/pipeline.py's loss_fn), so the two layouts compute the same thing."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megagrpo.algorithm import grpo
from megagrpo.config.schema import GRPOConfig, TeacherConfig


class StepStats:
    """Accumulates masked per-token sums and extrema over micro-batches; `reduce` combines them
    with a reduction the caller passes in (over ranks, or none)."""

    def __init__(self):
        self.sums, self.maxes, self.mins = {}, {}, {}
        self.loss = 0.0

    def declare(self, means: list[str], extrema: list[str]) -> None:
        """Create these statistics empty (every rank then reduces the same names)."""
        for name in means:
            self.sums.setdefault(name, (0.0, 0.0))
        for name in extrema:
            self.maxes.setdefault(name, -float("inf"))
            self.mins.setdefault(name, float("inf"))

    def add_loss(self, share: float) -> None:
        """A micro-batch's share of the step loss (shares of one pass sum to its loss)."""
        self.loss += share

    def add_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        total, count = self.sums.get(name, (0.0, 0.0))
        self.sums[name] = (total + float((values * mask).sum()), count + float(mask.sum()))

    def add_extrema(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        self.maxes.setdefault(name, -float("inf"))
        self.mins.setdefault(name, float("inf"))
        if mask.sum() == 0:
            return
        sel = values[mask.bool()]
        self.maxes[name] = max(self.maxes.get(name, -float("inf")), float(sel.max()))
        self.mins[name] = min(self.mins.get(name, float("inf")), float(sel.min()))

    def reduce(self, all_reduce: Callable[[torch.Tensor, str], torch.Tensor]) -> dict:
        """Means and extrema; all_reduce(tensor, op) with op "sum", "max" or "min" combines the
        parts of every rank (megagrpo.cluster.distributed.all_reduce), or is the identity."""
        out = {}
        names = sorted(self.sums)
        if names:
            sums = all_reduce(torch.tensor([self.sums[n] for n in names], dtype=torch.float64), "sum")
            out.update({n: float(s / max(c, 1.0)) for n, (s, c) in zip(names, sums.tolist())})
        for table, op, suffix in ((self.maxes, "max", "max"), (self.mins, "min", "min")):
            keys = sorted(table)
            if keys:
                vals = all_reduce(torch.tensor([table[k] for k in keys], dtype=torch.float64), op)
                out.update({f"{k}/{suffix}": v for k, v in zip(keys, vals.tolist())})
        return out


@dataclass
class LossInputs:
    """Everything the loss needs besides the policy's own log-probs, (B, C) per token."""
    completion_mask: torch.Tensor
    advantages: torch.Tensor            # (B,)
    sampler_logp: torch.Tensor
    old_logp: Optional[torch.Tensor]    # None: the policy's own (detached), num_iterations = 1
    ref_logp: Optional[torch.Tensor]    # None: no KL term
    teacher_logp: Optional[torch.Tensor] = None  # a distillation teacher's; None: no teacher


def declare_stats(stats: StepStats, g: GRPOConfig, teacher: Optional[TeacherConfig] = None) -> None:
    """Name every statistic up front, so that ranks that record none (pipeline stages before
    the last) still take part in the same reductions."""
    means = ["entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
             "sampling/sampling_logp_difference/mean"]
    extrema = ["sampling/sampling_logp_difference"]
    if g.kl_coef > 0:
        means.append("kl")
    if g.importance_sampling_correction != "none":
        means.append("sampling/importance_sampling_ratio/mean")
        extrema.append("sampling/importance_sampling_ratio")
    if g.off_policy_mask_threshold is not None:
        means.append("sampling/off_policy_masked")
    if g.top_entropy_quantile < 1:
        means.append("entropy/masked")
    if teacher is not None:
        means += ["teacher/reverse_kl", "teacher/disagreement", "teacher/advantage"]
    stats.declare(means, extrema)


def micro_batch_loss(g: GRPOConfig, logp: torch.Tensor, entropy: torch.Tensor, inputs: LossInputs,
                     normalisers: dict, share: float, stats: Optional[StepStats],
                     teacher: Optional[TeacherConfig] = None) -> torch.Tensor:
    """This micro-batch's share of the step loss (normalised for the whole step, see
    grpo.aggregate), recording its statistics in `stats` when given. teacher: on-policy
    distillation, whose per-token advantages (inputs.teacher_logp) replace the group's."""
    mask = inputs.completion_mask
    old_logp = inputs.old_logp if inputs.old_logp is not None else logp.detach()
    advantages = inputs.advantages
    if teacher is not None:
        advantages = grpo.distillation_advantages(inputs.advantages, old_logp, inputs.teacher_logp,
                                                  teacher.coef, teacher.task_weight)
    is_weights = None
    if g.importance_sampling_correction != "none":
        is_weights = grpo.importance_weights(old_logp, inputs.sampler_logp, mask, g.importance_sampling_correction,
                                             g.importance_sampling_cap)
    keep = {}  # what drops tokens from the policy term
    if g.off_policy_mask_threshold is not None:
        keep["sampling/off_policy_masked"] = grpo.off_policy_keep(logp, inputs.sampler_logp, inputs.advantages,
                                                                  mask, g.off_policy_mask_threshold)
    if g.top_entropy_quantile < 1:
        keep["entropy/masked"] = grpo.high_entropy_keep(entropy, mask, g.top_entropy_quantile)
    kept = None
    for factor in keep.values():
        kept = factor if kept is None else kept * factor
    epsilon_high = g.epsilon_high if g.epsilon_high is not None else g.epsilon
    token = grpo.per_token_loss(logp, old_logp, advantages, g.epsilon, epsilon_high,
                                g.kl_coef, inputs.ref_logp, is_weights, mask=mask, loss_type=g.loss_type,
                                level=g.importance_sampling_level, delta=g.delta,
                                sapo_temperatures=(g.sapo_temperature_pos, g.sapo_temperature_neg),
                                kl_bias_correction=g.use_bias_correction_kl, keep=kept)
    loss = grpo.aggregate(token.loss, mask, g.loss_type, **normalisers)
    if g.entropy_coef:  # the bonus: a mean over the step's tokens (the entropy quantile's, if set)
        covered = mask if "entropy/masked" not in keep else mask * keep["entropy/masked"]
        loss = loss - g.entropy_coef * grpo.entropy_bonus(entropy, covered, normalisers["num_tokens"])
    loss = loss * share
    if stats is not None:
        _record(stats, inputs, loss, token, entropy, old_logp, is_weights, keep)
        if teacher is not None:
            _record_teacher(stats, inputs, old_logp, advantages, teacher.disagreement_nats)
    return loss


def _record(stats, inputs, loss, token, entropy, old_logp, is_weights, keep) -> None:
    mask = inputs.completion_mask
    stats.add_loss(float(loss.detach()))
    stats.add_mean("entropy", entropy.detach(), mask)
    if token.kl is not None:
        stats.add_mean("kl", token.kl.detach(), mask)
    low, high = token.clipped_low.expand_as(mask), token.clipped_high.expand_as(mask)  # sequence level: (B, 1)
    stats.add_mean("clip_ratio/low_mean", low.float(), mask)
    stats.add_mean("clip_ratio/high_mean", high.float(), mask)
    stats.add_mean("clip_ratio/region_mean", (low | high).float(), mask)
    diff = (old_logp - inputs.sampler_logp).abs()
    stats.add_mean("sampling/sampling_logp_difference/mean", diff, mask)
    stats.add_extrema("sampling/sampling_logp_difference", diff, mask)
    if is_weights is not None:
        stats.add_mean("sampling/importance_sampling_ratio/mean", is_weights.expand_as(mask), mask)
        stats.add_extrema("sampling/importance_sampling_ratio", is_weights.expand_as(mask), mask)
    for name, factor in keep.items():  # the share of the tokens each one left out
        stats.add_mean(name, 1 - factor.expand_as(mask), mask)


def _record_teacher(stats, inputs, old_logp, advantages, disagreement_nats: float) -> None:
    """The per-token reverse KL(policy || teacher) estimate, the share of tokens the teacher
    finds disagreement_nats less likely than the policy, and the mean token advantage."""
    mask = inputs.completion_mask
    gap = old_logp - inputs.teacher_logp
    stats.add_mean("teacher/reverse_kl", gap, mask)
    stats.add_mean("teacher/disagreement", (gap > disagreement_nats).float(), mask)
    stats.add_mean("teacher/advantage", advantages, mask)
