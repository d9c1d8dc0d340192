"""Rollouts by agent programs megagrpo did not write: one run of the program per episode (each
of a step's prompts, rollout.num_generations times), generating through the OpenAI-compatible
endpoint in front of the generator (rollout/endpoint.py), recorded as tokens
(rollout/episodes.py).

    rollout.agent: my_pkg.agents:solve      # a Python callable, run in a thread of the trainer
    rollout.agent_command: python my_agent.py   # or a command, run as a process per episode

A callable is called as `solve(base_url=..., api_key=..., model=..., task=...)`. A command gets
the same in its environment (OPENAI_BASE_URL, OPENAI_API_KEY, MEGAGRPO_MODEL, MEGAGRPO_TASK)
and the task as JSON on stdin. The task is the data row: {"messages": [...], "fields": {...}}.
The episode's result, for the `agent` reward: what the callable returns, or the command's last
line of output: a number, or a JSON object with a "reward".

An episode fails, scores 0 and says why (the run goes on) when its program raises or exits
non-zero ("crash"), runs past rollout.agent_timeout_s ("timeout": a command's process group is
killed; a callable's thread cannot be, so its episode is closed to further requests and the
thread left to end), or ends without calling the model ("no_model_call").
"""
from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from megagrpo.config.loading import resolve_dotted
from megagrpo.config.schema import Config, ConfigError, max_sequence_length
from megagrpo.hubs import runs_as_outside_agent
from megagrpo.hubs.verifiers import VerifiersRunner, env_config, hub_python
from megagrpo.rollout.endpoint import Batcher, Endpoint
from megagrpo.rollout.episodes import Episode
from megagrpo.rollout.tools import resolve_parser

FAILURES = ("crash", "timeout", "no_model_call")


