"""model.tiled_mlp: DeepSpeed's `TiledMLP` in every decoder layer, for long rows.

A decoder layer's MLP keeps its intermediates for backward: gate, up, the activation and their
product, about 6 i values per token (i the intermediate size, 4864 against a hidden size of 896
in Qwen2.5-0.5B): most of what a layer keeps, and what the recomputed layer of gradient
checkpointing still holds for the whole row. TiledMLP runs the MLP on tiles of about
hidden-size tokens without keeping anything but its input, and recomputes each tile in backward,
so those intermediates exist for one tile at a time. Works on ZeRO 0 and 3 (DeepSpeed's
`ds_grad_is_ready` holds ZeRO-3's gradient reduction until the last tile; ZeRO 1-2's hooks would
reduce a gradient once per tile), with or without sequence parallelism.
"""
from __future__ import annotations

import math
import types

import torch

from megagrpo.cluster.distributed import all_reduce


def _tiles(x: torch.Tensor) -> int:
    """ceil(tokens / hidden size), the same on every rank: under ZeRO-3 each tile gathers the
    MLP's weights, a collective every rank must make as often as the others."""
    count = torch.tensor([max(1, math.ceil(x.shape[-2] / x.shape[-1]))])
    return int(all_reduce(count, "max")[0])


def tile_mlps(model: torch.nn.Module) -> int:
    """Wrap the `mlp` of every decoder layer of this HF model; returns how many."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    layers = model.get_decoder().layers
    for layer in layers:
        plain, weights = type(layer.mlp).forward, list(layer.mlp.parameters())

        def forward(self, x, plain=plain, weights=weights):
            return TiledMLP.apply(plain, self, x, _tiles(x), weights)

        layer.mlp.forward = types.MethodType(forward, layer.mlp)
    return len(layers)
