"""Weight sync: a stream of (HF name, whole tensor) from the policy (policy/weight_gather.py)
into the generator, in place."""
from __future__ import annotations

import time
from typing import Iterator

import torch


def sync_weights(tensors: Iterator[tuple[str, torch.Tensor]], generator, partial: bool = False,
                 step: int = 0) -> float:
    """Stream (HF name, whole tensor) pairs into the generator in place; returns seconds
    taken. A rank without a generator to update (None) still runs the stream to the end: the
    gathers (ZeRO-3, AutoTP, pipeline stages) are collective. partial: the stream holds only
    the weights that changed (the generator keeps the others). step: the training steps in
    them."""
    start = time.perf_counter()
    if generator is None:
        for _ in tensors:
            pass
    else:
        generator.wake_up(tags=("weights",))  # the KV cache stays asleep until sampling
        generator.load_weights(tensors, partial=partial, step=step)
    return time.perf_counter() - start
