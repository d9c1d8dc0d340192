"""The process topology: world = dp x sp x tp x pp, its rank arithmetic and its process groups.
Everything else asks this object; nobody recomputes ranks or fetches groups elsewhere.

Ranks are laid out as DeepSpeed lays them out: its (pipe, data, model) topology, pipeline stage
slowest and tp fastest, with the sequence-parallel ranks between data and tensor, so

    rank = pp_rank * (dp * sp * tp) + dp_rank * (sp * tp) + sp_rank * tp + tp_rank

(AutoTP's (dp, tp) mesh is the pp = 1 case; DeepSpeed's (pipe, data) topology the tp = 1 case;
Ulysses' consecutive sp groups, `parallel_state_sp`, the tp = pp = 1 case, the only one with
sp > 1 in this version). The sp * tp * pp ranks of one data-parallel replica (a "model group")
see the same prompts and share one rollout; different dp ranks see different prompts. Inside a
stage, the tp ranks (the "tp group") split its decoder layers; the sp ranks (the "sp group")
split each sequence (policy/sequence_parallel.py).

The generator is laid out on its own: each block of `generator_tp` consecutive ranks (a
"generator group", vLLM's tp group under the external launcher) holds one engine sharded
between them. A block lies inside one trainer tp group (generator_tp divides tp: the block at
tp rank 0 samples, the group's first rank shares the rollout) or spans whole ones (every rank
samples, the block pooling its dp replicas' prompts); under pipelines generator_tp is 1 and the
model group's first rank samples.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    world_size: int
    rank: int
    local_rank: int
    tp_size: int = 1
    pp_size: int = 1
    sp_size: int = 1
    dp_group: Optional[Any] = field(default=None, compare=False, repr=False)
    """Ranks that hold the same model shard and see different prompts (None: the whole world)."""
    model_group: Optional[Any] = field(default=None, compare=False, repr=False)
    """The sp * tp * pp ranks of this rank's replica (None: this rank alone)."""
    tp_group: Optional[Any] = field(default=None, compare=False, repr=False)
    """The tp ranks of this rank's pipeline stage (None: tp 1)."""
    generator_tp: int = 1
    generator_group: Optional[Any] = field(default=None, compare=False, repr=False)
    """The generator_tp ranks that hold one vLLM engine with this rank (None: generator_tp 1)."""
    sp_group: Optional[Any] = field(default=None, compare=False, repr=False)
    """The sp ranks that split this rank's sequences (None: sp 1)."""

    @classmethod
    def from_env(cls, tp_size: int = 1, pp_size: int = 1, generator_tp: int = 1, sp_size: int = 1) -> "Topology":
        """Read the launcher's variables (deepspeed, torchrun, srun mapped by our scripts)."""
        if dist.is_available() and dist.is_initialized():
            world, rank = dist.get_world_size(), dist.get_rank()
        else:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            rank = int(os.environ.get("RANK", "0"))
        if world % (tp_size * pp_size * sp_size):
            raise ValueError(f"world size {world} is not divisible by tensor_parallel_size x "
                             f"pipeline_parallel_size x sequence_parallel_size = {tp_size} x {pp_size} x {sp_size}")
        if world % generator_tp:
            raise ValueError(f"world size {world} is not divisible by rollout.tensor_parallel_size {generator_tp}")
        return cls(world_size=world, rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                   tp_size=tp_size, pp_size=pp_size, sp_size=sp_size, generator_tp=generator_tp)

    def with_groups(self) -> "Topology":
        """Collective: create the dp and model process groups (every rank creates every group,
        in the same order, as torch.distributed requires) and return a copy that holds them."""
        dp_group = model_group = tp_group = None
        if self.dp_size < self.world_size:  # (with dp 1: a group of one, so gathers stay local)
            for first in range(self.world_size):
                ranks = self.dp_ranks(first)
                if ranks[0] == first:
                    group = dist.new_group(ranks)
                    if self.rank in ranks:
                        dp_group = group
        if self.model_size > 1:
            for dp_rank in range(self.dp_size):
                ranks = self.model_ranks(dp_rank)
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    model_group = group
        if self.tp_size > 1 and self.pp_size == 1 and self.sp_size == 1:
            tp_group = model_group
        elif self.tp_size > 1:
            tp_group = self._block_group(self.tp_size)
        generator_group = self._block_group(self.generator_tp) if self.generator_tp > 1 else None
        sp_group = None
        if self.sp_size > 1:  # DeepSpeed's own groups (its mpu for deepspeed.initialize): blocks of sp ranks
            from deepspeed.runtime.sequence_parallel import parallel_state_sp
            parallel_state_sp.initialize_sequence_parallel(self.sp_size)
            sp_group = parallel_state_sp.get_sequence_parallel_group()
        return dataclasses.replace(self, dp_group=dp_group, model_group=model_group, tp_group=tp_group,
                                   generator_group=generator_group, sp_group=sp_group)

    @property
    def deepspeed_mpu(self):
        """What deepspeed.initialize takes as `mpu`: Ulysses' group registry under sp, else None."""
        if self.sp_size == 1:
            return None
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        return parallel_state_sp

    def _block_group(self, size: int):
        """Collective: a group for each block of `size` consecutive ranks; returns this rank's."""
        mine = None
        for first in range(0, self.world_size, size):
            group = dist.new_group(list(range(first, first + size)))
            if first <= self.rank < first + size:
                mine = group
        return mine

    def at(self, rank: int) -> "Topology":
        """The same layout seen from another rank (for tables of every rank's place)."""
        return Topology(self.world_size, rank, 0, self.tp_size, self.pp_size, self.sp_size,
                        generator_tp=self.generator_tp)

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pp_size * self.sp_size)

    @property
    def model_size(self) -> int:
        """Ranks in one model group (one data-parallel replica): sp x tp x pp."""
        return self.sp_size * self.tp_size * self.pp_size

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int, sp_rank: int = 0) -> int:
        """The global rank at a (stage, dp rank, tp rank, sp rank) place."""
        return ((pp_rank * self.dp_size + dp_rank) * self.sp_size + sp_rank) * self.tp_size + tp_rank

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp_size * self.sp_size) % self.dp_size

    @property
    def sp_rank(self) -> int:
        """This rank's place in its sp group: which slice of each sequence it holds."""
        return self.rank // self.tp_size % self.sp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        """Pipeline stage of this rank."""
        return self.rank // (self.dp_size * self.sp_size * self.tp_size)

    def model_ranks(self, dp_rank: Optional[int] = None) -> list[int]:
        """Global ranks of a model group, stage by stage, then sp rank by sp rank and tp rank by
        tp rank within a stage; by default this rank's."""
        d = self.dp_rank if dp_rank is None else dp_rank
        return sorted(self.rank_of(s, d, t, q) for s in range(self.pp_size) for q in range(self.sp_size)
                      for t in range(self.tp_size))

    def stage_ranks(self, pp_rank: int) -> list[int]:
        """The tp ranks of one pipeline stage of this rank's model group."""
        return [self.rank_of(pp_rank, self.dp_rank, t, self.sp_rank) for t in range(self.tp_size)]

    def dp_ranks(self, rank: Optional[int] = None) -> list[int]:
        """Global ranks that hold the same shard as `rank` (by default this rank), in dp order."""
        place = self if rank is None else self.at(rank)
        return [self.rank_of(place.pp_rank, d, place.tp_rank, place.sp_rank) for d in range(self.dp_size)]

    @property
    def model_group_source(self) -> int:
        """Global rank of the first rank of this rank's model group (stage 0, tp rank 0): it
        samples the group's rollout."""
        return self.model_ranks()[0]

    @property
    def samples_rollout(self) -> bool:
        """Whether this rank's rollout is its model group's: the group's first rank, whose
        completions every rank of the group trains on."""
        return self.rank == self.model_group_source

    @property
    def generates(self) -> bool:
        """Whether this rank's engine shard takes part in its model group's rollout (its
        generator group includes the model group's first rank)."""
        return self.pp_rank == 0 and self.sp_rank == 0 and self.tp_rank < self.generator_tp

    @property
    def shares_rollout(self) -> bool:
        """Whether some ranks of this model group do not generate and receive the rollout
        from the group's first rank."""
        return self.model_size > 1 and not (self.pp_size == 1 and self.sp_size == 1
                                            and self.generator_tp >= self.tp_size)

    def generator_ranks(self) -> list[int]:
        """Global ranks of this rank's generator group (consecutive, as vLLM forms them)."""
        first = self.rank - self.rank % self.generator_tp
        return list(range(first, first + self.generator_tp))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        sp = f" x sp {self.sp_size}" if self.sp_size > 1 else ""
        sp_rank = f", sp rank {self.sp_rank}" if self.sp_size > 1 else ""
        return (f"world {self.world_size} = dp {self.dp_size}{sp} x tp {self.tp_size} x "
                f"pp {self.pp_size}, vLLM tp {self.generator_tp}; this is rank {self.rank} (dp rank {self.dp_rank}"
                f"{sp_rank}, tp rank {self.tp_rank}, pipeline stage {self.pp_rank})")
