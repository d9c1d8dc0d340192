"""verifiers environments (Prime Intellect's Environments Hub) as outside agents:

    rollout.environment: verifiers:vf-arith          # the taskset's id
    rollout.environment_config: {taskset: {seed: 3}}  # verifiers' EnvConfig, as a mapping

verifiers 0.4 runs an environment's episodes with its own machinery: a harness program makes the
model calls, behind verifiers' interception server. So megagrpo does not run the environment in
its loop. Each rank starts one runner (hubs/verifiers_runner.py) with the python of the venv that
holds verifiers and the environment's package (rollout.verifiers_python; launch/install_hub.sh
verifiers makes .venv-verifiers), and hands it every episode: the row's task data
(tools/prepare_data.py --verifiers writes the rows) and the episode's base URL of megagrpo's
OpenAI-compatible endpoint. The runner plays the episodes concurrently; their model calls come
back through the endpoint and are recorded as tokens (rollout/outside_agents.py). The episode's
result is the environment's own reward, for the `agent` reward. docs/environments.md.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
from typing import Optional

from megagrpo.config.schema import ConfigError

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verifiers_runner.py")
REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INSTALL_HINT = "bash launch/install_hub.sh verifiers makes .venv-verifiers"
READY_TIMEOUT_S = 600.0  # importing verifiers and loading an environment; a first uv set-up


def hub_python(configured: Optional[str]) -> str:
    """rollout.verifiers_python, a relative path taken from the repository; by default the
    repository's .venv-verifiers. A one-line error where it is missing."""
    path = configured or os.path.join(REPOSITORY, ".venv-verifiers", "bin", "python")
    path = path if os.path.isabs(path) else os.path.join(REPOSITORY, path)
    if not os.access(path, os.X_OK):
        raise ConfigError(f"rollout.verifiers_python: {path} is not an executable python: verifiers runs in a "
                          f"venv of its own ({INSTALL_HINT}; docs/environments.md)")
    return path


def env_config(environment: str, overrides: dict) -> dict:
    """verifiers' EnvConfig for `verifiers:TASKSET`: the taskset's id under rollout.environment_config."""
    taskset_id = environment.partition(":")[2]
    if not taskset_id:
        raise ConfigError(f"rollout.environment: '{environment}' names no taskset after 'verifiers:'")
    config = json.loads(json.dumps(overrides or {}))
    taskset = config.setdefault("taskset", {})
    if not isinstance(taskset, dict):
        raise ConfigError(f"rollout.environment_config.taskset: {taskset!r} must be a mapping")
    if taskset.get("id", taskset_id) != taskset_id:
        raise ConfigError(f"rollout.environment_config.taskset.id '{taskset['id']}' differs from "
                          f"rollout.environment '{environment}': give the taskset once")
    taskset["id"] = taskset_id
    return config


