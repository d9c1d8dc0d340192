"""A step's sampled and scored groups, and DAPO's dynamic sampling of them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from megagrpo.cluster.distributed import all_reduce


@dataclass
class SampledGroups:
    """A step's groups as sampled and scored: per completion its prompt, the completion, the
    text the rewards read, and what the rewards gave them (rewards.Rewards: total,
    per-function, components, reasons; anything with len, select(rows) and concat(other))."""
    prompts: list
    completions: list
    texts: list
    rewards: "Rewards"  # noqa: F821 - megagrpo.rewards.Rewards, a package above this one
    group_size: int
    metrics: dict = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return len(self.completions) // self.group_size

    def select(self, groups: list[int]) -> "SampledGroups":
        rows = [g * self.group_size + j for g in groups for j in range(self.group_size)]
        return SampledGroups([self.prompts[i] for i in rows], [self.completions[i] for i in rows],
                             [self.texts[i] for i in rows], self.rewards.select(rows), self.group_size)

    def informative(self) -> "SampledGroups":
        """The groups whose rewards are not all equal (the others have no advantage)."""
        spread = self.rewards.total.view(-1, self.group_size).std(dim=1) > 1e-6
        return self.select(spread.nonzero().flatten().tolist())

    def first(self, count: int) -> "SampledGroups":
        return self.select(list(range(count)))

    def concat(self, other: "SampledGroups") -> "SampledGroups":
        return SampledGroups(self.prompts + other.prompts, self.completions + other.completions,
                             self.texts + other.texts, self.rewards.concat(other.rewards), self.group_size)


def sample_informative_groups(sample_round: Callable[[int], SampledGroups], share: int, max_rounds: int,
                              dp_group=None) -> SampledGroups:
    """DAPO's dynamic sampling: keep the groups whose rewards differ, and sample more rounds
    (`sample_round(r)`: the rank's next prompts, sampled and scored) while any dp rank has fewer
    than its `share`, up to `max_rounds`. Every rank samples each round, so the prompt order
    stays one for all ranks; every rank then trains on as many groups as the rank with the
    fewest has (a rank that has none takes one group of its first round, which has no
    advantage), so micro-batches and collectives line up."""
    first = sample_round(0)
    kept, sampled, rounds = first.informative(), first.num_groups, 1
    while rounds < max_rounds:
        short = all_reduce(torch.tensor([max(0, share - kept.num_groups)]), "max", dp_group)
        if int(short[0]) == 0:
            break
        more = sample_round(rounds)
        kept, sampled, rounds = kept.concat(more.informative()), sampled + more.num_groups, rounds + 1
    count = int(all_reduce(torch.tensor([min(kept.num_groups, share)]), "min", dp_group)[0])
    result = kept.first(count) if count else first.first(1)
    totals = all_reduce(torch.tensor([sampled, kept.num_groups, result.num_groups], dtype=torch.float64),
                        group=dp_group).tolist()
    result.metrics = {"sampling/rounds": rounds, "sampling/groups_sampled": totals[0],
                      "sampling/groups_informative": totals[1], "sampling/groups_kept": totals[2]}
    return result
