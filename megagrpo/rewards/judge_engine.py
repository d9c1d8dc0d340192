"""The judge's own vLLM engine in the job (`judge` with `args.model` and no `args.url`): each
training rank that builds the reward starts `vllm serve` of the judge model on 127.0.0.1 as its
child process, waits for it to answer, judges through it exactly as through a URL, and stops
it when the run ends (or when the rank dies: the server gets SIGTERM with its parent).

Why a child process and not a second engine inside the rank: vLLM keeps its parallel state
(its distributed groups) per process, and the rank's co-located generator holds it already, so a
second `vllm.LLM` in the same process would have to share it (not tried). A child server avoids
that for one process and a local HTTP hop per request (batched as a URL judge's requests are).

    rewards:
      functions:
        - name: judge
          args: {model: runs/judge, rubric: "..."}   # engine_args: more `vllm serve` flags
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import torch

from megagrpo.cluster.distributed import free_port
from megagrpo.rollout.serving import (
    env_outside_launch,
    log_tail,
    start_child_server,
    stop_child_server,
    wait_until_healthy,
)


class JudgeEngineError(RuntimeError):
    """The judge's engine did not start or stopped; the message names its log."""


class JudgeEngine:
    """`vllm serve` of the judge model for this rank: `url` once it answers /health."""

    def __init__(self, model: str, log_dir: str, max_model_len: Optional[int] = None,
                 gpu_memory_utilization: float = 0.15, engine_args: tuple = (), timeout_s: float = 600.0):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise JudgeEngineError(f"judge: args.model {model!r} is not a model folder (no config.json); give the "
                                   "judge model's folder, or args.url of a server of it")
        port, rank = free_port(), int(os.environ.get("RANK", "0"))
        os.makedirs(log_dir, exist_ok=True)
        self.log_path = os.path.abspath(os.path.join(log_dir, f"judge_engine_rank{rank}.log"))
        self.url = f"http://127.0.0.1:{port}"
        self.process = start_child_server(
            [*engine_command(model, port, max_model_len, gpu_memory_utilization), *engine_args], engine_env(),
            self.log_path)
        if not wait_until_healthy(self.process, self.url, timeout_s):
            why = (f"exited with {self.process.returncode}" if self.process.poll() is not None else
                   f"did not answer /health within {timeout_s:g} s")  # (told before close() ends it)
            self.close()
            raise JudgeEngineError(f"the judge's engine (vllm serve {model}) {why}; its log: {self.log_path}:\n"
                                   f"{log_tail(self.log_path)}")

    def close(self) -> None:
        stop_child_server(self.process)


def engine_command(model: str, port: int, max_model_len: Optional[int], gpu_memory_utilization: float) -> list[str]:
    """The judge's server: greedy verdicts from the request alone (no sampling defaults of the
    model folder's); on CPU eager, float32 and a 256 MiB KV cache, on a GPU a share of its memory."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--generation-config", "vllm", "--shutdown-timeout", "20",
           "--disable-uvicorn-access-log"]
    if max_model_len:  # else the model's own context
        cmd += ["--max-model-len", str(max_model_len)]
    if torch.cuda.is_available():
        return cmd + ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    return cmd + ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(256 * 2**20)]


def engine_env() -> dict:
    """This rank's environment without the launch's variables (the server is no rank of it)."""
    env = env_outside_launch()
    if not torch.cuda.is_available():
        env["TORCHDYNAMO_DISABLE"] = "1"  # nothing compiled on CPU, as the co-located engine
    return env
