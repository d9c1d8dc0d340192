"""The rollout stack: what writes and scores completions, built the same way for training and
for `megagrpo eval`: the tokenizer, the tools (multi-turn runs), the prompts, the reward
functions, and the generator (vLLM or transformers) with the agent loop over it.

    stack = build_rollout_stack(cfg, training=True)   # tokenizer, tools, prompts, rewards
    stack.start_generator(seed)                       # after the policy, where there is one
    groups = stack.generate(prompts, n, seeds)        # this rank's completions
    texts, rewards = stack.score(prompts, completions, field_names)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megagrpo.config.schema import Config
from megagrpo.data import Prompt, load_prompts
from megagrpo.policy.models import load_tokenizer
from megagrpo.rewards import RewardFunction, Rewards, build_reward_functions, close_reward_functions, compute_rewards
from megagrpo.rollout.agent import AgentLoop, answer_texts, completion_fields
from megagrpo.rollout.generators import build_generator
from megagrpo.rollout.tools import Toolset


@dataclass
class RolloutStack:
    cfg: Config
    tokenizer: Any
    toolset: Optional[Toolset]
    prompts: list[Prompt]             # data.train_file (none for `megagrpo eval`)
    eval_prompts: list[Prompt]        # data.eval_file
    dropped: dict                     # prompts dropped as longer than data.max_prompt_length, per file
    reward_functions: list[RewardFunction]
    generator: Any = None             # rollout/generators.py: VLLMGenerator or HFGenerator
    agent: Optional[AgentLoop] = None

    def start_generator(self, seed: int, run_once=None) -> None:
        """The generator, and the multi-turn loop over it when there are tools. Built after the
        policy: on a GPU vLLM sizes its KV cache from the memory the policy leaves. run_once:
        how the ranks of a generator group run the tools once (GeneratorGroup.run_once)."""
        self.generator = build_generator(self.cfg, seed=seed)
        if self.toolset:
            self.agent = AgentLoop(self.cfg, self.generator, self.tokenizer, self.toolset, run_once)

    def generate(self, prompts: list[Prompt], n: int, seeds: list[int], greedy: bool = False) -> list[list]:
        """n completions per prompt on this rank: one generator call, or the multi-turn loop."""
        if self.agent is not None:
            return self.agent.generate(prompts, n=n, seeds=seeds, greedy=greedy)
        return self.generator.generate([p.token_ids for p in prompts], n=n, seeds=seeds, greedy=greedy)

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
        if hasattr(self.generator, "close"):
            self.generator.close()
        if self.toolset:
            self.toolset.close()


def build_rollout_stack(cfg: Config, training: bool = True) -> RolloutStack:
    """Everything but the generator (RolloutStack.start_generator); training: load
    data.train_file too (`megagrpo eval` reads data.eval_file only)."""
    data = cfg.data
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    toolset = Toolset(cfg) if cfg.rollout.max_turns > 1 else None
    tools = toolset.schemas if toolset else None

    def load(path: str, split: str) -> tuple[list[Prompt], int]:
        return load_prompts(path, tokenizer, data.max_prompt_length, data.prompt_field, data.system_prompt,
                            split, tools)

    prompts, eval_prompts, dropped = [], [], {}
    if training:
        prompts, dropped["train"] = load(data.train_file, data.split)
    if data.eval_file:
        eval_prompts, dropped["eval"] = load(data.eval_file, data.eval_split)
    functions = build_reward_functions(cfg.rewards.functions, cfg)
    return RolloutStack(cfg, tokenizer, toolset, prompts, eval_prompts, dropped, functions)
