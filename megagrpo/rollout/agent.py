"""Multi-turn rollouts: the model samples a turn, calls tools, reads their results, continues.

A trajectory is one token sequence after its prompt: per turn the tokens the generator sampled
(with its log-probs), then the tokens of the tool-result messages as the chat template renders
them. Sampled tokens are taken as the generator returned them and never re-encoded: a turn is
decoded only to parse its tool calls and to show it to the rewards; only the inserted tool
messages are tokenised. `model_mask` marks the sampled tokens, and the loss, KL, entropy and
importance sampling cover those only (policy/batch.py).

Each turn, all live trajectories of the step go to the generator together (prefix caching on); a
trajectory ends at a turn without a tool call ("answer"), at rollout.max_turns ("max_turns"),
or ("budget") when a turn is cut at max_new_tokens or the next tool message and one more token
would not fit in max_model_len. Tools of one turn run concurrently (tools.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from megagrpo.config.schema import max_sequence_length
from megagrpo.policy.batch import Completion
from megagrpo.rollout.tools import ERROR_KINDS, ToolRunner, Toolset, environment_failure, resolve_parser

ENDINGS = ("answer", "max_turns", "budget", "environment_error")
_PLACEHOLDER = "MEGAGRPOPLACEHOLDER{}X"  # stands for a text the template must not see


@dataclass
class Trajectory(Completion):
    """A multi-turn completion: the Completion the trainer scores, plus the conversation."""
    messages: list = field(default_factory=list)  # prompt messages, assistant turns (with tool_calls), tool results
    final_text: str = ""                          # the last assistant turn, what the rewards score
    turns: int = 0
    tool_calls: int = 0
    tool_errors: dict = field(default_factory=dict)  # error kind -> count
    tool_seconds: float = 0.0
    ended_by: str = ""                             # one of ENDINGS once it has ended
    environment_reward: Optional[float] = None
    # an outside agent's episode (rollout/outside_agents.py):
    prompt_ids: Optional[list] = None              # its own first request, rendered (None: the data row's prompt)
    agent_reward: Optional[float] = None           # the agent program's result
    failure: str = ""                              # why the episode failed (it then scores 0)
    prefix_mismatches: int = 0                     # requests that re-rendered earlier turns otherwise
    model_seconds: float = 0.0                     # its requests' time in the generator
    agent_seconds: float = 0.0                     # the rest of its wall time: in the agent program
    generator_batch: int = 0                       # the most requests one generator call of its batch took


class ToolMessageRenderer:
    """The tokens of tool-result messages as the chat template puts them after an assistant
    turn: the template renders [user, assistant(placeholder), tool...] with the generation
    prompt, and everything after the placeholder is kept, less the end-of-turn text the model
    already sampled (its EOS). Tool outputs are tokenised with special tokens split, so that a
    tool printing "<|im_end|>" inserts text, not a turn boundary."""

    def __init__(self, tokenizer, max_content_tokens: int):
        self.tokenizer, self.max_tokens = tokenizer, max_content_tokens
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""
        self.cut_marker = tokenizer("\n[output cut]", add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def content_ids(self, text: str) -> tuple[list[int], str]:
        """A tool output's tokens, cut at max_content_tokens with a marker; and their text."""
        ids = self.tokenizer(text[:8 * self.max_tokens], add_special_tokens=False,
                             split_special_tokens=True)["input_ids"]
        if len(ids) > self.max_tokens or len(text) > 8 * self.max_tokens:
            ids = ids[:self.max_tokens] + self.cut_marker
        return ids, self.tokenizer.decode(ids)

    def render(self, messages: list[dict], model_ended_with_eos: bool) -> tuple[list[int], list[dict]]:
        """Token ids to insert after a model turn for these tool messages, and the messages with
        their contents as inserted (cut)."""
        contents = [self.content_ids(m["content"]) for m in messages]
        stand_ins = [{**m, "content": _PLACEHOLDER.format(i + 1)} for i, m in enumerate(messages)]
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PLACEHOLDER.format(0)}]
        text = self.tokenizer.apply_chat_template(probe + stand_ins, tokenize=False, add_generation_prompt=True)
        text = text[text.index(_PLACEHOLDER.format(0)) + len(_PLACEHOLDER.format(0)):]
        if model_ended_with_eos and self.eos_text and text.startswith(self.eos_text):
            text = text[len(self.eos_text):]
        ids = []
        for i, (content_ids, _) in enumerate(contents):
            before, text = text.split(_PLACEHOLDER.format(i + 1), 1)
            ids += self.tokenizer(before, add_special_tokens=False)["input_ids"] + content_ids
        ids += self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids, [{**m, "content": shown} for m, (_, shown) in zip(messages, contents)]


def turn_seed(trajectory_seed: int, turn: int) -> int:
    """The sampling seed of one later turn of one trajectory (turn 1 uses the group's seed)."""
    return (trajectory_seed * 1_000_003 + turn) % 2**31


