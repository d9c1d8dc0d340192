"""Reward functions: built-ins, user functions by dotted path, weighted combination, checks.

A reward function is `fn(prompts, completions, **fields) -> list[float]`: one float per
completion, where `fields` holds every other row field as a list aligned with `completions`
(plus the `args` of its config entry). A function that raises, returns the wrong count, or
returns NaN/inf stops the run with an error naming the function and the sample.

A reward may also be a class: it is built once per process as `cls(config=<Config or None>,
**args)` (a sandbox pool, a reward model) and the instance is called like a function. A
function may return `Scores`: its floats plus per-completion components and reasons, which the
trainer logs as `rewards/<name>/<component>` and eval writes to its samples file.
"""
from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megagrpo.config.loading import resolve_dotted
from megagrpo.config.schema import ConfigError, require

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class RewardError(RuntimeError):
    """A reward function misbehaved; the message names the function and the sample."""


class Scores(list):
    """A reward function's floats, plus `components` ({name: one float per completion}, the
    same names on every call) and `reasons` (one string per completion, "" for none)."""

    def __init__(self, values, components: Optional[dict] = None, reasons: Optional[list] = None):
        super().__init__(values)
        self.components = dict(components or {})
        self.reasons = list(reasons) if reasons is not None else [""] * len(self)


def _parse_number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def answer_match(prompts, completions, answer=None, marker: str = "Answer:", **_) -> list[float]:
    """1.0 when the number after `marker` (else the last number) equals the row's `answer`
    field numerically, or the stripped strings are equal; else 0.0."""
    if answer is None:
        raise ValueError("answer_match needs an 'answer' field in every data row")
    scores = []
    for completion, reference in zip(completions, answer):
        tail = completion.rsplit(marker, 1)[1] if marker and marker in completion else completion
        numbers = _NUMBER.findall(tail)
        got = numbers[0] if marker and marker in completion and numbers else (numbers[-1] if numbers else tail)
        ref_num, got_num = _parse_number(str(reference)), _parse_number(got)
        if ref_num is not None and got_num is not None:
            scores.append(1.0 if math.isclose(ref_num, got_num, rel_tol=1e-9, abs_tol=1e-9) else 0.0)
        else:
            scores.append(1.0 if got.strip() == str(reference).strip() else 0.0)
    return scores


def format_match(prompts, completions, pattern: str = r"^.*Answer: .+$", **_) -> list[float]:
    """1.0 when the whole completion matches the regex `pattern` (DOTALL), else 0.0."""
    regex = re.compile(pattern, re.DOTALL)
    return [1.0 if regex.fullmatch(c.strip()) else 0.0 for c in completions]


def length_penalty(prompts, completions, target: int = 150, **_) -> list[float]:
    """1 - |len - target| / target in characters, floored at -1."""
    return [max(-1.0, 1.0 - abs(len(c) - target) / target) for c in completions]


def environment_reward(prompts, completions, environment_reward=None, **_) -> list[float]:
    """The get_reward() of each trajectory's environment instance (rollout.environment)."""
    if environment_reward is None or any(v is None for v in environment_reward):
        raise ValueError("the 'environment' reward needs rollout.environment with a get_reward() method")
    return [float(v) for v in environment_reward]


def agent_reward(prompts, completions, agent_reward=None, **_) -> list[float]:
    """An outside agent's result per episode (rollout.agent; rollout/outside_agents.py): 0 for
    an episode that failed or whose program returned no number."""
    if agent_reward is None:
        raise ValueError("the 'agent' reward needs rollout.agent or rollout.agent_command")
    return [0.0 if v is None else float(v) for v in agent_reward]


BUILTINS: dict[str, Callable] = {
    "agent": agent_reward,
    "answer_match": answer_match,
    "environment": environment_reward,
    "format": format_match,
    "length_penalty": length_penalty,
}

# The reward suite: built-ins that live in their own modules (imported when used).
SUITE: dict[str, str] = {
    "customer_service": "megagrpo.rewards.text:customer_service",
    "math_accuracy": "megagrpo.rewards.text:math_accuracy",
    "think_answer_format": "megagrpo.rewards.text:think_answer_format",
    "overlong_penalty": "megagrpo.rewards.text:overlong_penalty",
    "code": "megagrpo.rewards.code:CodeReward",
    "reward_model": "megagrpo.rewards.reward_model:RewardModel",
    "judge": "megagrpo.rewards.llm_judge:LLMJudge",
    "reasoning_gym": "megagrpo.rewards.reasoning_gym:reasoning_gym",
}


def resolve(name: str) -> Callable:
    """A built-in name or `package.module:function` (or a class, see the module docstring)."""
    if name in BUILTINS:
        return BUILTINS[name]
    if name in SUITE:
        return resolve(SUITE[name])
    if ":" not in name:
        raise RewardError(f"reward '{name}' is not a built-in ({', '.join([*BUILTINS, *SUITE])}) nor a "
                          "dotted path module:function")
    return resolve_dotted(name, f"reward '{name}'", RewardError)


