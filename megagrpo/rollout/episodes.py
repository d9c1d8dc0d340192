"""One outside agent's episode as tokens: what the endpoint (rollout/endpoint.py) feeds the
generator for each of the agent's requests, and the trajectory the trainer gets.

An agent speaks text: every chat request sends the whole conversation again. The episode
keeps the conversation as the tokens that were really fed and sampled, and never re-tokenises
what it has:
  - the first request's messages (with its tools) are rendered by the chat template: the
    episode's prompt;
  - each sampled turn is appended as the generator returned it (its log-probs kept, mask 1);
  - a later request's new messages (tool results, user turns: everything after the last
    assistant message) are rendered as the template puts them after an assistant turn
    (agent.ToolMessageRenderer) and appended, masked: the model did not sample them.

A prefix mismatch is a request whose earlier messages differ from what the episode recorded
(an assistant turn re-rendered, reworded or dropped, a system prompt changed). It is counted,
and the sampled tokens stay authoritative: the request's new messages are appended to the
episode's own tokens, so the trainer scores exactly what the model saw and sampled. (Splitting
the episode into segments, as some peers do, would follow the agent's rewrite instead, at the
price of rows that share one reward; docs/agents.md says why not.)
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Optional

from megagrpo.policy.batch import Completion
from megagrpo.rollout.agent import ToolMessageRenderer, Trajectory


class RequestError(ValueError):
    """A request the endpoint refuses: OpenAI's error body, with its HTTP status and code."""

    def __init__(self, message: str, status: int = 400, code: Optional[str] = None, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def message_text(content, where: str) -> str:
    """A message's content as text: a string, or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError(f"{where}: content must be a string or a list of text parts (images and audio are not "
                       "served here)", param="messages")


def _arguments(value):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def said(message: dict) -> tuple:
    """What a message says, as a comparison of two renderings sees it: its role, its text and
    its tool calls (name and arguments, whatever their JSON spacing or ids)."""
    calls = tuple((c.get("function", {}).get("name"), json.dumps(_arguments(c.get("function", {}).get("arguments")),
                                                                    sort_keys=True))
                  for c in message.get("tool_calls") or [])
    return message.get("role"), message_text(message.get("content"), "a message").strip(), calls


@dataclass
class Episode:
    """One run of the agent program on one task (a data row), tied to its requests by `key`."""
    key: str
    seed: int                      # its model calls' seeds derive from it
    task: dict                     # what the agent program is given: {"messages": [...], "fields": {...}}
    prompt_ids: Optional[list[int]] = None   # the first request, rendered
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    model_mask: list = field(default_factory=list)
    messages: list = field(default_factory=list)   # the conversation as recorded: requests' and replies'
    calls: int = 0                 # model calls answered
    tool_calls: int = 0            # tool calls the replies carried
    mismatches: int = 0            # requests whose earlier messages differed from the record
    truncated: bool = False        # the last reply was cut at its token budget
    ended_with_eos: bool = False
    final_text: str = ""
    model_seconds: float = 0.0     # time its requests spent waiting for the generator
    ended: str = ""                # set when the episode is over: its ending or failure
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def ids(self) -> list[int]:
        return (self.prompt_ids or []) + self.token_ids

    def chat_input(self, messages: list, tools: Optional[list], tokenizer, renderer: ToolMessageRenderer) -> list[int]:
        """The tokens to sample the next turn from, for a chat request's messages: the whole
        conversation on the first request; afterwards the episode's own tokens, with the new
        messages appended (masked) and a re-rendered earlier turn counted as a mismatch."""
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("'messages' must be a non-empty list of message objects", param="messages")
        messages = [{**m, "content": message_text(m.get("content"), f"messages[{i}]")} for i, m in enumerate(messages)]
        if self.prompt_ids is None:
            self.prompt_ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                            tokenize=True, return_dict=False)
            self.messages = list(messages)
            return self.ids
        recorded, now, before = len(self.messages), [said(m) for m in messages], [said(m) for m in self.messages]
        if now[:recorded] == before and len(messages) > recorded:
            new = messages[recorded:]
        else:
            self.mismatches += 1
            if now == before[:len(now)]:
                new = []  # a request the episode has answered, sent again: nothing new to insert
            else:
                last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
                new = messages[last + 1:]
        if any(m.get("role") == "assistant" for m in new):
            self.mismatches += 1  # assistant turns the model never sampled: context, inserted as text
        if new:
            inserted, shown = renderer.render(new, self.ended_with_eos)
            self.token_ids += inserted
            self.logprobs += [0.0] * len(inserted)
            self.model_mask += [0] * len(inserted)
            self.messages += shown
        return self.ids

    def text_input(self, prompt, tokenizer) -> list[int]:
        """The tokens for a /v1/completions prompt (text, or token ids): the first request's
        prompt as given; afterwards a prompt that extends the episode's text (or ids) appends
        only its extension; one that does not is a mismatch, and its part after the longest
        common prefix is appended to the episode's own tokens."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            if self.prompt_ids is None:
                self.prompt_ids = ids
                return self.ids
            have = self.ids
            common = next((i for i, (a, b) in enumerate(zip(have, ids)) if a != b), min(len(have), len(ids)))
            extension = ids[common:]
        elif isinstance(prompt, str):
            if self.prompt_ids is None:
                self.prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
                return self.ids
            have = tokenizer.decode(self.ids)
            common = next((i for i, (a, b) in enumerate(zip(have, prompt)) if a != b), min(len(have), len(prompt)))
            extension = tokenizer(prompt[common:], add_special_tokens=False)["input_ids"] if prompt[common:] else []
        else:
            raise RequestError("'prompt' must be a string or a list of token ids (one prompt per request)",
                               param="prompt")
        if common < len(have):
            self.mismatches += 1
        self.token_ids += extension
        self.logprobs += [0.0] * len(extension)
        self.model_mask += [0] * len(extension)
        return self.ids

    def add_turn(self, completion: Completion, text: str, reply: Optional[dict], eos_id: Optional[int]) -> None:
        """Append a sampled turn (mask 1) and, for a chat reply, the assistant message as returned."""
        self.ended_with_eos = bool(completion.token_ids) and completion.token_ids[-1] == eos_id
        self.token_ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.model_mask += [1] * len(completion.token_ids)
        self.calls += 1
        self.truncated = completion.truncated
        self.final_text = text
        if reply is not None:
            self.messages.append(reply)
            self.tool_calls += len(reply.get("tool_calls") or [])

    def trajectory(self, agent_reward: Optional[float], failure: str = "") -> Trajectory:
        """What the trainer gets: the episode's tokens after its prompt, with their mask and
        log-probs; a failed episode keeps its tokens, scores 0 and says why."""
        return Trajectory(token_ids=list(self.token_ids), logprobs=list(self.logprobs), truncated=self.truncated,
                          model_mask=list(self.model_mask), messages=list(self.messages),
                          final_text="" if failure else self.final_text, turns=self.calls,
                          tool_calls=self.tool_calls, ended_by="budget" if self.ended == "budget" else "answer",
                          prompt_ids=None if self.prompt_ids is None else list(self.prompt_ids),
                          agent_reward=0.0 if failure else agent_reward, failure=failure,
                          prefix_mismatches=self.mismatches, model_seconds=self.model_seconds)
