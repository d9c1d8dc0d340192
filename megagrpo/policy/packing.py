"""Padding-free packing and token-budget micro-batches.

A packed micro-batch concatenates its prompt+completion sequences into one row with no
padding; position ids restart at 0 for every sequence, which is how transformers tells the
sequences apart (flash-attn varlen on GPU, a block-diagonal causal mask with SDPA on CPU).
The hidden state at position p predicts token p+1, so each completion token's log-prob is
read at the position just before it.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class PackedRows:
    input_ids: torch.Tensor      # (R, W) sequences back to back, rows padded to one width
    position_ids: torch.Tensor   # (R, W) restarting at 0 per sequence (and per padding run)
    predict_at: torch.Tensor     # (K,) flat positions in (R * W) that predict a completion token
    targets: torch.Tensor        # (K,) those completion tokens
    rows: torch.Tensor           # (K,) row of each completion token in the (B, C) layout
    cols: torch.Tensor           # (K,) column of each completion token in the (B, C) layout
    order: list                  # the sequences' indices in the order they lie in the flattened rows
    real: torch.Tensor           # (R, W) bool, False on the rows' padding
    starts: list                 # per sequence (by index), the flat position in (R * W) of its first token


def pack(prompts: list[list[int]], completions: list[list[int]],
         row_tokens: Optional[int] = None, pad_id: int = 0) -> PackedRows:
    """Concatenate prompt+completion pairs into rows of at most `row_tokens` tokens (first fit,
    longest first; None: everything in one row) and index the completion tokens.

    One row suits flash-attn varlen, whose cost follows the real sequences. SDPA on CPU builds
    a dense (W x W) block-diagonal mask per row, so there rows as short as the longest
    sequence keep the attention work near that of the sequences themselves."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    capacity = max(row_tokens or sum(lengths), max(lengths))
    bins, loads = [], []
    for seq in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((r for r, load in enumerate(loads) if load + lengths[seq] <= capacity), None)
        if slot is None:
            bins.append([]), loads.append(0)
            slot = len(bins) - 1
        bins[slot].append(seq)
        loads[slot] += lengths[seq]
    width = max(loads)
    input_ids = torch.full((len(bins), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(bins), width), dtype=torch.long)
    real = torch.zeros((len(bins), width), dtype=torch.bool)
    predict_at, targets, rows, cols, order = [], [], [], [], []
    starts = [0] * len(lengths)
    for r, members in enumerate(bins):
        offset = 0
        for seq in sorted(members):
            order.append(seq)
            prompt, completion = prompts[seq], completions[seq]
            n = len(prompt) + len(completion)
            input_ids[r, offset:offset + n] = torch.tensor(prompt + completion)
            position_ids[r, offset:offset + n] = torch.arange(n)
            real[r, offset:offset + n] = True
            starts[seq] = r * width + offset
            start = r * width + offset + len(prompt) - 1
            predict_at.extend(range(start, start + len(completion)))
            targets.extend(completion)
            rows.extend([seq] * len(completion))
            cols.extend(range(len(completion)))
            offset += n
        position_ids[r, offset:] = torch.arange(width - offset)  # padding: a block of its own
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return PackedRows(input_ids=input_ids, position_ids=position_ids,
                      predict_at=as_long(predict_at), targets=as_long(targets),
                      rows=as_long(rows), cols=as_long(cols), order=order, real=real, starts=starts)


def balanced_microbatches(lengths: list[int], max_tokens: int, min_count: int = 1) -> list[list[int]]:
    """Split sequence indices into the fewest micro-batches (at least min_count) whose token
    counts stay within max_tokens where possible, balancing the counts (longest first, each to
    the lightest micro-batch). A sequence longer than max_tokens gets a micro-batch alone.
    Returns index lists, each in ascending order; empty lists when there are more micro-batches
    than sequences (every rank must run the same number of forward passes)."""
    total = sum(lengths)
    count = max(min_count, min(-(-total // max_tokens), len(lengths)), 1)
    while True:
        heap = [(0, i) for i in range(count)]
        groups: list[list[int]] = [[] for _ in range(count)]
        for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            tokens, slot = heapq.heappop(heap)
            groups[slot].append(index)
            heapq.heappush(heap, (tokens + lengths[index], slot))
        loads = [sum(lengths[i] for i in g) for g in groups]
        over = [load for g, load in zip(groups, loads) if load > max_tokens and len(g) > 1]
        if not over or count >= len(lengths):
            return [sorted(g) for g in groups]
        count += 1
