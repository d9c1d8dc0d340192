"""What a step carries: the sampler's Completions, and the RolloutBatch made of them (prompts and
completions as padded tensors) with micro-batches of it.

A multi-turn completion (rollout/agent.py) is every token after the prompt, sampled turns and
inserted tool messages alike; its model_mask becomes completion_mask, so the loss and every
per-token statistic cover the sampled tokens only.

A prompt with images (a vision-language model) keeps them beside its row: `vision` holds each
row's multimodal.processor.VisionPrompt (the G rows of a prompt share one), whose image tensors
the forward pass joins in row order (policy/logprobs.py). Under routing replay R3 `routes`
holds each row's experts as the sampler chose them, replayed in every pass (policy/moe.py).

Layout: prompts left-padded to P, completions right-padded to C, so that position P-1+t of the
logits predicts completion token t. Position ids count real tokens only, as the sampler does.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import numpy as np
import torch


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    truncated: bool  # stopped by max_new_tokens, not by EOS or a stop string
    model_mask: Optional[list[int]] = None  # 1 where the model sampled the token (0: tool message); None: all
    versions: Optional[list[int]] = None  # per token, the training steps in the weights that sampled it
    # (rollout.partial_rollouts; None: all of one version)
    routes: Optional[np.ndarray] = None  # (rollout.routing_replay r3, an MoE model) the experts the sampler
    # chose, (T, layers, k) for the first T tokens of prompt + completion that it fed (policy/moe.py)


_FULL_WIDTH = ("input_ids", "attention_mask", "position_ids")


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor         # (B, P + C)
    attention_mask: torch.Tensor    # (B, P + C)
    position_ids: torch.Tensor      # (B, P + C)
    completion_ids: torch.Tensor    # (B, C)
    completion_mask: torch.Tensor   # (B, C) float, 1 on real completion tokens
    sampler_logp: torch.Tensor      # (B, C) the generator's logprobs
    truncated: torch.Tensor         # (B,) bool
    advantages: torch.Tensor        # (B,)
    prompt_lens: torch.Tensor       # (B,) real prompt tokens per row
    completion_lens: torch.Tensor   # (B,) real completion tokens per row
    prompt_width: int
    ref_logp: Optional[torch.Tensor] = None   # (B, C)
    old_logp: Optional[torch.Tensor] = None   # (B, C)
    teacher_logp: Optional[torch.Tensor] = None   # (B, C) a distillation teacher's, at temperature 1
    vision: Optional[list] = None   # (B,) per row its VisionPrompt or None; None: no row has images
    routes: Optional[list] = None   # (B,) per row the sampler's routes (Completion.routes); None: none sampled

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: list[int]) -> "RolloutBatch":
        """A micro-batch of these rows, with the padding columns none of them needs removed."""
        index = torch.tensor(rows, dtype=torch.long, device=self.input_ids.device)
        P = int(self.prompt_lens[index].max())
        C = max(1, int(self.completion_lens[index].max()))
        full_width = slice(self.prompt_width - P, self.prompt_width + C)  # prompt + completion
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value[index]
                if value.dim() == 2:
                    value = value[:, full_width if f.name in _FULL_WIDTH else slice(0, C)]
            elif isinstance(value, list):
                value = [value[i] for i in rows]
            values[f.name] = value
        values["prompt_width"] = P
        return RolloutBatch(**values)

    def sequences(self) -> tuple[list[list[int]], list[list[int]]]:
        """Each row's prompt and completion token ids, without padding."""
        P = self.prompt_width
        prompts = [self.input_ids[i, P - int(n):P].tolist() for i, n in enumerate(self.prompt_lens)]
        completions = [self.completion_ids[i, :int(n)].tolist() for i, n in enumerate(self.completion_lens)]
        return prompts, completions

    def token_counts(self) -> list[int]:
        """Prompt + completion tokens per row (what a packed micro-batch holds)."""
        return (self.prompt_lens + self.completion_lens).tolist()

    def to(self, device) -> "RolloutBatch":
        return RolloutBatch(**{
            f.name: (getattr(self, f.name).to(device)
                     if isinstance(getattr(self, f.name), torch.Tensor) else getattr(self, f.name))
            for f in fields(self)})


def make_batch(prompt_ids: list[list[int]], completions: list[Completion],
               advantages: torch.Tensor, pad_id: int, visions: Optional[list] = None) -> RolloutBatch:
    """One row per completion; prompt_ids[i] is the prompt of completions[i], visions[i] its
    images (a VisionPrompt, or None)."""
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
            completion_mask[i, :n] = 1 if c.model_mask is None else torch.tensor(c.model_mask, dtype=torch.float)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return RolloutBatch(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        completion_ids=input_ids[:, P:].clone(), completion_mask=completion_mask,
        sampler_logp=sampler_logp, truncated=torch.tensor([c.truncated for c in completions]),
        advantages=advantages.float(), prompt_width=P,
        prompt_lens=torch.tensor([len(p) for p in prompt_ids]),
        completion_lens=torch.tensor([len(c.token_ids) for c in completions]),
        vision=list(visions) if visions is not None and any(v is not None for v in visions) else None,
        routes=[c.routes for c in completions] if any(c.routes is not None for c in completions) else None)