class AgentFailure(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def uses_outside_agent(cfg: Config) -> bool:
    r = cfg.rollout
    return bool(r.agent or r.agent_command or runs_as_outside_agent(r.environment))


def check_outside_agent(cfg: Config, generator_ranks: int) -> None:
    """Config check: one way to start the agent, settings in range, and an engine per rank
    (the endpoint lives in one process, beside the engine it feeds)."""
    r = cfg.rollout
    if not uses_outside_agent(cfg):
        return
    hub = runs_as_outside_agent(r.environment)
    if sum(map(bool, (r.agent, r.agent_command, hub))) > 1:
        raise ConfigError("rollout.agent, rollout.agent_command and a verifiers rollout.environment each start "
                          "the episodes' program: give one")
    if r.tools or (r.environment and not hub):
        raise ConfigError("rollout.tools and rollout.environment are the built-in loop's; an outside agent "
                          "(rollout.agent / agent_command) brings its own tools: remove them")
    if hub:
        env_config(r.environment, r.environment_config)
        hub_python(r.verifiers_python)
    elif r.agent:
        resolve_dotted(r.agent, "rollout.agent")
    else:
        try:
            command = shlex.split(r.agent_command)
        except ValueError as e:
            raise ConfigError(f"rollout.agent_command: {r.agent_command!r} does not parse as a command: {e}") from None
        if not command:
            raise ConfigError("rollout.agent_command is empty")
    for key in ("agent_timeout_s", "agent_concurrency", "agent_batch_window_s"):
        if getattr(r, key) <= 0:
            raise ConfigError(f"rollout.{key}: {getattr(r, key)} must be > 0")
    if generator_ranks > 1:
        raise ConfigError(f"rollout.agent with a vLLM engine shared by {generator_ranks} ranks "
                          "(rollout.tensor_parallel_size): not supported yet (the endpoint feeds one engine per "
                          "rank); use rollout.tensor_parallel_size 1, or rollout.servers")


def episode_result(value) -> Optional[float]:
    """An agent program's result as a reward: a number, {"reward": number}, or None."""
    if isinstance(value, dict):
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class OutsideAgents:
    """A step's episodes, run concurrently against one endpoint and one generator."""

    def __init__(self, cfg: Config, generator, tokenizer, log=lambda line: print(f"[megagrpo] {line}", flush=True)):
        r = cfg.rollout
        self.log, self.reported = log, set()  # each distinct failure is printed once
        self.cfg, self.generator, self.greedy = r, generator, False
        self.program = resolve_dotted(r.agent, "rollout.agent") if r.agent else None
        self.runner = None  # a verifiers environment's runner: the program of every episode
        if runs_as_outside_agent(r.environment):
            self.program = self.runner = VerifiersRunner(r.environment, r.environment_config, r.verifiers_python)
            self.runner.start()
        self.command = shlex.split(r.agent_command) if r.agent_command else None
        self.batcher = Batcher(self._sample, r.agent_batch_window_s)
        self.endpoint = Endpoint(r.agent_model_name, tokenizer, resolve_parser(r.tool_call_parser), self.batcher,
                                 max_sequence_length(cfg), r.max_new_tokens, r.max_turns)
        self.tool_wall_seconds = 0.0  # agent_metrics reads it: tools run inside the agents

    def _sample(self, ids: list, seeds: list, max_tokens: list) -> list:
        groups = self.generator.generate(ids, n=1, seeds=seeds, greedy=self.greedy, max_tokens=max_tokens)
        return [group[0] for group in groups]

    def generate(self, prompts: list, n: int, seeds: list[int], greedy: bool = False) -> list[list]:
        """n episodes per prompt (data.Prompt), as Trajectories; episode j of prompt i samples
        from seeds derived from seeds[i] and j, turn by turn."""
        self.greedy, self.batcher.in_flight_max = greedy, 0
        episodes = [Episode(key=secrets.token_urlsafe(12), seed=(seed * 1_000_033 + j) % 2**31,
                            task={"messages": list(p.messages), "fields": dict(p.fields)})
                    for p, seed in zip(prompts, seeds) for j in range(n)]
        for episode in episodes:
            self.endpoint.episodes[episode.key] = episode
        with ThreadPoolExecutor(max_workers=max(1, min(self.cfg.agent_concurrency, len(episodes))),
                                thread_name_prefix="agent") as pool:
            results = list(pool.map(self._run, episodes))
        failures = [failure for _, failure, _ in results]
        for failure in dict.fromkeys(f for f in failures if f and f not in self.reported):
            self.reported.add(failure)
            self.log(f"agent episodes failed ({failures.count(failure)} of {len(episodes)} this step; scored 0): "
                     f"{failure}")
        trajectories = []
        for episode, (reward, failure, seconds) in zip(episodes, results):
            t = episode.trajectory(reward, failure)
            # the batch's own figures travel with it (a batch sampled ahead is scored a step later)
            t.agent_seconds, t.generator_batch = seconds - episode.model_seconds, self.batcher.in_flight_max
            trajectories.append(t)
        return [trajectories[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _run(self, episode: Episode) -> tuple[Optional[float], str, float]:
        """(the agent's reward, its failure or "", wall seconds) of one episode."""
        with self.batcher.cond:
            self.batcher.running += 1
        start = time.perf_counter()
        try:
            value = self._call(episode) if self.program else self._execute(episode)
            if episode.calls == 0:
                raise AgentFailure("no_model_call", "the agent ended without calling the model")
            return episode_result(value), "", time.perf_counter() - start
        except AgentFailure as e:
            return None, f"{e.kind}: {e}", time.perf_counter() - start
        finally:
            with episode.lock:
                episode.ended = episode.ended or "done"
            self.endpoint.episodes.pop(episode.key, None)
            with self.batcher.cond:
                self.batcher.running -= 1
                self.batcher.cond.notify_all()

    def _call(self, episode: Episode):
        box: dict = {}

        def run():
            try:
                box["value"] = self.program(base_url=self.endpoint.url(episode.key), api_key=episode.key,
                                            model=self.cfg.agent_model_name, task=episode.task)
            except BaseException as e:  # the agent's own failure, whatever it is
                box["error"] = f"{type(e).__name__}: {e}"
        thread = threading.Thread(target=run, name=f"agent-{episode.key[:6]}", daemon=True)
        thread.start()
        thread.join(self.cfg.agent_timeout_s)
        if thread.is_alive():
            raise AgentFailure("timeout", "the agent ran past rollout.agent_timeout_s = "
                                          f"{self.cfg.agent_timeout_s:g} s")
        if "error" in box:
            raise AgentFailure("crash", box["error"][:500])
        return box.get("value")

    def _execute(self, episode: Episode):
        task = json.dumps(episode.task)
        env = {**os.environ, "OPENAI_BASE_URL": self.endpoint.url(episode.key), "OPENAI_API_KEY": episode.key,
               "MEGAGRPO_MODEL": self.cfg.agent_model_name, "MEGAGRPO_TASK": task}
        process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, env=env, text=True, start_new_session=True)
        try:
            out, err = process.communicate(task, timeout=self.cfg.agent_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise AgentFailure("timeout", f"the agent ran past rollout.agent_timeout_s = "
                                          f"{self.cfg.agent_timeout_s:g} s and was killed") from None
        if process.returncode != 0:
            last = (err.strip().splitlines() or ["(no output on stderr)"])[-1]
            raise AgentFailure("crash", f"exit code {process.returncode}: {last[:500]}")
        lines = [line for line in out.splitlines() if line.strip()]
        if not lines:
            return None
        try:
            return json.loads(lines[-1])
        except ValueError:
            return None

    def metrics(self, trajectories: list, group=None) -> dict:
        """The episodes of a step's batch (its Trajectories) over the ranks of `group`: how many,
        model calls and prefix mismatches per episode, failures by kind, the most requests one
        generator call took, and where an episode's time went (waiting on the model, or in the
        agent itself)."""
        from megagrpo.cluster.distributed import all_reduce

        sums = torch.tensor([len(trajectories), sum(t.turns for t in trajectories),
                             sum(t.prefix_mismatches for t in trajectories),
                             sum(t.model_seconds for t in trajectories), sum(t.agent_seconds for t in trajectories),
                             *[sum(t.failure.startswith(kind + ":") for t in trajectories) for kind in FAILURES]],
                            dtype=torch.float64)
        sums = all_reduce(sums, group=group)
        batch = all_reduce(torch.tensor([float(max((t.generator_batch for t in trajectories), default=0))],
                                        dtype=torch.float64), "max", group=group)
        count = max(float(sums[0]), 1.0)
        out = {"agent/episodes": float(sums[0]), "agent/model_calls_per_episode": float(sums[1]) / count,
               "agent/prefix_mismatches_per_episode": float(sums[2]) / count,
               "agent/seconds_in_model": float(sums[3]) / count, "agent/seconds_in_agent": float(sums[4]) / count,
               "agent/requests_per_generator_call_max": float(batch[0])}
        out.update({f"agent/failed_{kind}": float(v) / count for kind, v in zip(FAILURES, sums[5:].tolist())})
        return out

    def close(self) -> None:
        self.endpoint.close()
        if self.runner is not None:
            self.runner.close()
