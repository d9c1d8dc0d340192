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

import torch


@dataclass
class PackedRows:
    input_ids: torch.Tensor      # (1, T) every sequence, back to back
    position_ids: torch.Tensor   # (1, T) restarting at 0 per sequence
    predict_at: torch.Tensor     # (K,) positions whose output predicts a completion token
    targets: torch.Tensor        # (K,) those completion tokens
    rows: torch.Tensor           # (K,) row of each completion token in the (B, C) layout
    cols: torch.Tensor           # (K,) column of each completion token in the (B, C) layout


def pack(prompts: list[list[int]], completions: list[list[int]]) -> PackedRows:
    """Concatenate prompt+completion pairs; index the completion tokens."""
    ids, positions, predict_at, targets, rows, cols = [], [], [], [], [], []
    offset = 0
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        sequence = prompt + completion
        ids.extend(sequence)
        positions.extend(range(len(sequence)))
        start = offset + len(prompt) - 1
        predict_at.extend(range(start, start + len(completion)))
        targets.extend(completion)
        rows.extend([row] * len(completion))
        cols.extend(range(len(completion)))
        offset += len(sequence)
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return PackedRows(input_ids=as_long(ids)[None], position_ids=as_long(positions)[None],
                      predict_at=as_long(predict_at), targets=as_long(targets),
                      rows=as_long(rows), cols=as_long(cols))


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
