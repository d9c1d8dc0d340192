"""Environments from the hubs (megagrpo/hubs): a real TextArena game played through the real
multi-turn loop and scored by its own reward, its boards written by tools/prepare_data.py; a
verifiers environment run by verifiers itself from .venv-verifiers, its model calls recorded as
the tokens vLLM sampled; the one-line errors for what is not there; and environments that
raise, which end their episode scored 0 with the reason while the run goes on."""
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from conftest import PYTHON, ROOT, free_port, run, tiny_overrides
from transformers import AutoTokenizer

sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))

from megagrpo.config.schema import ConfigError
from megagrpo.data import load_prompts
from megagrpo.policy.batch import Completion
from megagrpo.rollout.agent import AgentLoop
from megagrpo.rollout.generator_group import GeneratorGroup
from megagrpo.rollout.tools import Toolset
from megagrpo.validation import load_config

GAME = "GuessTheNumber-v0"  # 1 to 20 in 10 guesses, answered "higher" or "lower"


class BisectingPlayer:
    """A generator (rollout/generators.py's interface) that plays each request's game by
    bisection, reading the conversation so far: a `move` call while the game runs, a last
    plain turn once the game says it is over."""

    def __init__(self, tokenizer):
        self.tokenizer, self.requests = tokenizer, 0

    def turn(self, conversation: str) -> str:
        after_prompt = conversation.split("<tool_response>", 1)
        low, high = 1, 20
        if len(after_prompt) > 1:
            if "The game is over" in after_prompt[1].split("<tool_response>")[-1]:
                return "I have played the game."
            guesses = [int(g) for g in re.findall(r'"action": "\[(\d+)\]"', conversation)]
            answers = re.findall(r"The target number is (higher|lower)", after_prompt[1])
            for guess, answer in zip(guesses, answers):
                low, high = (guess + 1, high) if answer == "higher" else (low, guess - 1)
        return f'<tool_call>{{"name": "move", "arguments": {{"action": "[{(low + high) // 2}]"}}}}</tool_call>'

    def generate(self, prompt_ids, n, seeds, greedy=False, max_tokens=None):
        out = []
        for ids in prompt_ids:
            self.requests += 1
            text = self.turn(self.tokenizer.decode(ids, skip_special_tokens=False))
            turn = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            out.append([Completion(turn, [-0.5] * len(turn), False) for _ in range(n)])
        return out


def _loop(tiny, data_file, environment, max_turns=14):
    overrides = [f"rollout.max_turns={max_turns}", f"rollout.environment={environment}",
                 f"model.name_or_path={tiny['model']}", f"data.train_file={data_file}", "deepspeed={}",
                 "data.max_prompt_length=900", "rollout.max_new_tokens=60", "rollout.max_model_len=4096",
                 "rewards.functions=[environment]"]
    cfg = load_config(None, overrides, training=False)
    tokenizer = AutoTokenizer.from_pretrained(tiny["model"])
    toolset = Toolset(cfg)
    player = BisectingPlayer(tokenizer)
    loop = AgentLoop(cfg, GeneratorGroup.of_one(player), tokenizer, toolset)
    prompts, _ = load_prompts(str(data_file), tokenizer, cfg.data.max_prompt_length, tools=toolset.schemas)
    return loop, prompts, player


def test_a_textarena_game_is_played_through_the_loop_and_scored_by_its_own_reward(tiny, tmp_path):
    out = tmp_path / "guess"
    proc = run([PYTHON, "tools/prepare_data.py", "--textarena", GAME, "--out", str(out), "--train-size", "6",
                "--eval-size", "2", "--seed", "10"])
    assert f"6 boards of TextArena's {GAME}" in proc.stdout
    rows = [json.loads(line) for line in open(out / "train.jsonl")]
    held_out = [json.loads(line) for line in open(out / "eval.jsonl")]
    assert [r["seed"] for r in rows] == list(range(10, 16)) and [r["seed"] for r in held_out] == [16, 17]
    assert all("Guess The Number" in r["prompt"] and "move tool" in r["prompt"] for r in rows)

    loop, prompts, player = _loop(tiny, out / "train.jsonl", f"textarena:{GAME}")
    groups = loop.generate(prompts, n=2, seeds=list(range(len(prompts))))
    guesses = []
    for group, row in zip(groups, rows):
        for t in group:
            # bisection finds 1..20 in at most 5 guesses; the game's own reward for a win is 1
            assert t.environment_reward == 1.0 and t.failure == "", (row, t.messages[-3:])
            assert t.ended_by == "answer" and 2 <= t.turns <= 6 and t.tool_calls == t.turns - 1
            assert "Congratulations" in t.messages[-2]["content"]
            assert len(t.token_ids) == len(t.logprobs) == len(t.model_mask)
            assert 0 in t.model_mask  # the game's answers are inserted, not trained on
        # one seed, one board: both episodes of a row play the same game the same way
        assert group[0].token_ids == group[1].token_ids
        guesses.append(json.dumps([m.get("tool_calls") for m in group[0].messages]))
    assert len(set(guesses)) > 1, "every seed hid the same number"
    # a group's first turns are one request (n=2), each later turn a request of its own
    assert player.requests == sum(t.turns for group in groups for t in group) - len(prompts)

    # the same boards again, now with all twelve games in the tool threads at once: the same plays
    again = loop.generate(prompts, n=2, seeds=list(range(len(prompts))))
    assert [t.token_ids for g in again for t in g] == [t.token_ids for g in groups for t in g]


