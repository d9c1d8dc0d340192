"""The process topology: world, data-parallel rank and size. Everything else asks this object.

Tensor and pipeline parallel sizes are 1 until they land (issue #3); the seams are here so
that data sharding and the rollout already ask for `dp_rank`/`dp_size`, not the global rank.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    world_size: int
    rank: int
    local_rank: int
    tp_size: int = 1
    pp_size: int = 1

    @classmethod
    def from_env(cls) -> "Topology":
        """Read the launcher's variables (deepspeed, torchrun, srun mapped by our scripts)."""
        if dist.is_available() and dist.is_initialized():
            world, rank = dist.get_world_size(), dist.get_rank()
        else:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            rank = int(os.environ.get("RANK", "0"))
        return cls(world_size=world, rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pp_size)

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp_size * self.pp_size)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return (f"world {self.world_size} = dp {self.dp_size} x tp {self.tp_size} x "
                f"pp {self.pp_size}; this is rank {self.rank} (dp rank {self.dp_rank})")
