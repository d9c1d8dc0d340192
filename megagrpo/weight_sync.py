"""Weight sync: the trainer's parameters as a stream of (HF name, full tensor), bucket by bucket.

Under ZeRO-3 each bucket is gathered (`deepspeed.zero.GatheredParameters`), consumed by the
receiver and released before the next one, so no rank ever holds a second full copy of the
model (gathering everything at once runs out of memory, TRL #5766). Every rank must iterate
the stream to the end: the gathers are collectives.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

import deepspeed
import torch


def named_full_tensors(module: torch.nn.Module, bucket_mb: int = 256) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every parameter; ZeRO-3 partitions are gathered per bucket."""
    bucket_bytes = bucket_mb * 2**20
    bucket, size = [], 0
    for name, param in module.named_parameters():
        bucket.append((name, param))
        size += getattr(param, "ds_numel", param.numel()) * param.element_size()
        if size >= bucket_bytes:
            yield from _gathered(bucket)
            bucket, size = [], 0
    if bucket:
        yield from _gathered(bucket)


def _gathered(bucket):
    params = [p for _, p in bucket]
    partitioned = any(hasattr(p, "ds_id") for p in params)
    context = (deepspeed.zero.GatheredParameters(params, modifier_rank=None)
               if partitioned else contextlib.nullcontext())
    with context:
        for name, param in bucket:
            yield name, param.data


def sync_weights(module: torch.nn.Module, rollout_engine, bucket_mb: int = 256) -> float:
    """Stream the trainer's weights into the rollout engine in place; returns seconds taken."""
    start = time.perf_counter()
    rollout_engine.wake_up()
    rollout_engine.load_weights(named_full_tensors(module, bucket_mb))
    return time.perf_counter() - start