def test_environments_that_raise_end_their_episode_scored_zero_and_the_loop_goes_on(tiny, tmp_path, capfd):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Find {s}", "secret": s}) + "\n" for s in (1, 2, 3, 4)))
    loop, prompts, player = _loop(tiny, data, "agent_tools:BrokenGame", max_turns=3)
    player.turn = lambda conversation: (
        '<tool_call>{"name": "guess", "arguments": {"number": 4}}</tool_call>' if "<tool_response>" not in conversation
        else "done")
    (reset_fails,), (reward_fails,), (close_fails,), (fine,) = loop.generate(prompts, n=1, seeds=[0, 1, 2, 3])
    assert reset_fails.ended_by == "environment_error" and reset_fails.turns == 1 and reset_fails.tool_calls == 0
    assert reset_fails.failure == "environment: reset raised RuntimeError: no board for secret 1"
    assert reset_fails.environment_reward == 0.0
    assert reward_fails.failure == "environment: get_reward raised KeyError: 'score'"
    assert reward_fails.environment_reward == 0.0 and reward_fails.ended_by == "answer"
    assert close_fails.failure == "" and close_fails.environment_reward == pytest.approx(0.1)  # its reward stands
    assert fine.failure == "" and fine.environment_reward == 1.0
    printed = capfd.readouterr().out
    assert printed.count("no board for secret 1") == 1 and "the board would not close" in printed
    loop.generate(prompts[:1], n=2, seeds=[5])  # a reason already printed is not printed again
    assert "no board" not in capfd.readouterr().out


@pytest.mark.parametrize("environment, message", [
    ("textarena:Nope-v0", "textarena has no game 'Nope-v0'; textarena.envs.registration.ENV_REGISTRY lists"),
    ("textarena:guessthenumber", "did you mean GuessTheNumber-v0, "),
    ("'verifiers:'", "names no taskset after 'verifiers:'"),  # quoted: YAML reads verifiers: as a mapping
    ("openenv:echo_env", "through verifiers' openenv taskset: rollout.environment: verifiers:openenv"),
])
def test_hub_names_that_do_not_resolve_get_one_line_errors(environment, message, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "x"}\n')
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.max_turns=3", f"rollout.environment={environment}", "model.name_or_path=org/m",
                           f"data.train_file={data}", "deepspeed={}"], training=False)
    assert message in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("rollout.environment: ")


def test_prepare_data_names_a_game_textarena_lacks(tmp_path):
    proc = run([PYTHON, "tools/prepare_data.py", "--textarena", "Wordl", "--out", str(tmp_path)], check=False)
    assert proc.returncode == 2 and "textarena has no game 'Wordl'" in proc.stderr
    assert not os.listdir(tmp_path)


VERIFIERS_PYTHON = os.path.join(ROOT, ".venv-verifiers", "bin", "python")


@pytest.fixture(scope="module")
def verifiers_venv():
    """.venv-verifiers (tests/run.sh makes it: launch/install_hub.sh verifiers); CI's must hold it."""
    if not os.access(VERIFIERS_PYTHON, os.X_OK):
        missing = f"{VERIFIERS_PYTHON} is missing: bash launch/install_hub.sh verifiers"
        pytest.fail(missing) if os.environ.get("MEGAGRPO_CI") else pytest.skip(missing)
    return {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT}/tests/helpers"}  # vf_arith: the taskset vf-arith


def _probe_a_step(tiny, tmp_path, env, data, taskset: str, overrides: dict) -> dict:
    """A training step and a recorded rollout of 8 episodes (2 prompts x 4) of a verifiers
    taskset, through tests/helpers/agent_probe.py: its result (agent_rank0.json)."""
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny, out, **{
        "data.train_file": data / "train.jsonl", "data.eval_file": "null",
        "rollout.environment": f"verifiers:{taskset}", "rollout.max_turns": 3, "rollout.max_new_tokens": 16,
        "grpo.per_device_train_batch_size": 8, "grpo.num_generations": 4, "checkpoint.save_hf_at_end": "false",
        "rewards.functions": "[{name: agent}]",
        **overrides})
    run([PYTHON, "tests/helpers/agent_probe.py", "--config", "configs/tiny_arith.yaml", *overrides],
        env={**env, "PROBE_STEPS": "1"})
    return json.load(open(out / "agent_rank0.json"))


