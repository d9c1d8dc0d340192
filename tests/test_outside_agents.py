"""Agents megagrpo did not write (rollout/outside_agents.py, rollout/endpoint.py,
rollout/episodes.py): programs written against the `openai` SDK (tests/helpers/openai_tool_agent.py)
generate through megagrpo's OpenAI-compatible endpoint, with real vLLM and the real trainer.

- The trajectories are exactly the tokens vLLM sampled, turn by turn, with the agent's tool
  results inserted as the chat template renders them; the trainer's log-probs of the sampled
  tokens equal vLLM's. The agent streams every other call, and re-renders its earlier turns
  (a prefix mismatch the endpoint counts, keeping the sampled tokens).
- A command agent that crashes, hangs, never calls the model, or sends malformed and wrong-model
  requests: each episode ends as it must, the errors are OpenAI's, and training goes on.
- In process (transformers' sampler): the endpoint's routes through the SDK, its errors, the
  completions route, and the config's refusals.
"""
import json
import os
import sys

import pytest
import torch
from conftest import PYTHON, ROOT, run, tiny_overrides
from runs import values
from test_rollout_agent import _check_logprobs, _check_rows
from transformers import AutoTokenizer

from megagrpo.config.schema import ConfigError
from megagrpo.validation import load_config

HELPERS = {"PYTHONPATH": f"{ROOT}:{ROOT}/tests/helpers"}
AGENT = ["rollout.max_turns=3", "rollout.max_new_tokens=16", "rollout.tool_call_parser=agent_tools:python_parser",
         "rollout.max_model_len=512", "grpo.per_device_train_batch_size=16", "grpo.num_generations=4",
         "grpo.learning_rate=1e-3", "checkpoint.save_hf_at_end=false", "data.eval_file=null",
         "rewards.functions=[{name: agent}, {name: answer_match}]"]


def test_an_openai_sdk_agent_trains_on_exactly_the_tokens_vllm_sampled(tiny, tmp_path):
    """2 steps, then a recorded rollout: every turn of every episode calls python (the test's
    parser reads a call into each turn), so each episode makes 3 model calls, and all of a
    step's requests reach vLLM together."""
    out = tmp_path / "sdk"
    overrides = tiny_overrides(tiny, out) + AGENT + ["rollout.agent=openai_tool_agent:solve_streaming_rerendering"]
    run([PYTHON, "tests/helpers/agent_probe.py", "--config", "configs/tiny_arith.yaml", *overrides],
        env={**HELPERS, "PROBE_STEPS": "2"})
    result = json.load(open(out / "agent_rank0.json"))
    tokenizer = AutoTokenizer.from_pretrained(tiny["warm"])
    assert _check_rows(result, tokenizer) == 2 * len(result["rows"])  # two tool messages in each
    _check_logprobs(result)
    for row in result["rows"]:
        assert row["turns"] == 3 and row["failure"] == "" and row["agent_reward"] in (0.0, 1.0)
        # the agent sent its 2 earlier turns back reworded: counted, and the sampled tokens kept
        assert row["prefix_mismatches"] == 2
        assert row["messages"][-1]["role"] == "assistant" and "(as sent)" not in json.dumps(row["messages"])
    for step in result["steps"]:
        assert step["agent/episodes"] == 16 and step["agent/model_calls_per_episode"] == 3
        assert step["agent/requests_per_generator_call_max"] > 1  # the engine batched the episodes' calls
        assert step["agent/failed_crash"] == step["agent/failed_timeout"] == 0
        assert step["turns/mean"] == 3 and step["tokens/tool"] > 0 and torch.isfinite(torch.tensor(step["loss"]))