class VerifiersRunner:
    """One runner process per rank; `__call__` is the outside-agent program of one episode."""

    def __init__(self, environment: str, overrides: dict, python: Optional[str] = None):
        self.command = [hub_python(python), RUNNER, "serve", json.dumps(env_config(environment, overrides))]
        self.environment = environment
        self.process: Optional[subprocess.Popen] = None
        self.lock, self.next_id = threading.Lock(), 0
        self.waiting: dict = {}   # request id -> [threading.Event, answer]
        self.ended = False        # the runner's output closed: no answer will come any more
        self.stderr = collections.deque(maxlen=40)  # its last lines, for a failure's message

    def start(self) -> None:
        """Start the runner and wait for it to load the environment: a failure to load is the
        run's start-up error, with the runner's own last lines."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PATH"] = os.path.dirname(self.command[0]) + os.pathsep + env.get("PATH", "")  # its uv
        self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        drain = threading.Thread(target=self._drain_stderr, daemon=True, name="verifiers-stderr")
        drain.start()
        ready = threading.Event()
        first: list = []
        threading.Thread(target=self._read_answers, args=(ready, first), daemon=True, name="verifiers").start()
        if not ready.wait(READY_TIMEOUT_S) or not first:
            self.close()
            drain.join(timeout=10)  # its last lines say why
            raise RuntimeError(f"rollout.environment '{self.environment}': the verifiers runner did not come up "
                               f"({self._reason()})")

    def _drain_stderr(self) -> None:
        for line in self.process.stderr:
            self.stderr.append(line.rstrip())

    def _read_answers(self, ready: threading.Event, first: list) -> None:
        for line in self.process.stdout:
            try:
                answer = json.loads(line)
            except ValueError:
                continue  # not the protocol's: something in the runner printed to stdout
            if "ready" in answer:
                first.append(answer)
                ready.set()
                continue
            entry = self.waiting.get(answer.get("id"))
            if entry is not None:
                entry[1] = answer
                entry[0].set()
        ready.set()  # the runner ended: everyone waiting, and every later episode, fails with its reason
        with self.lock:
            self.ended = True
            for entry in self.waiting.values():
                entry[0].set()

    def _reason(self) -> str:
        code = None
        if self.process is not None:
            try:  # a runner whose output has closed is exiting: its code comes within moments
                code = self.process.wait(timeout=5 if self.ended else 0)
            except subprocess.TimeoutExpired:
                pass
        tail = " | ".join(line for line in list(self.stderr)[-6:] if line.strip())
        return (f"exit code {code}" if code is not None else "still running") + (f": {tail}" if tail else "")

    def __call__(self, base_url: str, api_key: str, model: str, task: dict) -> dict:
        data = task.get("fields", {}).get("verifiers_task")
        if not isinstance(data, str):
            raise ValueError("the row has no verifiers_task: write the rows with tools/prepare_data.py --verifiers")
        with self.lock:
            if self.process is None:
                self.start()
            if self.ended or self.process.poll() is not None:
                raise RuntimeError(f"the verifiers runner ended ({self._reason()})")
            self.next_id += 1
            request_id, entry = self.next_id, [threading.Event(), None]
            self.waiting[request_id] = entry
            try:
                self.process.stdin.write(json.dumps({"id": request_id, "task": json.loads(data),
                                                     "base_url": base_url, "model": model}) + "\n")
                self.process.stdin.flush()
            except OSError:
                pass  # the runner is gone: the reader has already woken everyone
        try:
            # a runner that died may leave a child holding its output open: look at it as well
            while not entry[0].wait(1.0) and self.process.poll() is None:
                pass
        finally:
            self.waiting.pop(request_id, None)
        answer = entry[1]
        if answer is None:
            raise RuntimeError(f"the verifiers runner ended ({self._reason()})")
        if answer.get("error"):
            raise RuntimeError(f"verifiers: {answer['error']}")
        return {"reward": answer["reward"]}

    def close(self) -> None:
        """Close the runner's input (it ends its episodes and exits), then end whatever of its
        session is left (harness programs, interception workers)."""
        if self.process is None:
            return
        try:
            self.process.stdin.close()
            self.process.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def write_rows(environment: str, overrides: dict, python: Optional[str], count: int, skip: int) -> list[dict]:
    """`count` rows of the environment's tasks from the `skip`-th on: {"prompt" or "messages",
    "verifiers_task": the task's data as JSON}."""
    command = [hub_python(python), RUNNER, "rows", json.dumps(env_config(environment, overrides)), str(count),
               str(skip)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output on stderr)"])[-1]
        raise ConfigError(f"verifiers taskset '{environment}' did not load: {tail}")
    rows = []
    for line in proc.stdout.splitlines():
        data = json.loads(line)
        # a task whose environment opens the conversation itself (verifiers' OpenEnv taskset) has
        # no prompt: its name stands in, for megagrpo's logs; the environment never sees it
        prompt = data.get("prompt") or data.get("name") or f"task {skip + len(rows)}"
        rows.append({("messages" if isinstance(prompt, list) else "prompt"): prompt,
                     "verifiers_task": json.dumps(data)})
    if len(rows) < count:
        print(f"verifiers taskset '{environment}' holds {len(rows)} tasks from task {skip} on, "
              f"not {count}", file=sys.stderr)
    return rows