def test_a_verifiers_environment_trains_through_the_endpoint_on_the_sampled_tokens(tiny, tmp_path, verifiers_venv):
    """tests/helpers/vf_arith, a two-turn verifiers environment, written by prepare_data.py and
    run by verifiers' own runner, harness and interception server against megagrpo's endpoint:
    every episode's two model calls are recorded as the very tokens and log-probs vLLM sampled,
    the user's second question between them masked; the environment's reward is the `agent`
    reward; a training step runs on them."""
    from test_rollout_agent import _check_logprobs, _check_rows

    def stated(reply: str) -> str:  # the answer a reply states, as vf_arith reads it
        return reply.rsplit("Answer:", 1)[-1].strip() if "Answer:" in reply else ""

    data = tmp_path / "vf"
    run([PYTHON, "tools/prepare_data.py", "--verifiers", "vf-arith", "--out", str(data), "--train-size", "32",
         "--eval-size", "4"], env=verifiers_venv)
    first = json.loads(open(data / "train.jsonl").readline())
    task = json.loads(first["verifiers_task"])
    assert first["prompt"] == task["prompt"] and task["name"] == "vf-arith#0" and len(task["answers"]) == 2
    result = _probe_a_step(tiny, tmp_path, verifiers_venv, data, "vf-arith", {"rollout.max_model_len": 512})
    step = result["steps"][0]
    assert step["agent/episodes"] == 8 and step["agent/model_calls_per_episode"] == 2
    assert step["agent/prefix_mismatches_per_episode"] == 0  # verifiers sends the turns back as sampled
    assert step["agent/failed_crash"] == step["agent/failed_timeout"] == step["agent/failed_no_model_call"] == 0
    assert torch.isfinite(torch.tensor(step["loss"]))
    tokenizer = AutoTokenizer.from_pretrained(tiny["warm"])
    assert _check_rows(result, tokenizer, expect_python=False, between="user") == len(result["rows"])
    _check_logprobs(result)
    for row in result["rows"]:  # the reward is the environment's: the share of its two sums answered right
        assert row["turns"] == 2 and row["failure"] == ""
        questions = [re.fullmatch(r"What is (\d) \+ (\d)\?", m["content"])
                     for m in row["messages"] if m["role"] == "user"]
        replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert len(questions) == len(replies) == 2 and all(questions), row["messages"]
        right = [stated(reply) == str(int(q.group(1)) + int(q.group(2))) for q, reply in zip(questions, replies)]
        assert row["agent_reward"] == sum(right) / 2, (replies, row["agent_reward"])


@pytest.fixture
def openenv_server(verifiers_venv, tmp_path):
    """An OpenEnv environment as OpenEnv's own CLI makes one (`openenv init`: its echo
    environment, whose step reward is a tenth of the action message's length), served by uvicorn
    from .venv-verifiers with room for 64 sessions at once (the template allows 1)."""
    bin_dir = os.path.dirname(VERIFIERS_PYTHON)
    run([f"{bin_dir}/openenv", "init", "echo_env", "--output-dir", str(tmp_path)], env=verifiers_venv)
    app = tmp_path / "echo_env" / "server" / "app.py"
    app.write_text(app.read_text().replace("max_concurrent_envs=1,", "max_concurrent_envs=64,"))
    port = free_port()
    server = subprocess.Popen([VERIFIERS_PYTHON, "-m", "uvicorn", "server.app:app", "--host", "127.0.0.1",
                               "--port", str(port)], cwd=tmp_path / "echo_env", stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / "server.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{url}/schema", timeout=1)
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "server.log").read_text()
                time.sleep(0.5)
        yield url
    finally:
        server.kill()
        server.wait()


