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
    """Yield (name, tensor) for every parameter, whole: ZeRO-3 partitions are gathered per
    bucket, and AutoTP (tensor-parallel) shards are gathered per layer inside it."""
    bucket_bytes = bucket_mb * 2**20
    bucket, size, seen = [], 0, set()
    for module_name, owner in module.named_modules():
        for name, param in owner.named_parameters(recurse=False):
            if id(param) in seen:  # tied weights are sent once, under their first name
                continue
            seen.add(id(param))
            bucket.append((f"{module_name}.{name}" if module_name else name, param, owner))
            size += getattr(param, "ds_numel", param.numel()) * param.element_size()
            if size >= bucket_bytes:
                yield from _gathered(bucket)
                bucket, size = [], 0
    if bucket:
        yield from _gathered(bucket)


def _gathered(bucket):
    params = [p for _, p, _ in bucket]
    partitioned = any(hasattr(p, "ds_id") for p in params)
    context = (deepspeed.zero.GatheredParameters(params, modifier_rank=None)
               if partitioned else contextlib.nullcontext())
    with context:
        for name, param, owner in bucket:
            with tensor_parallel_gather(param, owner):
                yield name, param.data


def tensor_parallel_gather(param, owner):
    """Whole tensors out of an AutoTP-sharded layer (a no-op elsewhere)."""
    if not getattr(param, "ds_is_replaced_module", False):
        return contextlib.nullcontext()
    from deepspeed.module_inject.layers import GatherReplacedLayerParams
    return GatherReplacedLayerParams([param], owner)


def sync_weights(tensors: Iterator[tuple[str, torch.Tensor]], rollout_engine) -> float:
    """Stream (HF name, whole tensor) pairs into the rollout engine in place; returns seconds
    taken. A rank without an engine to update (None) still runs the stream to the end: the
    gathers (ZeRO-3, AutoTP, pipeline stages) are collective."""
    start = time.perf_counter()
    if rollout_engine is None:
        for _ in tensors:
            pass
    else:
        rollout_engine.wake_up()
        rollout_engine.load_weights(tensors)
    return time.perf_counter() - start
