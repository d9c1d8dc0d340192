"""Per-token log-probs of the completions under a model: the trainer's one forward pass.

Two switches, both on by default; both off give the plain path (what the tests compare with):
  packing: the micro-batch's sequences back to back in one row, no padding (packing.py);
           off: prompts left-padded, completions right-padded.
  fused:   the LM head computes log p(token) and entropy in chunks of tokens from the final
           hidden states, never holding all N x V logits (fused_logprobs.py);
           off: full logits, log_softmax, gather.

An MoE model's rows may bring the routes their sampler chose (routing replay R3,
batch.routes), replayed at the positions of the tokens the sampler fed (policy/moe.py).

A vision-language model's rows bring their image tensors (batch.vision), joined in the order
the rows' image tokens lie in the flattened input (multimodal/processor.py); log-probs are read
at completion tokens only, so image tokens are never scored.

Under sequence parallelism the micro-batch is one packed row, each rank of the sp group holding
a slice of it, and the per-token results are gathered over the group (sequence_parallel.py).

The fused pass lives inside the LM head module (`LogprobHead`), so DeepSpeed ZeRO-3 gathers
its weight for forward and backward exactly as it does for any other layer; the head reads
only the positions that predict completion tokens.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megagrpo.multimodal.processor import join_image_tensors
from megagrpo.policy.fused_logprobs import fused_token_logprobs, logprobs_from_logits
from megagrpo.policy.moe import routing_of
from megagrpo.policy.packing import pack
from megagrpo.policy.sequence_parallel import SequenceParallel, gather_slices, slice_row


class LogprobHead(torch.nn.Module):
    """Drop-in for a causal LM's `lm_head` (same weight Parameter, same state-dict names):
    plain logits, unless a request (positions, targets, temperature) is set; then, for those
    flat positions only, the pairs (log p(target), entropy) from the fused chunked pass."""

    def __init__(self, head: torch.nn.Linear, chunk_size: int = 1024):
        super().__init__()
        self.weight = head.weight
        self.bias = head.bias
        self.chunk_size = chunk_size
        self.request: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.request is None:
            return F.linear(hidden, self.weight, self.bias)
        positions, targets, temperature = self.request
        selected = hidden.reshape(-1, hidden.shape[-1])[positions]
        logp, entropy = fused_token_logprobs(selected, self.weight, targets, temperature,
                                             self.chunk_size, with_entropy=True)
        return torch.stack([logp, entropy], dim=-1)


def install_logprob_head(model: torch.nn.Module, chunk_size: int) -> None:
    """Swap the HF model's lm_head for a LogprobHead; call before deepspeed.initialize."""
    head = model.get_output_embeddings()
    if head.bias is not None:
        raise ValueError("the fused log-prob pass supports LM heads without bias")
    model.lm_head = LogprobHead(head, chunk_size)


def _forward(model, input_ids, position_ids, attention_mask, positions, targets, temperature, fused,
             images: Optional[dict] = None, real: Optional[torch.Tensor] = None):
    """Run the model and read log p(target) and entropy at the flat `positions` of its
    (rows x width) output; images: the rows' image tensors (keyword arguments of a VLM's
    forward); real: (rows x width) bool, False on padding (an MoE model's routes are counted
    on the rest, policy/moe.py). Returns two (K,) tensors."""
    head = _head(model)
    routing = routing_of(model)
    if routing is not None:
        routing.real_tokens = None if real is None else real.reshape(-1)
    if fused:
        head.request = (positions, targets, temperature)
    try:
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                    use_cache=False, **(images or {})).logits
    finally:
        head.request = None
    if fused:
        return out[:, 0], out[:, 1]
    return logprobs_from_logits(out.reshape(-1, out.shape[-1])[positions], targets, temperature)


def _head(model) -> LogprobHead:
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model
    head = module.get_output_embeddings()
    if not isinstance(head, LogprobHead):
        raise TypeError("call install_logprob_head(model) before building the engine")
    return head


def _image_inputs(model, batch, order: list, device) -> dict:
    """The image tensors of batch rows `order` (in that order), for the model's forward."""
    if batch.vision is None:
        return {}
    module = getattr(model, "module", model)
    return join_image_tensors([batch.vision[i] for i in order], module.config.model_type, module.dtype, device)


def _use_sampler_routes(model, batch, starts: list[int], positions: int, device) -> None:
    """Routing replay R3: the rows' sampler routes (batch.routes), laid out at the flat
    positions of this forward where each sequence starts, replayed by an MoE model's routers."""
    routing = routing_of(model)
    if routing is not None:
        routing.use_sampler_routes(batch.routes, starts, batch.token_counts(), positions, device)


def _one_row(model) -> bool:
    """flash-attn varlen pays only for real tokens: pack everything into one row."""
    config = getattr(getattr(model, "module", model), "config", None)
    return str(getattr(config, "_attn_implementation", "")).startswith("flash")


def completion_logprobs(model, batch, temperature: float, packing: bool = True, fused: bool = True,
                        sp: Optional[SequenceParallel] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(token | prefix) and entropy for every completion token of a RolloutBatch, as
    (B, C) tensors laid out like batch.completion_ids (zeros on padding). sp: the micro-batch
    is one packed row split over the sp group (policy/sequence_parallel.py); every rank of it
    gets the whole result."""
    device = batch.completion_ids.device
    if packing:
        prompts, completions = batch.sequences()
        row_tokens = None if _one_row(model) or sp is not None else max(batch.token_counts())
        packed = pack(prompts, completions, row_tokens)
        _use_sampler_routes(model, batch, packed.starts, packed.input_ids.numel(), device)
        if sp is None:
            logp, entropy = _forward(model, packed.input_ids.to(device), packed.position_ids.to(device),
                                     None, packed.predict_at.to(device), packed.targets.to(device),
                                     temperature, fused, _image_inputs(model, batch, packed.order, device),
                                     packed.real.to(device))
        else:
            row = slice_row(packed, sp)
            mine = _forward(model, row.input_ids.to(device), row.position_ids.to(device), None,
                            row.predict_at.to(device), row.targets.to(device), temperature, fused)
            logp, entropy = gather_slices(torch.stack(mine, dim=-1), row, sp).unbind(dim=-1)
        index = (packed.rows.to(device), packed.cols.to(device))
    else:
        B, C = batch.completion_ids.shape
        P, width = batch.prompt_width, batch.input_ids.shape[1]
        # the output at column P-1+t of each row predicts completion token t
        positions = (torch.arange(B, device=device)[:, None] * width
                     + torch.arange(P - 1, P - 1 + C, device=device)[None, :]).reshape(-1)
        _use_sampler_routes(model, batch, [i * width + P - int(n) for i, n in enumerate(batch.prompt_lens)],
                            B * width, device)
        logp, entropy = _forward(model, batch.input_ids, batch.position_ids, batch.attention_mask,
                                 positions, batch.completion_ids.reshape(-1), temperature, fused,
                                 _image_inputs(model, batch, list(range(B)), device), batch.attention_mask.bool())
        index = (torch.arange(C, device=device)[None, :] < batch.completion_lens[:, None]).nonzero(as_tuple=True)
        logp, entropy = logp.view(B, C)[index], entropy.view(B, C)[index]
    zeros = torch.zeros(batch.completion_ids.shape, dtype=logp.dtype, device=device)
    return zeros.index_put(index, logp), zeros.index_put(index, entropy)