def test_crashing_hanging_and_silent_agents_end_their_episodes_and_the_run_goes_on(tiny, tmp_path):
    """A command agent whose episodes take turns to crash, hang past the timeout, end without
    calling the model, or send a malformed body and a request for another model first."""
    out, errors = tmp_path / "chaos", tmp_path / "errors.jsonl"
    overrides = tiny_overrides(tiny, out) + AGENT + [
        f"rollout.agent_command={sys.executable} tests/helpers/openai_tool_agent.py chaos",
        "rollout.agent_timeout_s=12", "grpo.max_steps=2", "checkpoint.save_steps=0"]
    run([PYTHON, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml", *overrides],
        env={**HELPERS, "AGENT_ERRORS": str(errors)}, timeout=600)
    for kind in ("crash", "timeout", "no_model_call"):  # 16 episodes a step, each fate every 5th
        assert all(v >= 3 / 16 for v in values(out, f"train/agent/failed_{kind}")), kind
    assert values(out, "train/agent/prefix_mismatches_per_episode") == [0.0, 0.0]  # a faithful agent
    assert len(values(out, "train/loss")) == 2  # both steps trained
    bodies = [json.loads(line) for line in open(errors)]
    assert len(bodies) >= 6
    for malformed, other_model in bodies:
        assert malformed["status"] == 400 and malformed["body"]["error"]["code"] == "malformed_json"
        assert other_model["status"] == 404 and other_model["body"]["error"]["code"] == "model_not_found"
        assert set(other_model["body"]["error"]) == {"message", "type", "param", "code"}


def test_the_endpoint_through_the_sdk_in_process(tiny, tmp_path):
    """transformers' sampler behind the endpoint: the model list, a chat turn and a streamed
    one, the completions route (a prompt that extends the episode appends only its extension,
    one that does not is a mismatch), an unknown key, an ended episode, and max_tokens."""
    import openai

    from megagrpo.data import load_prompts
    from megagrpo.policy.models import load_tokenizer
    from megagrpo.rollout.episodes import Episode
    from megagrpo.rollout.generators import HFGenerator
    from megagrpo.rollout.outside_agents import OutsideAgents

    sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
    cfg = load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path) + AGENT + [
        "rollout.engine=hf", "rollout.agent=openai_tool_agent:solve", "rollout.max_turns=8"])
    tokenizer = load_tokenizer(tiny["warm"])
    agents = OutsideAgents(cfg, HFGenerator(cfg, tiny["warm"], 0), tokenizer)
    try:
        prompts = load_prompts(cfg.data.train_file, tokenizer, 64)[0][:2]
        groups = agents.generate(prompts, n=2, seeds=[1, 2])
        assert [len(g) for g in groups] == [2, 2]
        from openai_tool_agent import PYTHON  # the agent's first request: the row's messages with its tool
        assert groups[0][0].prompt_ids == tokenizer.apply_chat_template(
            prompts[0].messages, tools=[PYTHON], add_generation_prompt=True, tokenize=True, return_dict=False)
        episode = Episode(key="k1", seed=5, task={})
        agents.endpoint.episodes["k1"] = episode
        client = openai.OpenAI(base_url=agents.endpoint.url("k1"), api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["policy"]
        reply = client.completions.create(model="policy", prompt="1 + 2 =", max_tokens=3)
        assert reply.usage.completion_tokens <= 3 and episode.calls == 1
        grown = tokenizer.decode(episode.ids) + " and"
        client.completions.create(model="policy", prompt=grown, max_tokens=2)
        assert episode.mismatches == 0 and episode.model_mask.count(0) >= 1  # " and" inserted, masked
        client.completions.create(model="policy", prompt="something else entirely", max_tokens=2)
        assert episode.mismatches == 1
        bearer = openai.OpenAI(base_url=agents.endpoint.url("k1").replace("/episodes/k1", ""), api_key="k1",
                               max_retries=0)
        bearer.completions.create(model="policy", prompt=tokenizer.decode(episode.ids), max_tokens=1)
        assert episode.calls == 4
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(model="policy", prompt="x", max_tokens=0)
        stranger = openai.OpenAI(base_url=agents.endpoint.url("nope"), api_key="x", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="no running episode"):
            stranger.completions.create(model="policy", prompt="x")
        episode.ended = "done"
        with pytest.raises(openai.BadRequestError, match="episode has ended"):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    finally:
        agents.close()


def test_a_pydantic_ai_agent_through_the_endpoint_keeps_the_sampled_tokens(tiny, tmp_path):
    """An agent framework people use (pydantic-ai, its OpenAI model pointed at the endpoint) on
    transformers' sampler in process: every episode ends without failure, some call the tool,
    and each trajectory is the ids the engine returned turn by turn with the tool results
    inserted; pydantic-ai sends the conversation back as it was returned (no mismatch)."""
    from megagrpo.data import load_prompts
    from megagrpo.policy.models import load_tokenizer
    from megagrpo.rollout.generators import HFGenerator
    from megagrpo.rollout.outside_agents import OutsideAgents

    sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
    cfg = load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path) + AGENT + [
        "rollout.engine=hf", "rollout.agent=pydantic_ai_agent:solve",
        "rollout.tool_call_parser=pydantic_ai_agent:python_on_some_turns"])
    tokenizer = load_tokenizer(tiny["warm"])
    engine = HFGenerator(cfg, tiny["warm"], 0)
    calls, generate = [], engine.generate

    def recording_generate(prompt_ids, n, seeds, greedy=False, max_tokens=None):
        out = generate(prompt_ids, n=n, seeds=seeds, greedy=greedy, max_tokens=max_tokens)
        calls.append({"inputs": prompt_ids, "outputs": [[{"ids": c.token_ids, "logprobs": c.logprobs} for c in group]
                                                        for group in out]})
        return out

    engine.generate = recording_generate
    agents = OutsideAgents(cfg, engine, tokenizer)
    try:
        prompts = load_prompts(cfg.data.train_file, tokenizer, 64)[0][:8]
        episodes = [t for group in agents.generate(prompts, n=2, seeds=list(range(8))) for t in group]
    finally:
        agents.close()
    assert all(t.failure == "" and t.prefix_mismatches == 0 for t in episodes), [t.failure for t in episodes]
    rows = [{"prompt": t.prompt_ids, "completion": t.token_ids, "mask": [float(m) for m in t.model_mask],
             "sampler_logp": t.logprobs, "turns": t.turns} for t in episodes]
    assert _check_rows({"calls": calls, "rows": rows}, tokenizer) >= 1  # some episodes called the tool


@pytest.mark.parametrize("overrides,message", [
    (["rollout.agent=openai_tool_agent:solve", "rollout.agent_command=python x.py"],
     "each start the episodes' program: give one"),
    (["rollout.agent=openai_tool_agent:solve", "rollout.tools=[python]", "rollout.max_turns=3"], "its own tools"),
    (["rollout.agent=openai_tool_agent:nothing"], "rollout.agent: module 'openai_tool_agent' has no 'nothing'"),
    (["rollout.agent_command=python \"x"], "does not parse as a command"),
    (["rollout.agent=openai_tool_agent:solve", "rollout.agent_timeout_s=0"], "rollout.agent_timeout_s: 0.0 must be"),
    (["rewards.functions=[{name: agent}]", "rollout.max_turns=1"], "the 'agent' reward is an outside agent's result"),
])
def test_outside_agent_settings_that_cannot_work_are_refused(tiny, tmp_path, overrides, message):
    sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path) + overrides)
