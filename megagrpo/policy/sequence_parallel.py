"""Sequence parallelism (parallel.sequence_parallel_size = s): each packed row is split over the
s ranks of an sp group along the sequence, so that a trajectory longer than one rank's
activations can train.

What DeepSpeed (0.19.8) gives, and we use: `UlyssesSPAttentionHF`, whose all-to-alls turn each
rank's slice of the sequence with all heads into the whole sequence with heads/s, run an
attention core there, and turn it back; `parallel_state_sp`, the sp groups it reduces
gradients over (the topology creates them, cluster/topology.py); its engine, which sums the
gradients over the sp group and averages them over dp. Everything else in a decoder layer
works per token and runs on the local slice unchanged.

What we write, and why not DeepSpeed's `register_with_transformers`: it overrides transformers'
global `sdpa`/flash key (every model in the process, the reference and the reward model
included), fixes the batch size, and drops the mask, so with SDPA the sequences packed into a
row would attend to each other. Here the Ulysses module is registered under a key of its own
on the models that ask for it, and its core attends within each packed sequence: flash-attn's
varlen kernel from the gathered position ids on GPU, else SDPA causal per sequence.

The log-prob pass (policy/logprobs.py) reads the fused head on each rank's slice only (the
positions that predict a completion token there) and gathers the (token, [log p, entropy])
pairs over the sp group in sequence order; the gather's backward hands each rank the gradient
of its own slice, so every loss type, GSPO's sequence ratios included, runs unchanged on the
whole sequence's values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megagrpo.policy.packing import PackedRows

ATTENTION_KEY = "megagrpo_ulysses"


@dataclass
class SequenceParallel:
    """This rank's place in its sp group."""
    group: Any
    rank: int
    size: int

    @classmethod
    def of(cls, topology) -> "SequenceParallel | None":
        if topology.sp_size == 1:
            return None
        return cls(topology.sp_group, topology.sp_rank, topology.sp_size)


@dataclass
class RowSlice:
    """One rank's slice of a packed row: its columns, and the completion tokens it predicts."""
    input_ids: torch.Tensor      # (1, W / s)
    position_ids: torch.Tensor   # (1, W / s): each sequence's own positions
    predict_at: torch.Tensor     # (k,) local columns that predict a completion token
    targets: torch.Tensor        # (k,) those tokens
    counts: list[int]            # k of every rank of the group, in rank order


def slice_row(packed: PackedRows, sp: SequenceParallel, pad_id: int = 0) -> RowSlice:
    """Pad the one packed row to a multiple of s columns (the padding a block of its own) and
    take this rank's contiguous share; completion tokens go with the column that predicts them."""
    if packed.input_ids.shape[0] != 1:
        raise ValueError("sequence parallelism splits one packed row; pack with row_tokens=None")
    width = packed.input_ids.shape[1]
    share = -(-width // sp.size)
    extra = share * sp.size - width
    input_ids = torch.nn.functional.pad(packed.input_ids, (0, extra), value=pad_id)
    position_ids = torch.cat([packed.position_ids, torch.arange(extra).unsqueeze(0)], dim=1)
    bounds = torch.arange(sp.size + 1) * share
    counts = torch.bucketize(packed.predict_at, bounds, right=True).bincount(minlength=sp.size + 1)[1:sp.size + 1]
    first = sp.rank * share
    mine = (packed.predict_at >= first) & (packed.predict_at < first + share)
    return RowSlice(input_ids=input_ids[:, first:first + share], position_ids=position_ids[:, first:first + share],
                    predict_at=packed.predict_at[mine] - first, targets=packed.targets[mine],
                    counts=counts.tolist())


class _GatherSlices(torch.autograd.Function):
    """Every rank's (k_r, ...) rows, concatenated in rank order, on every rank; backward
    returns this rank's rows of the gradient (each rank holds the same whole loss)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], rank: int, group) -> torch.Tensor:
        ctx.start, ctx.end = sum(counts[:rank]), sum(counts[:rank + 1])
        padded = local.new_zeros((max(counts), *local.shape[1:]))
        padded[:local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.start:ctx.end], None, None, None


def gather_slices(local: torch.Tensor, row: RowSlice, sp: SequenceParallel) -> torch.Tensor:
    return _GatherSlices.apply(local, row.counts, sp.rank, sp.group)


def _packed_causal_sdpa(module, query, key, value, attention_mask, position_ids=None, dropout=0.0,
                        scaling=None, **kwargs):
    """SDPA, causal within each packed sequence (position ids restart at 0 for each): one call
    per sequence, so no (W x W) mask is built for a long row. Shapes as transformers' cores:
    (1, heads, W, d) in, (1, W, heads, d) out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    starts = (position_ids[0] == 0).nonzero().flatten().tolist() + [query.shape[2]]
    pieces = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                                     dropout=dropout, scaling=scaling, is_causal=True)[0]
              for a, b in zip(starts, starts[1:]) if b > a]
    return torch.cat(pieces, dim=1), None


def sum_gradients_over_sp(ds_config: dict, model: torch.nn.Module) -> None:
    """Make every ZeRO stage sum the gradients over the sp group (each rank's backward holds
    its slice's share of the whole loss) and average them over dp. DeepSpeed 0.19.8 does so in
    ZeRO 0-2 and in ZeRO-3's contiguous all-reduce, but ZeRO-3's reduce-scatter (its default)
    averages over sp too, halving the gradient at sp 2 (docs/upstream-issues.md). So ZeRO-3
    takes the contiguous path: reduce_scatter off, and buckets that hold the largest trained
    parameter (a larger one would go the reduce-scatter way)."""
    zero = ds_config.setdefault("zero_optimization", {})
    if int(zero.get("stage", 0)) != 3:
        return
    largest = max(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    zero.update(reduce_scatter=False, contiguous_gradients=True,
                reduce_bucket_size=max(int(float(zero.get("reduce_bucket_size", 5e8))), largest))


def use_ulysses_attention(model, sp: SequenceParallel) -> None:
    """Make this HF model's attention Ulysses over the sp group (before deepspeed.initialize)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    core_name = str(model.config._attn_implementation)
    core = ALL_ATTENTION_FUNCTIONS[core_name] if core_name.startswith("flash") else _packed_causal_sdpa
    text = model.config.get_text_config()
    ulysses = UlyssesSPAttentionHF(
        attn=core, batch_size=1, attn_head_count=text.num_attention_heads,
        attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        kv_head_count=text.num_key_value_heads, num_hidden_layers=text.num_hidden_layers,
        process_group=sp.group, seq_length_is_variable=True)

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        # the mask transformers built is for the local slice; the core masks per sequence
        return ulysses(module, query, key, value, None, *args, **kwargs)

    key = f"{ATTENTION_KEY}_{text.num_attention_heads}_{text.num_key_value_heads}_{core_name}"  # one per shape
    AttentionInterface.register(key, attention)
    model.set_attn_implementation(key)