def test_an_openenv_server_is_played_through_verifiers_openenv_taskset(tiny, tmp_path, verifiers_venv,
                                                                      openenv_server):
    """rollout.environment verifiers:openenv against the OpenEnv server: each episode's first
    prompt is the server's observation and action schema, each model turn is stepped as an
    OpenEnv action, and the episode's reward is the sum of the server's step rewards (the echo
    environment's: a tenth of each stepped reply's length), recorded on the sampled tokens."""
    from test_rollout_agent import _check_logprobs, _check_rows

    # a task per set of reset arguments: two (the echo environment takes none)
    environment_config = {"taskset": {"base_url": openenv_server, "resets": [{}, {}]}, "player": {"max_turns": 3}}
    data = tmp_path / "oe"
    run([PYTHON, "tools/prepare_data.py", "--verifiers", "openenv", "--environment-config",
         json.dumps(environment_config), "--out", str(data), "--train-size", "2", "--eval-size", "0"],
        env=verifiers_venv)
    result = _probe_a_step(tiny, tmp_path, verifiers_venv, data, "openenv", {
        "rollout.environment_config": json.dumps(environment_config), "rollout.max_model_len": 1024,
        "data.max_prompt_length": 128})
    step = result["steps"][0]
    assert step["agent/episodes"] == 8 and step["agent/failed_crash"] == step["agent/failed_timeout"] == 0
    assert torch.isfinite(torch.tensor(step["loss"]))
    tokenizer = AutoTokenizer.from_pretrained(tiny["warm"])
    _check_rows(result, tokenizer, expect_python=False, between="user")
    _check_logprobs(result)
    for row in result["rows"]:
        observation = json.loads(row["messages"][0]["content"])
        assert observation["observation"]["echoed_message"] == "Echo Env environment ready!"
        assert observation["action_schema"]["required"] == ["message"]
        replies = [m["content"].strip() for m in row["messages"] if m["role"] == "assistant"]
        assert row["failure"] == "" and replies
        assert row["agent_reward"] == pytest.approx(sum(0.1 * len(reply) for reply in replies), abs=1e-4), replies


def test_a_verifiers_environment_that_raises_or_is_missing_says_why(verifiers_venv, tmp_path, monkeypatch):
    """An environment whose run raises: each episode fails with verifiers' reason (the outside
    agent's "crash", scored 0), and the runner goes on serving; a runner that dies fails its
    episodes at once, naming its exit; a taskset verifiers cannot find stops the start with its
    one-line reason; a missing venv is a config error naming the fix."""
    from megagrpo.hubs.verifiers import VerifiersRunner, hub_python

    monkeypatch.setenv("PYTHONPATH", verifiers_venv["PYTHONPATH"])  # the runner inherits it
    runner = VerifiersRunner("verifiers:vf-arith", {"taskset": {"fail": True}})
    runner.start()
    try:
        task = {"fields": {"verifiers_task": json.dumps({"prompt": "What is 1 + 2?", "follow_up": "What is 3 + 4?",
                                                          "answers": ["3", "7"]})}}
        for _ in range(2):
            with pytest.raises(RuntimeError, match="vf-arith was told to fail"):
                runner(base_url="http://127.0.0.1:9/v1", api_key="k", model="policy", task=task)
        with pytest.raises(ValueError, match="tools/prepare_data.py --verifiers"):
            runner(base_url="http://127.0.0.1:9/v1", api_key="k", model="policy", task={"fields": {}})
    finally:
        runner.close()
    assert runner.process.returncode == 0  # its input closed, it ended cleanly
    runner = VerifiersRunner("verifiers:vf-arith", {})
    runner.start()
    runner.process.kill()  # a runner that dies: its episodes, and every later one, fail at once
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"the verifiers runner ended \(exit code -9"):
            runner(base_url="http://127.0.0.1:9/v1", api_key="k", model="policy", task=task)
    runner.close()
    with pytest.raises(RuntimeError, match="the verifiers runner did not come up .*taskset 'no-such-env' not found"):
        VerifiersRunner("verifiers:no-such-env", {}).start()
    with pytest.raises(ConfigError, match="rollout.verifiers_python: .* launch/install_hub.sh verifiers"):
        hub_python(str(tmp_path / "python"))


@pytest.mark.parametrize("overrides, message", [
    (["rollout.environment_config={taskset: {seed: 1}}"], "rollout.environment_config and rollout.verifiers_python "
                                                          "are a verifiers environment's"),
    (["rollout.environment=verifiers:vf-arith", "rollout.agent=my_agents:solve"],
     "rollout.agent, rollout.agent_command and a verifiers rollout.environment each start the episodes' program"),
    (["rollout.environment=verifiers:vf-arith", "rollout.environment_config={taskset: {id: other}}"],
     "rollout.environment_config.taskset.id 'other' differs from rollout.environment 'verifiers:vf-arith'"),
    (["rollout.environment=verifiers:vf-arith", "rewards.functions=[{name: environment}]"],
     "which a verifiers environment does not have: its reward is the 'agent' reward"),
])
def test_verifiers_settings_that_do_not_fit_are_refused(overrides, message, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "x"}\n')
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["rollout.max_turns=3", "model.name_or_path=org/m", f"data.train_file={data}",
                           "deepspeed={}", *overrides], training=False)