class AgentLoop:
    """Samples a step's trajectories through the generator, with tools between turns."""

    def __init__(self, cfg, generator_group, tokenizer, toolset: Toolset):
        """generator_group (rollout/generator_group.py): its generator samples the turns, and
        the tools of a turn run once in it (group.run_once), their results shared, so that the
        group's ranks send their engine the same prompts."""
        r = cfg.rollout
        self.group, self.generator = generator_group, generator_group.generator
        self.tokenizer, self.toolset = tokenizer, toolset
        self.max_turns, self.max_new_tokens = r.max_turns, r.max_new_tokens
        self.max_len = max_sequence_length(cfg)
        self.parse = resolve_parser(r.tool_call_parser)
        self.runner = ToolRunner(toolset, r.max_tool_calls_per_turn)
        self.renderer = ToolMessageRenderer(tokenizer, r.max_tool_response_tokens)
        self.tool_wall_seconds = 0.0  # of the last generate: time spent waiting for tools
        self.reported: set[str] = set()  # environment failures already printed

    def generate(self, prompts: list, n: int, seeds: list[int], greedy: bool = False) -> list[list[Trajectory]]:
        """n trajectories per prompt (data.Prompt); trajectory j of prompt i samples its first
        turn from seeds[i] as a single-turn group does, later turns from turn_seed."""
        self.tool_wall_seconds = 0.0
        first = self.generator.generate([p.token_ids for p in prompts], n=n, seeds=seeds, greedy=greedy,
                                     max_tokens=[self._room(len(p.token_ids)) for p in prompts])
        groups, live = [], []
        for prompt, group, seed in zip(prompts, first, seeds):
            runs = [_Running(Trajectory(token_ids=[], logprobs=[], truncated=False, model_mask=[],
                                        messages=list(prompt.messages)),
                             prompt, (seed * 1_000_033 + j) % 2**31, *self.toolset.new_environment(prompt.fields))
                    for j in range(len(group))]
            for run, completion in zip(runs, group):
                self._add_turn(run, completion)
            live += runs
            groups.append([run.trajectory for run in runs])
        while live := [r for r in live if not r.trajectory.ended_by]:
            start = time.perf_counter()
            self._run_tools(live)
            self.tool_wall_seconds += time.perf_counter() - start
            live = [r for r in live if not r.trajectory.ended_by]
            if not live:
                break
            outputs = self.generator.generate(
                [r.ids for r in live], n=1, seeds=[turn_seed(r.seed, r.trajectory.turns) for r in live],
                greedy=greedy, max_tokens=[self._room(len(r.ids)) for r in live])
            for run, out in zip(live, outputs):
                self._add_turn(run, out[0])
        return groups

    def _room(self, length: int) -> int:
        return max(1, min(self.max_new_tokens, self.max_len - length))

    def _add_turn(self, run: "_Running", c: Completion) -> None:
        """Append a sampled turn and parse its tool calls; end the trajectory if it ends here."""
        t = run.trajectory
        t.token_ids += c.token_ids
        t.logprobs += c.logprobs
        t.model_mask += [1] * len(c.token_ids)
        if c.versions is not None:  # (partial rollouts) the weights that sampled each token
            t.versions = (t.versions or []) + c.versions
        if c.routes is not None:  # (routing replay r3) this turn's request fed the whole trajectory so far
            t.routes = c.routes
        t.turns += 1
        text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        run.calls = [] if c.truncated else self.parse(self.tokenizer.decode(c.token_ids, skip_special_tokens=False))
        message = {"role": "assistant", "content": text}
        if run.calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                                     for call in run.calls if call.error is None]
        t.messages.append(message)
        t.final_text = text
        run.ended_with_eos = bool(c.token_ids) and c.token_ids[-1] == self.tokenizer.eos_token_id
        if run.failure:  # its environment did not start: the episode ends here, scored 0
            t.ended_by, t.failure = "environment_error", run.failure
        elif c.truncated:
            t.ended_by, t.truncated = "budget", True
        elif not run.calls:
            t.ended_by = "answer"
        elif t.turns >= self.max_turns:
            t.ended_by = "max_turns"
        if t.ended_by:
            self._finish(run)

    def _run_tools(self, live: list["_Running"]) -> None:
        """Run the last turn's calls of every live trajectory, and insert their results."""
        results = self.group.run_once(lambda: self.runner.run([(run.calls, run.environment) for run in live]))
        for run, turn_results in zip(live, results):
            t = run.trajectory
            t.tool_calls += len(turn_results)
            for res in turn_results:
                t.tool_seconds += res.seconds
                if res.error_kind:
                    t.tool_errors[res.error_kind] = t.tool_errors.get(res.error_kind, 0) + 1
            messages = [{"role": "tool", "name": res.name, "content": res.content} for res in turn_results]
            ids, shown = self.renderer.render(messages, run.ended_with_eos)
            if len(run.ids) + len(ids) + 1 > self.max_len:
                t.ended_by, t.truncated = "budget", True
                self._finish(run)
                continue
            t.token_ids += ids
            t.logprobs += [0.0] * len(ids)
            t.model_mask += [0] * len(ids)
            if t.versions:  # a tool result's tokens: those of the turn it answers (not trained on)
                t.versions += [t.versions[-1]] * len(ids)
            t.messages += shown

    def _finish(self, run: "_Running") -> None:
        """At the trajectory's end: its environment's reward, then the environment is closed. An
        environment whose reset or get_reward raises scores its episode 0, with the reason; one
        whose close raises keeps its reward. Either is printed once per reason; the run goes on."""
        t = run.trajectory
        if run.failure:
            t.environment_reward = 0.0
        environment = run.environment
        get_reward = getattr(environment, "get_reward", None)
        if callable(get_reward):
            try:
                t.environment_reward = float(get_reward())
            except Exception as e:  # noqa: BLE001 - the environment's own failure
                t.failure, t.environment_reward = environment_failure("get_reward", e), 0.0
        self._report(t.failure)
        close = getattr(environment, "close", None)
        if callable(close):
            try:
                close()
            except Exception as e:  # noqa: BLE001 - the environment's own failure
                self._report(environment_failure("close", e) + " (its reward stands)")

    def _report(self, failure: str) -> None:
        if failure and failure not in self.reported:
            self.reported.add(failure)
            print(f"[megagrpo] an environment episode failed (each reason is printed once): {failure}", flush=True)


