"""The policy's parameters as a stream of (HF name, whole tensor), bucket by bucket: what the
weight sync and the HF export read.

Under ZeRO-3 each bucket is gathered (`deepspeed.zero.GatheredParameters`), consumed by the
receiver and released before the next one, so no rank ever holds a second full copy of the
model (gathering everything at once runs out of memory, TRL #5766). Every rank must iterate
the stream to the end: the gathers are collectives.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import deepspeed
import torch


def named_full_tensors(module: torch.nn.Module, bucket_mb: int = 256,
                       trained_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every parameter (trained_only: those that train, e.g. not a
    frozen vision tower), whole: ZeRO-3 partitions are gathered per bucket, and AutoTP
    (tensor-parallel) shards are gathered per layer inside it."""
    def units():
        seen = set()
        for module_name, owner in module.named_modules():
            for name, param in owner.named_parameters(recurse=False):
                if id(param) in seen or (trained_only and not param.requires_grad):
                    continue  # tied weights are sent once, under their first name
                seen.add(id(param))
                yield [param], whole_unit(f"{module_name}.{name}" if module_name else name, param, owner)
    return stream_units(units(), bucket_mb)


def whole_unit(name, param, owner):
    def produce():
        with tensor_parallel_gather(param, owner):
            yield name, param.data
    return produce


def stream_units(units, bucket_mb: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Gather units (params, producer) bucket by bucket and yield what each producer makes of
    its gathered params: a bucket's ZeRO-3 partitions are gathered together and released
    before the next bucket."""
    bucket_bytes = bucket_mb * 2**20
    bucket, size = [], 0
    for params, produce in units:
        bucket.append((params, produce))
        size += sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params)
        if size >= bucket_bytes:
            yield from _gathered(bucket)
            bucket, size = [], 0
    if bucket:
        yield from _gathered(bucket)


def _gathered(bucket):
    params = [p for ps, _ in bucket for p in ps]
    partitioned = any(hasattr(p, "ds_id") for p in params)
    context = (deepspeed.zero.GatheredParameters(params, modifier_rank=None)
               if partitioned else contextlib.nullcontext())
    with context:
        for _, produce in bucket:
            yield from produce()


def tensor_parallel_gather(param, owner):
    """Whole tensors out of an AutoTP-sharded layer (a no-op elsewhere)."""
    if not getattr(param, "ds_is_replaced_module", False):
        return contextlib.nullcontext()
    from deepspeed.module_inject.layers import GatherReplacedLayerParams
    return GatherReplacedLayerParams([param], owner)
