"""The process topology: world = dp x tp x pp. Everything else asks this object.

Ranks are laid out as DeepSpeed lays them out. Tensor parallel: tp fastest (AutoTP's mesh is
(dp, tp), row-major), so ranks 0..tp-1 form the first tp group. Pipeline parallel: DeepSpeed's
(pipe, data) topology, pipeline stage slowest, so stage s holds ranks s*dp .. s*dp+dp-1 and a
pipeline is the ranks {d, d+dp, d+2dp, ...}. Ranks of one tp group or pipeline (a "model
group") see the same prompts and share one rollout, sampled by the group's first rank;
different dp ranks see different prompts.
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
    def from_env(cls, tp_size: int = 1, pp_size: int = 1) -> "Topology":
        """Read the launcher's variables (deepspeed, torchrun, srun mapped by our scripts)."""
        if dist.is_available() and dist.is_initialized():
            world, rank = dist.get_world_size(), dist.get_rank()
        else:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            rank = int(os.environ.get("RANK", "0"))
        if world % (tp_size * pp_size):
            raise ValueError(f"world size {world} is not divisible by tensor_parallel_size x "
                             f"pipeline_parallel_size = {tp_size} x {pp_size}")
        return cls(world_size=world, rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                   tp_size=tp_size, pp_size=pp_size)

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pp_size)

    @property
    def dp_rank(self) -> int:
        if self.pp_size > 1:
            return self.rank % self.dp_size
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        """Pipeline stage of this rank."""
        return self.rank // self.dp_size if self.pp_size > 1 else 0

    @property
    def model_group_source(self) -> int:
        """Global rank of the first rank of this rank's tp group or pipeline (stage 0): it
        samples the group's rollout."""
        return self.dp_rank if self.pp_size > 1 else self.rank - self.tp_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return (f"world {self.world_size} = dp {self.dp_size} x tp {self.tp_size} x "
                f"pp {self.pp_size}; this is rank {self.rank} (dp rank {self.dp_rank}, "
                f"tp rank {self.tp_rank}, pipeline stage {self.pp_rank})")
