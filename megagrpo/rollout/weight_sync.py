"""Weight sync: a stream of (HF name, whole tensor) from the policy (policy/weight_gather.py)
into the generator, in place."""
from __future__ import annotations

import time
from typing import Iterator

import torch


def sync_weights(tensors: Iterator[tuple[str, torch.Tensor]], rollout_engine, partial: bool = False) -> float:
    """Stream (HF name, whole tensor) pairs into the rollout engine in place; returns seconds
    taken. A rank without an engine to update (None) still runs the stream to the end: the
    gathers (ZeRO-3, AutoTP, pipeline stages) are collective. partial: the stream holds only
    the weights that changed (the engine keeps the others)."""
    start = time.perf_counter()
    if rollout_engine is None:
        for _ in tensors:
            pass
    else:
        rollout_engine.wake_up()
        rollout_engine.load_weights(tensors, partial=partial)
    return time.perf_counter() - start