def check_reward_names(functions: list) -> None:
    """Config check: every rewards.functions entry names a function that resolves."""
    for i, fn in enumerate(functions):
        require(bool(fn.name), f"rewards.functions[{i}].name is empty")
        try:
            resolve(fn.name)
        except RewardError as e:
            raise ConfigError(f"rewards.functions[{i}].name: {e}") from None


@dataclass
class RewardFunction:
    name: str
    fn: Callable
    weight: float
    args: dict
    pass_threshold: Optional[float] = None  # a completion passes (pass@k) at this reward or more


def build_reward_functions(configs, config=None) -> list[RewardFunction]:
    """One RewardFunction per config entry; a class is instantiated here with the trainer's
    `config` and the entry's args (which then are not passed again on each call)."""
    functions = []
    for c in configs:
        target = resolve(c.name)
        if inspect.isclass(target):
            try:
                functions.append(RewardFunction(c.name, target(config=config, **c.args), c.weight, {},
                                                c.pass_threshold))
            except Exception as e:
                raise RewardError(f"reward '{c.name}' could not be built: {type(e).__name__}: {e}") from e
        else:
            functions.append(RewardFunction(c.name, target, c.weight, dict(c.args), c.pass_threshold))
    return functions


def close_reward_functions(functions: list[RewardFunction]) -> None:
    """Release what class-based rewards hold (sandbox workers)."""
    for rf in functions:
        close = getattr(rf.fn, "close", None)
        if callable(close):
            close()


def _sample(prompts, completions, i) -> str:
    return f"sample {i} (prompt {str(prompts[i])[:80]!r}, completion {completions[i][:80]!r})"


@dataclass
class Rewards:
    """What the reward functions gave N completions: the weighted total (N,), the per-function
    matrix (N, F), and from functions that return Scores their `components`
    {"<fn>/<component>": (N,)} and `reasons` {"<fn>": [str] * N}."""
    total: torch.Tensor
    per_function: torch.Tensor
    components: dict = field(default_factory=dict)
    reasons: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.total)

    def select(self, rows: list[int]) -> "Rewards":
        return Rewards(self.total[rows], self.per_function[rows],
                       {k: v[rows] for k, v in self.components.items()},
                       {k: [v[i] for i in rows] for k, v in self.reasons.items()})

    def concat(self, other: "Rewards") -> "Rewards":
        components = {k: torch.cat([v, other.components[k]]) if k in other.components else v
                      for k, v in self.components.items()}
        reasons = {k: v + other.reasons.get(k, []) for k, v in self.reasons.items()}
        return Rewards(torch.cat([self.total, other.total]), torch.cat([self.per_function, other.per_function]),
                       {**other.components, **components}, {**other.reasons, **reasons})


def compute_rewards(functions: list[RewardFunction], prompts: list, completions: list[str],
                    fields: dict[str, list]) -> Rewards:
    """Every function on every completion; all values float32 and finite (else RewardError)."""
    n = len(completions)
    columns, components, reasons = [], {}, {}
    for rf in functions:
        try:
            raw = rf.fn(prompts, completions, **fields, **rf.args)
        except Exception as e:
            raise RewardError(f"reward function '{rf.name}' raised {type(e).__name__}: {e} "
                              f"(batch of {n}; first {_sample(prompts, completions, 0)})") from e
        values = list(raw) if raw is not None else []
        if len(values) != n:
            raise RewardError(f"reward function '{rf.name}' returned {len(values)} values for "
                              f"{n} completions; it must return one float per completion")
        for i, v in enumerate(values):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise RewardError(f"reward function '{rf.name}' returned {v!r} for "
                                  f"{_sample(prompts, completions, i)}; rewards must be finite floats")
        columns.append(torch.tensor(values, dtype=torch.float32))
        if isinstance(raw, Scores):
            for key, column in raw.components.items():
                components[f"{rf.name}/{key}"] = torch.tensor([float(v) for v in column], dtype=torch.float32)
            reasons[rf.name] = raw.reasons
    per_function = torch.stack(columns, dim=1) if columns else torch.zeros(n, 0)
    weights = torch.tensor([rf.weight for rf in functions], dtype=torch.float32)
    return Rewards(per_function @ weights, per_function, components, reasons)


def component_metrics(rewards: Rewards, group=None) -> dict:
    """`rewards/<fn>/<component>` means over the ranks of `group` (every rank runs the same
    functions, so every rank has the same component names)."""
    from megagrpo.cluster.distributed import all_reduce

    components = rewards.components
    if not components:
        return {}
    keys = sorted(components)
    sums = torch.tensor([[float(components[k].sum()), float(components[k].numel())] for k in keys],
                        dtype=torch.float64)
    sums = all_reduce(sums, group=group)
    return {f"rewards/{k}": float(s / max(c, 1.0)) for k, (s, c) in zip(keys, sums.tolist())}
