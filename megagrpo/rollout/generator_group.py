"""A generator group: the rollout.tensor_parallel_size consecutive ranks that hold one vLLM
engine between them (vLLM's external launcher forms its tp groups from consecutive ranks, and
each group steps on its own: other groups may run other batches, or none).

Every rank of a group must make the same engine calls with the same inputs, in the same order,
or the engine's collectives mismatch. So a group pools the requests of the dp replicas it spans
(one list per replica: the ranks of a replica ask the same), every rank runs the pooled batch,
and the group's first rank hands every rank its own replica's results; with tools, the first
rank runs them and shares their results before the next turn, so that no rank's sandbox timing
can send its engine a different prompt.

    group = GeneratorGroup(topology, generator)        # generator: rollout/generators.py's
    group.agent = AgentLoop(cfg, group, tokenizer, toolset)   # with tools: the multi-turn loop
    groups = group.generate(prompts, n, seeds)          # pooled; asleep after; shared in the model group
    logprobs = group.logprobs(requests)                 # the generator's log-probs, pooled
    results = group.run_once(lambda: run_tools(calls))  # inside the multi-turn loop
"""
from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from megagrpo.cluster.topology import Topology


class GeneratorGroup:
    def __init__(self, topology: Topology, generator):
        self.topology, self.generator = topology, generator
        self.agent = None  # the multi-turn loop (rollout/agent.py), where there are tools
        self.group = topology.generator_group  # None: an engine of its own (rollout.tensor_parallel_size 1)
        self.size = topology.generator_tp
        self.leader = topology.generator_ranks()[0]
        self.is_leader = topology.rank == self.leader
        self.replica = topology.dp_rank

    @classmethod
    def of_one(cls, generator) -> "GeneratorGroup":
        """A generator on one process, with no process group (benchmarks, the agent loop's tests)."""
        return cls(Topology(rank=0, world_size=1, local_rank=0), generator)

    def generate(self, prompts: list, n: int, seeds: list[int], greedy: bool = False) -> list[list]:
        """n completions for each of this rank's prompts (data.Prompt): sampled by the ranks that
        generate (one generator call, or the multi-turn loop), pooled over the group's replicas;
        then the generator sleeps (on every rank: one that did not sample frees its memory too),
        and the model group's ranks that did not sample get the sampling rank's completions, so
        that every rank trains on the same tokens."""
        groups = None
        if self.topology.generates:
            groups = self._map(lambda pairs: self.sample_here([p for p, _ in pairs], n, [s for _, s in pairs], greedy),
                               list(zip(prompts, seeds)))
        self.generator.sleep()
        return self.share(groups)

    def sample_here(self, prompts: list, n: int, seeds: list[int], greedy: bool = False) -> list[list]:
        """n completions per prompt from this rank's generator alone (no collective: the side
        thread of rollout/ahead.py runs it): one generator call, or the multi-turn loop."""
        if self.agent is not None:
            return self.agent.generate(prompts, n=n, seeds=seeds, greedy=greedy)
        vision = [p.vision for p in prompts] if any(p.vision is not None for p in prompts) else None
        return self.generator.generate([p.token_ids for p in prompts], n=n, seeds=seeds, greedy=greedy,
                                       **({"vision": vision} if vision else {}))

    def logprobs(self, requests: list[tuple[list[int], int]]) -> list[list[float]]:
        """The generator's log-probs of each (token_ids, prompt_len)'s tail, pooled over the group."""
        return self._map(self.generator.logprobs, requests)

    def share(self, groups):
        """The completions of the model group's sampling rank, on every rank of the model group."""
        if self.topology.shares_rollout:
            box = [groups]
            dist.broadcast_object_list(box, src=self.topology.model_group_source, group=self.topology.model_group)
            groups = box[0]
        return groups

    def _map(self, fn: Callable[[list], list], items: list) -> list:
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

    def run_once(self, fn: Callable[[], object]) -> object:
        """fn() on the group's first rank; its result on every rank of the group."""
        if self.group is None:
            return fn()
        box = [fn() if self.is_leader else None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]
