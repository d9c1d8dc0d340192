"""DAPO's dynamic sampling: keep the groups whose rewards differ (the others have no advantage),
and sample more rounds while any dp rank has fewer than its share. The rollout drives the
rounds; this decides when to stop and what to keep:

    rounds = DynamicSampling(share, max_rounds, reduce, enabled=grpo.dynamic_sampling)
    while rounds.wants_more():
        rounds.add(<the rank's next prompts, sampled and scored>)   # round rounds.count
    groups, metrics = rounds.result()

Every rank samples each round, so the prompt order stays one for all ranks; every rank then
trains on as many groups as the rank with the fewest has (a rank that has none takes one group
of its first round, which has no advantage), so micro-batches and collectives line up. Without
dynamic sampling there is one round, taken whole, and no collective. `reduce(tensor, op)` is
the reduction over the dp ranks (op: "sum", "max" or "min"; the identity on one rank).

A round's groups are anything with num_groups, informative(), first(count) and concat(other)
(stack.SampledGroups).
"""
from __future__ import annotations

from typing import Callable

import torch

Reduce = Callable[[torch.Tensor, str], torch.Tensor]


class DynamicSampling:
    def __init__(self, share: int, max_rounds: int, reduce: Reduce = lambda t, op: t, enabled: bool = True):
        self.share, self.max_rounds, self.reduce, self.enabled = share, max_rounds, reduce, enabled
        self.count = 0          # rounds sampled so far
        self.sampled = 0        # groups sampled, all rounds
        self.first = self.kept = None

    def wants_more(self) -> bool:
        """Whether to sample another round: always the first; then, with dynamic sampling, while
        a dp rank is short of its share and rounds are left (collective after the first)."""
        if self.count == 0:
            return True
        if not self.enabled or self.count >= self.max_rounds:
            return False
        short = self.reduce(torch.tensor([max(0, self.share - self.kept.num_groups)]), "max")
        return int(short[0]) > 0

    def add(self, groups) -> None:
        """A round's groups, sampled and scored."""
        informative = groups.informative() if self.enabled else groups
        if self.first is None:
            self.first = groups
        self.kept = informative if self.kept is None else self.kept.concat(informative)
        self.sampled += groups.num_groups
        self.count += 1

    def result(self) -> tuple[object, dict]:
        """The groups to train on and the rounds' metrics (none without dynamic sampling)."""
        if not self.enabled:
            return self.first, {}
        count = int(self.reduce(torch.tensor([min(self.kept.num_groups, self.share)]), "min")[0])
        result = self.kept.first(count) if count else self.first.first(1)
        totals = self.reduce(torch.tensor([self.sampled, self.kept.num_groups, result.num_groups],
                                          dtype=torch.float64), "sum").tolist()
        return result, {"sampling/rounds": self.count, "sampling/groups_sampled": totals[0],
                        "sampling/groups_informative": totals[1], "sampling/groups_kept": totals[2]}
