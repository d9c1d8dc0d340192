"""Rollout batches: prompts and their completions as padded tensors, and per-token log-probs.

Layout: prompts left-padded to P, completions right-padded to C, so that position P-1+t of the
logits predicts completion token t. Position ids count real tokens only, as the sampler does.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from .rollout import Completion


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor         # (B, P + C)
    attention_mask: torch.Tensor    # (B, P + C)
    position_ids: torch.Tensor      # (B, P + C)
    completion_ids: torch.Tensor    # (B, C)
    completion_mask: torch.Tensor   # (B, C) float, 1 on real completion tokens
    sampler_logp: torch.Tensor      # (B, C) the rollout engine's logprobs
    truncated: torch.Tensor         # (B,) bool
    advantages: torch.Tensor        # (B,)
    prompt_width: int
    ref_logp: Optional[torch.Tensor] = None   # (B, C)
    old_logp: Optional[torch.Tensor] = None   # (B, C)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, end: int) -> "RolloutBatch":
        """Rows start:end (a micro-batch)."""
        return RolloutBatch(**{
            f.name: (getattr(self, f.name)[start:end]
                     if isinstance(getattr(self, f.name), torch.Tensor) else getattr(self, f.name))
            for f in fields(self)})

    def to(self, device) -> "RolloutBatch":
        return RolloutBatch(**{
            f.name: (getattr(self, f.name).to(device)
                     if isinstance(getattr(self, f.name), torch.Tensor) else getattr(self, f.name))
            for f in fields(self)})


def make_batch(prompt_ids: list[list[int]], completions: list[Completion],
               advantages: torch.Tensor, pad_id: int) -> RolloutBatch:
    """One row per completion; prompt_ids[i] is the prompt of completions[i]."""
    P = max(len(p) for p in prompt_ids)
    C = max(1, max(len(c.token_ids) for c in completions))
    B = len(completions)
    input_ids = torch.full((B, P + C), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + C), dtype=torch.long)
    completion_mask = torch.zeros((B, C))
    sampler_logp = torch.zeros((B, C))
    for i, (prompt, c) in enumerate(zip(prompt_ids, completions)):
        n = len(c.token_ids)
        input_ids[i, P - len(prompt):P] = torch.tensor(prompt)
        attention_mask[i, P - len(prompt):P + n] = 1
        if n:
            input_ids[i, P:P + n] = torch.tensor(c.token_ids)
            sampler_logp[i, :n] = torch.tensor(c.logprobs)
            completion_mask[i, :n] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return RolloutBatch(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        completion_ids=input_ids[:, P:].clone(), completion_mask=completion_mask,
        sampler_logp=sampler_logp, truncated=torch.tensor([c.truncated for c in completions]),
        advantages=advantages.float(), prompt_width=P)


def token_logprobs(model, batch: RolloutBatch, temperature: float,
                   with_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per completion token log pi(token | prefix) (B, C), computed on logits / temperature, in
    float32; and the per-token entropy (no gradient) when asked."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids, use_cache=False).logits
    P = batch.prompt_width
    logits = logits[:, P - 1:-1, :].float() / temperature
    logp_all = logits.log_softmax(dim=-1)
    logp = logp_all.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp, entropy
