"""The rollout stack: the one owner of a step's rollout, built the same way for training and
for `megagrpo eval`. It holds the tokenizer, the tools (multi-turn runs), the prompts, the
reward functions, and, once started, the generator group (the generator, with the agent loop
over it) and the batches sampled ahead.

    stack = build_rollout_stack(cfg, training=True)     # tokenizer, tools, prompts, rewards
    stack.start(topology, seed, prompt_order, total_steps)   # after the policy, where there is one
    sampled = stack.sample(step, clock)                 # the step's groups, sampled and scored
    stack.settle(clock)                                 # before the weights change
    groups = stack.generate(prompts, n, seeds)          # (evaluation) completions for given prompts
    texts, rewards = stack.score(prompts, completions, field_names)

The path from the loop to the generator is three calls: Trainer.train_step ->
RolloutStack.sample -> GeneratorGroup.generate -> the generator (or, with tools, the agent
loop, whose turns call it). `sample` takes a step's prompts whichever way they are sampled:
now, on the ranks that generate, or ahead, on a side thread while earlier steps trained
(rollout/ahead.py); single-turn or multi-turn; in DAPO's rounds (algorithm/dynamic_sampling.py).
The generator sleeps after every sampling, and the step's rollout metrics are made here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megagrpo.algorithm.dynamic_sampling import DynamicSampling
from megagrpo.cluster.distributed import all_reduce
from megagrpo.cluster.generator_layout import generator_layout
from megagrpo.cluster.topology import Topology
from megagrpo.config.schema import Config, ConfigError
from megagrpo.data import Prompt, PromptOrder, load_prompts, record_prompts
from megagrpo.multimodal.models import is_vision_language
from megagrpo.multimodal.processor import load_processor
from megagrpo.policy.models import load_tokenizer
from megagrpo.rewards import RewardFunction, Rewards, build_reward_functions, close_reward_functions, compute_rewards
from megagrpo.rollout.agent import AgentLoop, agent_metrics, answer_texts, completion_fields
from megagrpo.rollout.ahead import RolloutsAhead
from megagrpo.rollout.generator_group import GeneratorGroup
from megagrpo.rollout.generators import build_generator, sampling_seed
from megagrpo.rollout.outside_agents import OutsideAgents, uses_outside_agent
from megagrpo.rollout.tools import Toolset


@dataclass
class SampledGroups:
    """A step's groups as sampled and scored: per completion its prompt, the completion, the
    text the rewards read, and what the rewards gave them; and the rollout's metrics."""
    prompts: list
    completions: list
    texts: list
    rewards: Rewards
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