@dataclass
class _Running:
    """A trajectory while the loop runs it, with what only the loop needs (the Trajectory
    itself is shared with the model group, so it keeps no environment)."""
    trajectory: Trajectory
    prompt: object                # its data.Prompt
    seed: int                     # its later turns' seeds derive from it
    environment: object = None    # its own environment instance, or None
    failure: str = ""             # why its environment failed to start ("" when it started)
    calls: list = field(default_factory=list)  # the tool calls of its last turn
    ended_with_eos: bool = False  # its last turn ended with the EOS it sampled

    @property
    def ids(self) -> list[int]:
        return self.prompt.token_ids + self.trajectory.token_ids


def answer_texts(completions: list, tokenizer) -> list[str]:
    """What the rewards score: a trajectory's last assistant turn, a completion's decoded text."""
    if not completions:
        return []  # batch_decode([]) gives [""]
    if isinstance(completions[0], Trajectory):
        return [t.final_text for t in completions]
    return tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)


def completion_fields(completions: list, max_new_tokens: int) -> dict:
    """The reward fields that come from the completions: completion_length (sampled tokens)
    and max_new_tokens; for trajectories also messages (the whole conversation: prompt,
    assistant turns with their tool_calls, tool results), environment_reward and agent_reward
    (an outside agent's result)."""
    fields = {"completion_length": [len(c.token_ids) if c.model_mask is None else sum(c.model_mask)
                                    for c in completions],
              "max_new_tokens": [max_new_tokens] * len(completions)}
    if completions and isinstance(completions[0], Trajectory):
        fields["messages"] = [t.messages for t in completions]
        fields["environment_reward"] = [t.environment_reward for t in completions]
        fields["agent_reward"] = [t.agent_reward for t in completions]
    return fields


def agent_metrics(trajectories: list[Trajectory], tool_wall_seconds: float = 0.0, group=None) -> dict:
    """Turns, tool calls, tool errors by kind, endings and model vs tool tokens of the step over
    the ranks of `group`; time/tools is the longest wait for tools of any rank that sampled."""
    from megagrpo.cluster.distributed import all_reduce

    def column(values):
        return torch.tensor(values, dtype=torch.float64)

    model_tokens = [sum(t.model_mask) for t in trajectories]
    sums = torch.stack([
        column([len(trajectories)]), column([sum(t.turns for t in trajectories)]),
        column([sum(t.tool_calls for t in trajectories)]), column([sum(t.tool_seconds for t in trajectories)]),
        column([sum(model_tokens)]), column([sum(len(t.token_ids) for t in trajectories) - sum(model_tokens)]),
        *[column([sum(t.ended_by == e for t in trajectories)]) for e in ENDINGS],
        *[column([sum(t.tool_errors.get(k, 0) for t in trajectories)]) for k in ERROR_KINDS]]).squeeze(1)
    sums = all_reduce(sums, group=group)
    maxima = all_reduce(column([max((t.turns for t in trajectories), default=0), tool_wall_seconds]), "max",
                        group=group)
    count, turns, calls, seconds, model, tool = sums[:6].tolist()
    endings = sums[6:6 + len(ENDINGS)].tolist()
    errors = sums[6 + len(ENDINGS):].tolist()
    count = max(count, 1.0)
    out = {"turns/mean": turns / count, "turns/max": float(maxima[0]),
           "tools/calls_per_trajectory": calls / count, "tools/call_frequency": calls / max(turns, 1.0),
           "tools/failure_frequency": sum(errors) / max(calls, 1.0),
           "tools/seconds_per_call": seconds / max(calls, 1.0), "time/tools": float(maxima[1]),
           "tokens/model": model, "tokens/tool": tool}
    out.update({f"turns/ended_by_{e}": v / count for e, v in zip(ENDINGS, endings)})
    out.update({f"tools/errors/{k}": v for k, v in zip(ERROR_KINDS, errors)})
    return out
