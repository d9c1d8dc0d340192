"""Per-token log-probs of the completions under a model: the trainer's one forward pass.

Two switches, both on by default; off gives the reference path:
  packing: the micro-batch's sequences back to back in one row, no padding (packing.py);
           off: prompts left-padded, completions right-padded.
  fused:   the LM head computes log p(token) and entropy in chunks of tokens from the final
           hidden states, never holding all N x V logits (fused_logprobs.py);
           off: full logits, log_softmax, gather.

The fused pass lives inside the LM head module (`LogprobHead`), so DeepSpeed ZeRO-3 gathers
its weight for forward and backward exactly as it does for any other layer, and transformers
only computes the head at the positions that predict completion tokens (`logits_to_keep`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .fused_logprobs import fused_token_logprobs
from .packing import pack


class LogprobHead(torch.nn.Module):
    """Drop-in for a causal LM's `lm_head` (same weight Parameter, same state-dict names):
    plain logits, unless a request (targets, temperature) is set; then per position the pair
    (log p(target), entropy) from the fused chunked pass."""

    def __init__(self, head: torch.nn.Linear, chunk_size: int = 1024):
        super().__init__()
        self.weight = head.weight
        self.bias = head.bias
        self.chunk_size = chunk_size
        self.request: Optional[tuple[torch.Tensor, float]] = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.request is None:
            return F.linear(hidden, self.weight, self.bias)
        targets, temperature = self.request
        shape = hidden.shape[:-1]
        logp, entropy = fused_token_logprobs(hidden.reshape(-1, hidden.shape[-1]), self.weight,
                                             targets.reshape(-1), temperature, self.chunk_size,
                                             with_entropy=True)
        return torch.stack([logp, entropy], dim=-1).reshape(*shape, 2)


def install_logprob_head(model: torch.nn.Module, chunk_size: int) -> None:
    """Swap the HF model's lm_head for a LogprobHead; call before deepspeed.initialize."""
    head = model.get_output_embeddings()
    if head.bias is not None:
        raise ValueError("the fused log-prob pass supports LM heads without bias")
    model.lm_head = LogprobHead(head, chunk_size)


def _forward(model, input_ids, position_ids, attention_mask, keep, targets, temperature, fused):
    """Run the model, reading the head only at positions `keep` (1-D). Returns (logp, entropy)
    shaped like `targets`."""
    head = _head(model)
    if fused:
        head.request = (targets, temperature)
    try:
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                    logits_to_keep=keep, use_cache=False).logits
    finally:
        head.request = None
    if fused:
        return out[..., 0].reshape(targets.shape), out[..., 1].reshape(targets.shape)
    logp_all = (out.float() / temperature).log_softmax(dim=-1)
    logp = logp_all.gather(-1, targets.reshape(out.shape[:-1]).unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp.reshape(targets.shape), entropy.reshape(targets.shape)


def _head(model) -> LogprobHead:
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model
    head = module.get_output_embeddings()
    if not isinstance(head, LogprobHead):
        raise TypeError("call install_logprob_head(model) before building the engine")
    return head


def completion_logprobs(model, batch, temperature: float, packing: bool = True,
                        fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(token | prefix) and entropy for every completion token of a RolloutBatch, as
    (B, C) tensors laid out like batch.completion_ids (zeros on padding)."""
    if packing:
        prompts, completions = batch.sequences()
        packed = pack(prompts, completions)
        device = batch.completion_ids.device
        logp, entropy = _forward(model, packed.input_ids.to(device), packed.position_ids.to(device),
                                 None, packed.predict_at.to(device), packed.targets.to(device),
                                 temperature, fused)
        rows, cols = packed.rows.to(device), packed.cols.to(device)
        out_logp = torch.zeros(batch.completion_ids.shape, dtype=logp.dtype, device=device)
        out_logp = out_logp.index_put((rows, cols), logp)
        out_entropy = torch.zeros_like(out_logp).index_put((rows, cols), entropy.detach())
        return out_logp, out_entropy
    P, C = batch.prompt_width, batch.completion_ids.shape[1]
    keep = torch.arange(P - 1, P - 1 + C, device=batch.input_ids.device)
    logp, entropy = _forward(model, batch.input_ids, batch.position_ids, batch.attention_mask,
                             keep, batch.completion_ids, temperature, fused)
    mask = batch.completion_mask
    return logp * mask, entropy.detach() * mask