@dataclass
class RolloutStack:
    cfg: Config
    tokenizer: Any
    toolset: Optional[Toolset]
    prompts: list[Prompt]             # data.train_file (none for `megagrpo eval`)
    eval_prompts: list[Prompt]        # data.eval_file
    dropped: dict                     # prompts dropped (too long, or a bad image), per file
    reward_functions: list[RewardFunction]
    group: Optional[GeneratorGroup] = None     # after start: the generator, pooled over its ranks
    topology: Optional[Topology] = None
    prompt_order: Optional[PromptOrder] = None  # (training) which prompts each step takes
    ahead: Optional[RolloutsAhead] = None      # rollout.max_staleness > 0: batches sampled ahead

    @property
    def generator(self):
        """rollout/generators.py's VLLMGenerator or HFGenerator, or the servers' client."""
        return self.group.generator

    @property
    def agent(self) -> Optional[AgentLoop]:
        return self.group.agent

    def start(self, topology: Topology, seed: int, prompt_order: Optional[PromptOrder] = None,
              total_steps: int = 0) -> None:
        """The generator, and the multi-turn loop over it when there are tools. Built after the
        policy: on a GPU vLLM sizes its KV cache from the memory the policy leaves. prompt_order:
        the training prompts' order (rollout.max_staleness draws the steps ahead from it)."""
        ranks_per_group = generator_layout(self.cfg).ranks_per_group
        if topology.generator_tp != ranks_per_group:  # the engine's tp groups and ours must agree
            raise ConfigError(f"rollout.tensor_parallel_size gives generator groups of {ranks_per_group} ranks, but "
                              f"the process groups were made for {topology.generator_tp}: pass "
                              "generator_layout(cfg).ranks_per_group to init_distributed(generator_tp=)")
        self.topology, self.prompt_order = topology, prompt_order
        self.group = GeneratorGroup(topology, build_generator(self.cfg, seed=seed))
        if self.toolset:
            self.group.agent = AgentLoop(self.cfg, self.group, self.tokenizer, self.toolset)
        elif uses_outside_agent(self.cfg):  # agent programs of the user's, through the endpoint
            self.group.agent = OutsideAgents(self.cfg, self.group.generator, self.tokenizer)
        r = self.cfg.rollout
        if prompt_order is not None and r.max_staleness:
            self.ahead = RolloutsAhead(prompt_order.next_indices, self._sample_ahead, r.max_staleness, total_steps,
                                       r.partial_rollouts)

    # ---- a training step's rollout ----------------------------------------------------------------

    def sample(self, step: int, clock) -> SampledGroups:
        """This rank's groups of step `step` (0-based), sampled and scored, with the rollout's
        metrics; clock (monitoring.PhaseClock) takes the phases: rollout, reward, resampling."""
        g, topology = self.cfg.grpo, self.topology
        rounds = DynamicSampling(self.prompt_order.prompts_per_rank, g.max_sampling_rounds,
                                 lambda t, op: all_reduce(t, op, topology.dp_group), g.dynamic_sampling)
        while rounds.wants_more():
            r = rounds.count
            if self.ahead is not None:  # sampled on the side thread while earlier steps trained
                batch = self.ahead.take(step)
                indices, groups = batch.indices, self.group.share(batch.groups)
                self.generator.sleep()
            else:
                indices = self.prompt_order.next_indices()
                groups = self.group.generate([self.prompts[i] for i in indices], g.num_generations,
                                             [sampling_seed(g.seed, step, i, r) for i in indices])
            record_prompts(self.cfg.output_dir, step + 1, indices, r, topology)
            clock.lap("rollout" if r == 0 else "resampling")
            prompts = [self.prompts[i] for i in indices for _ in range(g.num_generations)]
            completions = [c for group in groups for c in group]
            texts, rewards = self.score(prompts, completions, self.prompts[indices[0]].fields)
            clock.lap("reward" if r == 0 else "resampling")
            rounds.add(SampledGroups(prompts, completions, texts, rewards, g.num_generations))
        sampled, metrics = rounds.result()
        sampled.metrics = {**metrics, **self.metrics(sampled.completions)}
        return sampled

    def metrics(self, completions: list) -> dict:
        """The rollout's metrics beside DAPO's rounds: the batch sampled ahead (staleness, the
        wait for it) and the multi-turn loop's of the completions kept (turns, tool calls)."""
        out = self.ahead.metrics() if self.ahead is not None else {}
        if self.agent is not None:
            out.update(agent_metrics(completions, self.agent.tool_wall_seconds, self.topology.dp_group))
        if isinstance(self.agent, OutsideAgents):
            out.update(self.agent.metrics(completions, self.topology.dp_group))
        return out

    def _sample_ahead(self, step: int, indices: list) -> Optional[list]:
        """A later step's groups for RolloutsAhead's side thread, with that step's seeds; None
        on a rank that does not sample (its model group's sampling rank shares them when the
        step comes). No collectives."""
        if not self.topology.generates:
            return None
        g = self.cfg.grpo
        return self.group.sample_here([self.prompts[i] for i in indices], g.num_generations,
                                      [sampling_seed(g.seed, step, i, 0) for i in indices])

    def settle(self, clock) -> None:
        """Before the weights change: every rank's batches sampled ahead are done (collective)."""
        if self.ahead is not None:
            self.ahead.settle()
            clock.lap("rollout_ahead")

    # ---- sampling and scoring any prompts (evaluation) -------------------------------------------

    def generate(self, prompts: list[Prompt], n: int, seeds: list[int], greedy: bool = False) -> list[list]:
        """n completions per prompt on this rank (GeneratorGroup.generate: pooled, then shared)."""
        return self.group.generate(prompts, n, seeds, greedy)

    def logprobs(self, requests: list[tuple[list[int], int]]) -> Optional[list[list[float]]]:
        """The generator's log-probs of each (token_ids, prompt_len)'s tail; None on a rank that
        does not generate (only a sampling rank's generator is sure to hold the trained weights)."""
        return self.group.logprobs(requests) if self.topology.generates else None

    def score(self, prompts: list[Prompt], completions: list, field_names) -> tuple[list[str], Rewards]:
        """The texts the rewards read (a trajectory's last turn) and what the reward functions
        give them; prompts: one per completion; field_names: the row fields passed to the
        functions (the same on every rank: a reward model's forward passes are collective, so
        a rank with no completions still scores its empty batch)."""
        texts = answer_texts(completions, self.tokenizer)
        fields = {key: [p.fields.get(key) for p in prompts] for key in field_names}
        fields.update(completion_fields(completions, self.cfg.rollout.max_new_tokens))
        return texts, compute_rewards(self.reward_functions, [p.prompt for p in prompts], texts, fields)

    def close(self) -> None:
        """Release the reward functions' and tools' workers (sandboxes), and the servers' transfer group."""
        close_reward_functions(self.reward_functions)
        if self.group is not None and hasattr(self.generator, "close"):
            self.generator.close()
        if self.toolset:
            self.toolset.close()
        if isinstance(self.agent, OutsideAgents):
            self.agent.close()


def build_rollout_stack(cfg: Config, training: bool = True) -> RolloutStack:
    """Everything but the generator (RolloutStack.start); training: load data.train_file too
    (`megagrpo eval` reads data.eval_file only)."""
    data = cfg.data
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    toolset = Toolset(cfg) if cfg.rollout.max_turns > 1 and not uses_outside_agent(cfg) else None
    tools = toolset.schemas if toolset else None
    processor = load_processor(cfg.model.name_or_path) if is_vision_language(cfg.model.name_or_path) else None

    def load(path: str, split: str) -> tuple[list[Prompt], int]:
        return load_prompts(path, tokenizer, data.max_prompt_length, data.prompt_field, data.system_prompt,
                            split, tools, processor, cfg.images)

    prompts, eval_prompts, dropped = [], [], {}
    if training:
        prompts, dropped["train"] = load(data.train_file, data.split)
    if data.eval_file:
        eval_prompts, dropped["eval"] = load(data.eval_file, data.eval_split)
    functions = build_reward_functions(cfg.rewards.functions, cfg)
    return RolloutStack(cfg, tokenizer, toolset, prompts, eval_prompts, dropped, functions)
