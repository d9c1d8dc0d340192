"""Multi-turn, tool-using rollouts (rollout/agent.py, rollout/tools.py).

Unit tests of the parser, the argument checks, the tool runner and the tool-message tokens;
then real runs (vLLM, the sandbox, DeepSpeed ZeRO-3 on 2 ranks) through tests/helpers/agent_probe.py:
the trainer scores exactly the tokens vLLM sampled plus the inserted tool tokens, its log-probs
of the sampled tokens equal vLLM's, every bad tool call becomes an error the model reads, and
an environment with state gets one instance per trajectory."""
import json
import os
import re
import sys

import pytest
import torch
from conftest import BIN, PYTHON, ROOT, run, tiny_overrides, torchrun
from transformers import AutoTokenizer

sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
import agent_tools

from megagrpo.config.schema import ConfigError
from megagrpo.data import Prompt
from megagrpo.policy.batch import Completion, make_batch
from megagrpo.rollout.agent import ToolMessageRenderer
from megagrpo.rollout.tools import ToolRunner, Toolset, check_arguments, hermes
from megagrpo.validation import load_config

HELPERS = "agent_tools"  # tests/helpers is on PYTHONPATH for the runs below


# ---- parsing and checks ----------------------------------------------------------------------------

def test_hermes_parses_calls_in_order_and_names_what_is_wrong():
    calls = hermes('x <tool_call>{"name": "a", "arguments": {"k": 1}}</tool_call> y '
                   '<tool_call>{"name": "b", "arguments": "{\\"j\\": [2]}"}</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in calls] == [("a", {"k": 1}, None), ("b", {"j": [2]}, None)]
    assert hermes("no call here") == []
    errors = [c.error for c in hermes('<tool_call>{"name": </tool_call><tool_call>[1]</tool_call>'
                                      '<tool_call>{"name": "a", "arguments": 3}</tool_call><tool_call>{"name"')]
    assert errors[0].startswith("malformed tool call JSON")
    assert "JSON object" in errors[1] and "'arguments' must be a JSON object" == errors[2]
    assert errors[3] == "<tool_call> without its closing </tool_call>"
    deep = hermes("<tool_call>" + "[" * 100000 + "</tool_call>")  # RecursionError inside json
    assert len(deep) == 1 and deep[0].error.startswith("malformed")


def test_check_arguments_against_the_schema():
    schema = {"function": {"parameters": {"type": "object", "required": ["code"], "properties": {
        "code": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"}}}}}
    assert check_arguments(schema, {"code": "1", "n": 2, "x": 2}) is None
    assert check_arguments(schema, {}) == "missing argument(s) code"
    assert "unexpected argument(s) y" in check_arguments(schema, {"code": "1", "y": 1})
    assert check_arguments(schema, {"code": 1}) == "argument 'code' must be string, got int"
    assert check_arguments(schema, {"code": "1", "n": True}) == "argument 'n' must be integer, got bool"
    assert check_arguments(schema, {"code": "1", "n": 1.5}) == "argument 'n' must be integer, got float"


def _function_toolset(tmp_path, **rollout):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "x"}\n')
    cfg = load_config(None, [f"rollout.{k}={v}" for k, v in rollout.items()] + [
        "model.name_or_path=org/model", f"data.train_file={data}", "deepspeed={}"], training=False)
    return Toolset(cfg)


def test_bad_calls_become_errors_and_calls_of_a_turn_run_concurrently(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "tests", "helpers"))
    toolset = _function_toolset(tmp_path, max_turns=2, tool_timeout_s=1.0, max_tool_calls_per_turn=6, environment=
                                f"{HELPERS}:NumberGame",
                                tools=f"[{HELPERS}:lookup, {HELPERS}:slow, {HELPERS}:boom]")
    assert sorted(toolset.tools) == ["boom", "explode", "guess", "lookup", "slow"]
    runner = ToolRunner(toolset, max_calls_per_turn=6)
    script = "".join(call for kind, (call, _) in agent_tools.BAD_CALLS.items() if kind != "python_error")
    jobs = [(hermes(script + '<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>'),
             toolset.new_environment({})[0]) for _ in range(6)]
    agent_tools.SLOW_STARTS.clear()
    results = runner.run(jobs)
    # at once: the six calls of `slow` began before the first one's 1 s timeout ran out (one after
    # another, each would begin after the previous one's); a loaded machine slows them all alike
    starts = agent_tools.SLOW_STARTS
    assert len(starts) == 6 and max(starts) - min(starts) < 1.0, f"the timeouts ran one after another: {starts}"
    for turn in results:
        kinds = [r.error_kind for r in turn]
        assert kinds == ["parse", "unknown_tool", "bad_arguments", "raised", "timeout", "raised",
                         "too_many_calls"], kinds
        for (kind, (_, message)), result in zip([kv for kv in agent_tools.BAD_CALLS.items()
                                                 if kv[0] != "python_error"], turn):
            assert message in result.content and result.content.startswith("error: "), (kind, result)
        assert turn[-1].content.startswith("error: more than 6 tool calls")
    good = runner.run([(hermes('<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>'), None)])
    assert good[0][0].content == "value of k" and good[0][0].error_kind is None


class _ScriptedTurns:
    """A generator (rollout/generators.py's interface) that answers every request with its
    script's next turn: (text, the weight version the server tagged its tokens with)."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, list(script)

    def generate(self, prompt_ids, n, seeds, greedy=False, max_tokens=None):
        text, version = self.script.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return [[Completion(ids, [-1.0] * len(ids), False, versions=[version] * len(ids))] for _ in prompt_ids]


def test_a_trajectory_carries_each_turns_weight_versions(tiny, tmp_path, monkeypatch):
    """rollout.partial_rollouts with tools: a turn sampled after a weight update carries the new
    version, a tool result's tokens the version of the turn they answer, and the trajectory's
    versions line up with its tokens."""
    from megagrpo.rollout.agent import AgentLoop
    from megagrpo.rollout.generator_group import GeneratorGroup

    monkeypatch.syspath_prepend(os.path.join(ROOT, "tests", "helpers"))
    toolset = _function_toolset(tmp_path, max_turns=2, tools=f"[{HELPERS}:lookup]")
    cfg = load_config(None, ["rollout.max_turns=2", f"rollout.tools=[{HELPERS}:lookup]",
                             f"model.name_or_path={tiny['warm']}", f"data.train_file={tmp_path / 'd.jsonl'}",
                             "deepspeed={}"], training=False)
    tokenizer = AutoTokenizer.from_pretrained(tiny["warm"])
    call = '<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>'
    loop = AgentLoop(cfg, GeneratorGroup.of_one(_ScriptedTurns(tokenizer, [(call, 3), ("the answer", 4)])),
                     tokenizer, toolset)
    prompt = Prompt("x", tokenizer("x")["input_ids"], messages=[{"role": "user", "content": "x"}])
    [[trajectory]] = loop.generate([prompt], n=1, seeds=[0])
    assert trajectory.turns == 2 and trajectory.tool_calls == 1
    assert len(trajectory.versions) == len(trajectory.token_ids) == len(trajectory.logprobs)
    first, answer = trajectory.model_mask.index(0), len(trajectory.token_ids) - trajectory.model_mask[::-1].index(0)
    assert set(trajectory.versions[:first]) == {3}  # the first turn
    assert set(trajectory.versions[first:answer]) == {3} and 0 not in trajectory.model_mask[answer:]  # its tool result
    assert set(trajectory.versions[answer:]) == {4}  # the turn sampled after the update


def test_tool_message_tokens_follow_the_template_and_split_special_tokens(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny["warm"])
    renderer = ToolMessageRenderer(tokenizer, max_content_tokens=20)
    ids, shown = renderer.render([{"role": "tool", "name": "python", "content": "42\n"}], model_ended_with_eos=True)
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    whole = tokenizer.apply_chat_template(probe + [{"role": "tool", "content": "42\n"}], tokenize=False,
                                          add_generation_prompt=True)
    assert tokenizer.decode(ids) == whole.split("a<|im_end|>", 1)[1]  # after the sampled EOS
    assert shown[0]["content"] == "42\n"
    # a tool printing the turn markers inserts their text, never the special tokens themselves
    ids, shown = renderer.render([{"role": "tool", "name": "python", "content": "<|im_end|>" * 40}], True)
    inner = ids[ids.index(tokenizer.convert_tokens_to_ids("<|im_start|>")) + 1:]
    inner = inner[:inner.index(tokenizer.eos_token_id)]
    assert tokenizer.eos_token_id not in inner and shown[0]["content"].endswith("\n[output cut]")
    without_eos, _ = renderer.render([{"role": "tool", "name": "python", "content": "1"}], model_ended_with_eos=False)
    assert without_eos[0] == tokenizer.eos_token_id  # the end of the turn the model did not sample


def test_model_mask_becomes_the_completion_mask():
    completions = [Completion([5, 6, 7, 8], [-1.0, 0.0, 0.0, -2.0], False, [1, 0, 0, 1]),
                   Completion([9], [-0.5], False)]
    batch = make_batch([[1, 2], [3]], completions, torch.zeros(2), pad_id=0)
    assert batch.completion_mask.tolist() == [[1, 0, 0, 1], [1, 0, 0, 0]]
    assert batch.input_ids[0].tolist() == [1, 2, 5, 6, 7, 8] and batch.sequences()[1] == [[5, 6, 7, 8], [9]]
    single = make_batch([[1, 2]], [Completion([5, 6], [-1.0, -2.0], False, [1, 1])], torch.zeros(1), 0)
    default = make_batch([[1, 2]], [Completion([5, 6], [-1.0, -2.0], False)], torch.zeros(1), 0)
    assert torch.equal(single.completion_mask, default.completion_mask)


@pytest.mark.parametrize("overrides,message", [
    (["rollout.max_turns=3"], "needs rollout.tools or rollout.environment"),
    (["rollout.tools=[python]"], "leaves no turn to read a tool's result"),
    (["rollout.max_turns=2", "rollout.tools=[nosuchmodule:fn]"], "cannot import module 'nosuchmodule'"),
    (["rollout.max_turns=2", "rollout.tools=[python, python]"], "more than one tool named python"),
    (["rollout.max_turns=2", "rollout.tools=[python]", "rollout.tool_call_parser=nope"], "not a dotted path"),
    (["rollout.max_turns=2", "rollout.tools=[json:dumps]"], "no tool schema"),
    (["rewards.functions=[environment]"], "'environment' reward reads the get_reward()"),
    (["max_tool_calling_iterations=-1"], "expected an integer >= 0"),
])
def test_multi_turn_config_errors_name_the_key(overrides, message, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "x"}\n')
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny_arith.yaml", [f"model.name_or_path={model}", f"data.train_file={data}",
                                                "data.eval_file=null", *overrides])
    assert message in str(e.value), str(e.value)


def test_trl_tool_iterations_name_maps_to_turns(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "x"}\n')
    cfg = load_config("configs/tiny_agent.yaml", [f"data.train_file={data}", "data.eval_file=null",
                                                  "model.name_or_path=org/model", "max_tool_calling_iterations=4"])
    assert cfg.rollout.max_turns == 5


# ---- real runs -------------------------------------------------------------------------------------

def _agent_overrides(tiny, out, parser, **extra):
    values = {"rollout.max_turns": 3, "rollout.max_new_tokens": 16, "rollout.tool_call_parser": f"{HELPERS}:{parser}",
              "grpo.per_device_train_batch_size": 16, "grpo.num_generations": 4, "grpo.learning_rate": 1e-3,
              "checkpoint.save_hf_at_end": "false", "data.eval_file": "null", "grpo.max_tokens_per_microbatch": 1024,
              "data.max_prompt_length": 160,
              **extra}
    return tiny_overrides(tiny, out, **{k: v for k, v in values.items()})


def _check_rows(result, tokenizer, expect_python=True, between="tool"):
    """Token identity: each trajectory is its prompt, then per turn what the engine returned for
    exactly the sequence so far, then the message in between (a tool result, or with between
    "user" the user's next turn); the mask is 1 on sampled tokens only."""
    calls = result["calls"]
    returned = {}
    for call in calls:
        for inputs, group in zip(call["inputs"], call["outputs"]):
            returned.setdefault(tuple(inputs), []).extend(group)
    multi = 0
    for row in result["rows"]:
        sequence, ids, mask = list(row["prompt"]), row["completion"], row["mask"]
        assert len(mask) == len(ids) and set(mask) <= {0.0, 1.0}
        position, turn = 0, 0
        while position < len(ids):
            end = position
            while end < len(ids) and mask[end] == 1.0:
                end += 1
            sampled = ids[position:end]
            options = returned.get(tuple(sequence), [])
            match = [o for o in options if o["ids"] == sampled]
            assert match, f"turn {turn}: the engine never returned these sampled tokens for this sequence"
            # and their log-probs (one of them, when two trajectories sampled the same tokens)
            assert any(o["logprobs"] == row["sampler_logp"][position:end] for o in match), turn
            sequence += sampled
            tool_end = end
            while tool_end < len(ids) and mask[tool_end] == 0.0:
                tool_end += 1
            inserted = ids[end:tool_end]
            if inserted:
                text = tokenizer.decode(inserted)
                # after a turn cut short (no EOS sampled; an outside agent may go on) the template closes it
                opening = "\n" if sampled and sampled[-1] == tokenizer.eos_token_id else "<|im_end|>\n"
                if between == "user":
                    assert re.fullmatch(re.escape(opening + "<|im_start|>user\n") + r"[^<]+"
                                        + re.escape("<|im_end|>\n<|im_start|>assistant\n"), text), text
                else:
                    assert text.startswith(opening + "<|im_start|>user\n<tool_response>\n") and text.endswith(
                        "</tool_response><|im_end|>\n<|im_start|>assistant\n"), text
                if expect_python:
                    turn_text = tokenizer.decode(sampled, skip_special_tokens=False)
                    assert f"<tool_response>\n{agent_tools.expected_python_output(turn_text)}\n</tool_response>" in text
                multi += 1
            sequence += inserted
            position, turn = tool_end, turn + 1
        assert sequence == row["prompt"] + ids
        assert turn == row["turns"]
    return multi


def _check_logprobs(result):
    worst = max(abs(a - b) for row in result["rows"] for a, b, m in
                zip(row["trainer_logp"], row["sampler_logp"], row["mask"]) if m == 1.0)
    assert worst < 1e-4, worst
    return worst


def test_multi_turn_one_rank_tokens_logprobs_bad_calls_and_environment(tiny, tmp_path):
    out = tmp_path / "one"
    overrides = _agent_overrides(tiny, out, "every_call_parser", **{
        "rollout.tools": f"[python, {HELPERS}:lookup, {HELPERS}:slow, {HELPERS}:boom]",
        "rollout.environment": f"{HELPERS}:NumberGame", "rollout.tool_timeout_s": 1.0,
        "rollout.max_tool_calls_per_turn": 10, "rollout.max_tool_response_tokens": 80, "rollout.max_model_len": 1024,
        "rewards.functions": "[{name: answer_match}, {name: environment, weight: 0.5}]"})
    run([PYTHON, "tests/helpers/agent_probe.py", "--config", "configs/tiny_arith.yaml", *overrides],
        env={"PYTHONPATH": f"{ROOT}:{ROOT}/tests/helpers", "PROBE_STEPS": "2"})
    result = json.load(open(out / "agent_rank0.json"))
    tokenizer = AutoTokenizer.from_pretrained(tiny["warm"])
    multi = _check_rows(result, tokenizer, expect_python=False)
    assert multi > 0, "no trajectory reached a second turn"
    _check_logprobs(result)
    rows = result["rows"]
    for row in rows:
        tool_messages = [m for m in row["messages"] if m["role"] == "tool"]
        if row["turns"] > 1:
            for kind, (_, message) in agent_tools.BAD_CALLS.items():
                assert any(message in m["content"] for m in tool_messages), (kind, tool_messages)
        # one game per trajectory: its reward reads this trajectory's guesses only
        guesses = sum(1 for m in row["messages"] if m["role"] == "assistant" and any(
            c["function"]["name"] == "guess" for c in m.get("tool_calls", [])))
        if row["ended_by"] != "budget":
            assert row["environment_reward"] == 1.0 or row["environment_reward"] == pytest.approx(0.1 * guesses)
    assert result["environments_created"] == result["environments_closed"] == len(rows)
    for step in result["steps"]:  # the run went on through every bad call
        assert step["tools/errors/parse"] > 0 and step["tools/errors/timeout"] > 0
        assert step["tools/errors/raised"] > 0 and step["turns/max"] >= 2
        assert torch.isfinite(torch.tensor(step["loss"])) and step["grad_norm"] > 0
        assert step["tokens/tool"] > 0 and step["tokens/model"] > 0


@pytest.mark.multirank
@pytest.mark.alone  # its vLLM tp 2 engine's /dev/shm names are every co-located tp 2 engine's (upstream-issues.md)
@pytest.mark.parametrize("layout", ["dp2_zero3_vllm_tp2", "tp2"])
def test_multi_turn_two_ranks_tokens_and_logprobs(tiny, tmp_path, layout):
    """dp 2 under ZeRO-3 with one vLLM engine sharded over both ranks: the engine runs both
    ranks' prompts as one pooled batch, the first rank runs the tools, each rank trains on its
    own prompts' trajectories. tp 2 (the engine at tp 2 too): the ranks share the trajectories
    and train on the same tokens. (One rank per engine, dp 2: the agentic quickstart.)"""
    out = tmp_path / "two"
    extra = {"rollout.tools": "[python]"}
    if layout == "tp2":
        extra["parallel.tensor_parallel_size"] = 2
    else:
        extra["rollout.tensor_parallel_size"] = 2
    overrides = _agent_overrides(tiny, out, "python_parser", **extra)
    run([*torchrun(2, "tests/helpers/agent_probe.py"),
         "--config", "configs/tiny_arith.yaml", *overrides], env={"PYTHONPATH": f"{ROOT}:{ROOT}/tests/helpers"})
    tokenizer = AutoTokenizer.from_pretrained(tiny["warm"])
    results = [json.load(open(out / f"agent_rank{rank}.json")) for rank in (0, 1)]
    for result in results:
        result["calls"] = result["calls"] or results[0]["calls"]  # tp: rank 1 did not sample
        assert _check_rows(result, tokenizer) > 0
        _check_logprobs(result)
        assert result["steps"][0]["tools/errors/raised"] == 0
    sequences = [[(row["prompt"], row["completion"]) for row in result["rows"]] for result in results]
    if layout == "tp2":
        assert results[1]["samples_rollout"] is False and sequences[0] == sequences[1]
    else:
        assert sequences[0][0][0] != sequences[1][0][0]  # the dp ranks sampled different prompts


# The last commit before multi-turn rollouts. A later change meant to move single-turn numbers
# (a new default of the loss, say) moves this pin to the commit before that change.
BEFORE_MULTI_TURN = "7cc9653d3fd5487019a3ea44733e9a4e0ab82170"


# statistics logged since BEFORE_MULTI_TURN (the run doctor's repetition measures, issue 48)
ADDED_SINCE = {"train/completions/repeated_ngrams", "train/completions/distinct_2"}


def _scalars(run_dir):
    """Every logged scalar but the timings, from TensorBoard (the old trainer wrote no metrics.jsonl);
    the run doctor's doctor/<check> findings are events, not statistics of a step."""
    from runs import tensorboard
    events = tensorboard(run_dir)
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
            if not tag.startswith(("train/time/", "train/memory/", "train/tokens_per_second", "startup/", "doctor/"))}


def test_single_turn_run_is_bit_identical_to_the_trainer_before_multi_turn(tiny, tmp_path):
    """max_turns 1, no tools: 3 steps (vLLM, one rank) give, bit for bit, what the trainer of
    BEFORE_MULTI_TURN gives on the same model and data: every logged scalar, the prompts seen,
    the held-out samples and the final weights. (Scalars added since, such as new statistics,
    would show as a difference of keys: ADDED_SINCE names them.)"""
    import subprocess

    from runs import exported

    have = subprocess.run(["git", "cat-file", "-e", f"{BEFORE_MULTI_TURN}^{{commit}}"], cwd=ROOT, capture_output=True)
    if have.returncode != 0:  # a shallow clone; CI's (.ci/run sets MEGAGRPO_CI) must hold it
        missing = f"commit {BEFORE_MULTI_TURN[:10]} is not in this clone (a shallow clone? git fetch --unshallow)"
        pytest.fail(missing) if os.environ.get("MEGAGRPO_CI") else pytest.skip(missing)
    old_tree = tmp_path / "before"
    old_tree.mkdir()
    archive = subprocess.run(["git", "archive", BEFORE_MULTI_TURN], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive, check=True)
    runs = {}
    for name, tree in (("before", str(old_tree)), ("now", ROOT)):
        runs[name] = tmp_path / f"run_{name}"
        # the KL bias correction came later (on by default); off, the objective is the one before
        now = {"grpo.use_bias_correction_kl": "false"} if name == "now" else {}
        # the old trainer does not put the venv's ninja first on PATH (cluster/distributed.py):
        # with Debian's it would rebuild DeepSpeed's CPU all-reduce op, and this one rebuild it back
        run([PYTHON, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
             *tiny_overrides(tiny, runs[name], **{"grpo.max_steps": 3, "checkpoint.save_steps": 0, **now})],
            cwd=tree, env={"PYTHONPATH": tree, "PATH": os.pathsep.join([BIN, os.environ.get("PATH", "")])})
    before, now = _scalars(runs["before"]), _scalars(runs["now"])
    assert ADDED_SINCE <= now.keys()
    now = {k: v for k, v in now.items() if k not in ADDED_SINCE}
    assert before.keys() == now.keys() and len(before) > 20
    assert before == now  # the losses, gradient norms, rewards and lengths among them
    assert len(now["train/loss"]) == 3 and all(v > 0 for v in now["train/grad_norm"]), now
    for name in ("prompts_seen.jsonl", "eval_results.json"):
        assert (runs["before"] / name).read_text() == (runs["now"] / name).read_text(), name
    weights = [exported(runs[name]) for name in ("before", "now")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
