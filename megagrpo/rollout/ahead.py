"""Rollouts sampled ahead (rollout.max_staleness k > 0, with rollout.servers): while the trainer
trains step t, a side thread samples the batches of steps t+1 .. t+k with the weights the
servers hold, so generation and training overlap. Before the weights change, every batch in
flight is finished (`settle`), so a batch is sampled with one version of the weights, and it is
trained on at most k steps after that version (its staleness; checked on every batch).

With rollout.partial_rollouts the batches in flight are not waited for: the servers pause
them through the update and they go on with the new weights, each token tagged with its
weights' version (rollout/servers.py); a batch's staleness is then its oldest token's.

Which prompts and seeds a step gets does not change: the prompt order (data.PromptOrder) gives
each step its prompts in order, and a prompt's seeds are those of its step
(generators.sampling_seed). The batches sampled ahead at a checkpoint are saved with it, so a
resumed run trains on the same tokens.

    ahead = RolloutsAhead(prompt_order.next_indices, sample, max_staleness=1, last_step=total_steps)
                                # sample(step, indices): the rollout stack's, on the side thread
    batch = ahead.take(step)    # this step's batch; starts sampling the steps up to step + k
    ...train...
    ahead.settle()              # nothing in flight on any rank: the weights may change now
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class AheadBatch:
    step: int          # the step it is for (0-based)
    indices: list      # its prompts (this rank's)
    groups: list       # per prompt, its completions (None on a rank that does not sample)
    version: int       # the weights it was sampled with: those after this many steps
    seconds: float     # how long sampling it took


class StalenessError(RuntimeError):
    pass


class RolloutsAhead:
    def __init__(self, draw: Callable[[], list], sample: Callable[[int, list], list], max_staleness: int,
                 last_step: int, partial: bool = False):
        """draw() -> the next step's prompt indices; sample(step, indices) -> its groups (run on
        the side thread: no collectives). partial (rollout.partial_rollouts): batches in flight
        go on across a weight update (settle does not wait for them), their tokens tagged with
        the weights that sampled each."""
        self.draw, self.sample, self.k, self.last_step = draw, sample, max_staleness, last_step
        self.partial = partial
        self.batches: dict[int, Future] = {}
        self.side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts-ahead")
        self.largest_staleness = 0
        self.last: dict = {}

    def take(self, step: int) -> AheadBatch:
        """Step `step`'s batch (waiting for it if it is still being sampled); the batches of the
        steps after it, up to step + k, are started with the current weights, those after
        `step` steps (the generators take them after every step, and at start or resume)."""
        for later in range(step, min(step + self.k, self.last_step - 1) + 1):
            if later not in self.batches:
                self.batches[later] = self.side.submit(self._sample, later, self.draw(), step)
        start = time.perf_counter()
        batch = self.batches.pop(step).result()
        waited = time.perf_counter() - start
        # per token where the servers tagged them (partial rollouts): the oldest is the batch's
        versions = [v for group in batch.groups or [] for c in group for v in (c.versions or [])]
        oldest = min(versions, default=batch.version)
        staleness = step - oldest
        if not 0 <= staleness <= self.k:  # the bound this whole module exists to keep
            raise StalenessError(f"step {step}: its batch was sampled with the weights of step {oldest}, "
                                 f"{staleness} steps old, beyond rollout.max_staleness={self.k}")
        self.largest_staleness = max(self.largest_staleness, staleness)
        self.last = {"rollout/staleness": staleness, "rollout/staleness_max": self.largest_staleness,
                     "rollout/wait_s": waited, "rollout/sampling_s": batch.seconds,
                     "rollout/batches_ahead": len(self.batches)}
        if self.partial:  # the share of its tokens sampled after a weight update it lived through
            self.last["rollout/partial_token_share"] = sum(v > oldest for v in versions) / max(1, len(versions))
        return batch

    def _sample(self, step: int, indices: list, version: int) -> AheadBatch:
        start = time.perf_counter()
        groups = self.sample(step, indices)
        return AheadBatch(step, indices, groups, version, time.perf_counter() - start)

    def settle(self) -> None:
        """Wait for every batch in flight, on every rank (collective): then the generators'
        weights may change, and no batch is sampled with two versions of them. Partial
        rollouts: nothing to wait for (the servers pause the batches in flight)."""
        if self.partial:
            return
        for batch in self.batches.values():
            batch.result()
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def metrics(self) -> dict:
        """The last batch taken: its staleness (and the run's largest), the trainer's wait for
        it, the seconds its sampling took, and the batches sampled ahead of it."""
        return dict(self.last)

    def state(self) -> list[AheadBatch]:
        """The batches sampled ahead (after settle), for a checkpoint."""
        return [self.batches[step].result() for step in sorted(self.batches)]

    def load_state(self, batches: list[AheadBatch]) -> None:
        """Resume: the batches a checkpoint saved."""
        self.batches = {}
        for batch in batches:
            done = Future()
            done.set_result(batch)
            self.batches[batch.step] = done
