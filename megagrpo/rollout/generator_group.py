"""A generator group: the rollout.tensor_parallel_size consecutive ranks that hold one vLLM
engine between them (vLLM's external launcher forms its tp groups from consecutive ranks, and
each group steps on its own: other groups may run other batches, or none).

Every rank of a group must make the same engine calls with the same inputs, in the same order,
or the engine's collectives mismatch. So a group pools the requests of the dp replicas it spans
(one list per replica: the ranks of a replica ask the same), every rank runs the pooled batch,
and the group's first rank hands every rank its own replica's results; with tools, the first
rank runs them and shares their results before the next turn, so that no rank's sandbox timing
can send its engine a different prompt.

    group = GeneratorGroup(topology, cfg.rollout.tensor_parallel_size)
    completions = group.generate(stack, prompts, n, seeds)   # stack.RolloutStack's, pooled
    scores = group.map(generator.score, requests)             # any list -> list of results
    results = group.run_once(lambda: run_tools(calls))       # inside the multi-turn loop
"""
from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from megagrpo.cluster.topology import Topology
from megagrpo.config.schema import ConfigError


class GeneratorGroup:
    def __init__(self, topology: Topology, tensor_parallel_size: int):
        if topology.generator_tp != tensor_parallel_size:  # the engine's tp groups and ours must agree
            raise ConfigError(f"rollout.tensor_parallel_size={tensor_parallel_size}, but the process groups were "
                              f"made for {topology.generator_tp}: pass it to init_distributed(generator_tp=)")
        self.group = topology.generator_group  # None: an engine of its own (rollout.tensor_parallel_size 1)
        self.size = topology.generator_tp
        self.leader = topology.generator_ranks()[0]
        self.is_leader = topology.rank == self.leader
        self.replica = topology.dp_rank

    def map(self, fn: Callable[[list], list], items: list) -> list:
        """fn(items) -> one result per item, run by every rank of the group on the pooled items
        of the group's dp replicas as one call; returns the results of this rank's items (the
        first rank's, shared). fn is not called when the whole group has no items."""
        if self.group is None:
            return fn(items) if items else []
        parts = [None] * self.size
        dist.all_gather_object(parts, (self.replica, items), group=self.group)
        pooled, mine, seen = [], slice(0, 0), set()
        for replica, part in parts:
            if replica in seen:  # the other ranks of a replica ask the same
                continue
            seen.add(replica)
            if replica == self.replica:
                mine = slice(len(pooled), len(pooled) + len(part))
            pooled += part
        results = [fn(pooled) if pooled else []]
        dist.broadcast_object_list(results, src=self.leader, group=self.group)
        return results[0][mine]

    def generate(self, stack, prompts: list, n: int, seeds: list[int], greedy: bool = False) -> list[list]:
        """stack.generate (one generator call, or the multi-turn loop) through the group: n
        completions for each of this rank's prompts."""
        return self.map(lambda pairs: stack.generate([p for p, _ in pairs], n=n, seeds=[s for _, s in pairs],
                                                     greedy=greedy), list(zip(prompts, seeds)))

    def run_once(self, fn: Callable[[], object]) -> object:
        """fn() on the group's first rank; its result on every rank of the group."""
        if self.group is None:
            return fn()
        box = [fn() if self.is_leader else None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]
