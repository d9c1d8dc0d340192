"""The generating ranks of a disaggregated job (rollout.placement=disaggregated, the split:
cluster/placement.py).

The first rank of each block of rollout.tensor_parallel_size generating ranks runs one
`vllm serve` of the policy on its node (with its block's devices), publishes its URL in the
launch's store and keeps it up until trainer rank 0 says the job is done; the block's other
ranks wait with it. The server is started with the co-located engine's settings (dtype,
context, log-probs after temperature, whole-prompt prefill and a fixed KV cache on CPU, no
sampling defaults of its own), so a run samples the same tokens whichever placement it has
(tests/test_rollout_servers.py). The trainer ranks generate through these servers exactly as
through rollout.servers (rollout/servers.py), so staleness and the weight transfer are theirs.

    python -m megagrpo.train ...   # on a generating rank main() calls serve(cfg, placement)
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

import torch

from megagrpo.cluster.distributed import free_port
from megagrpo.cluster.placement import (
    DONE_KEY,
    Placement,
    launch_store,
    left_key,
    release_generating_ranks,
    server_key,
    server_urls,
)
from megagrpo.config.schema import Config
from megagrpo.rollout.vllm_settings import serve_flags, vllm_settings

# the launch's variables, which the server's own processes must not read as theirs
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
               "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCH_PREFIXES = ("TORCHELASTIC_", "OMPI_COMM_WORLD_", "PMIX_RANK")


class ServingError(RuntimeError):
    """A generating rank's server could not start or stopped; the message says where its log is."""


def server_command(cfg: Config, placement: Placement, host: str, port: int) -> list[str]:
    """`vllm serve` of the policy with the co-located engine's settings (rollout/vllm_settings.py)."""
    settings = vllm_settings(cfg, cfg.model.name_or_path, cfg.grpo.seed, placement.generator_tp,
                             torch.cuda.is_available())
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *serve_flags(settings),
           "--host", host, "--port", str(port), "--weight-transfer-config", json.dumps({"backend": "gloo"}),
           "--generation-config", "vllm",  # sampling settings from the request only, none from the model folder
           "--shutdown-timeout", "20",  # (0 force-kills CPU tp workers, leaking their shared memory)
           "--disable-uvicorn-access-log"]
    if cfg.rollout.partial_rollouts:  # vLLM's token route, which gives each token's weight version
        cmd += ["--enable-scale-out"]
    return cmd


def server_env(placement: Placement) -> dict:
    """The server's environment: this rank's without the launch's variables, with vLLM's RL
    routes on, and its block's devices (GPU) or cores (CPU tp: one share per worker)."""
    env = env_outside_launch()
    env["VLLM_SERVER_DEV_MODE"] = "1"
    tp, local_rank = placement.generator_tp, int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(d) for d in range(torch.cuda.device_count())]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[local_rank:local_rank + tp])
    else:
        env["TORCHDYNAMO_DISABLE"] = "1"  # as VLLMGenerator on CPU: nothing compiled
        if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            cores = sorted(os.sched_getaffinity(0))
            share = max(1, len(cores) // tp)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(map(str, cores[i * share:(i + 1) * share] or cores[-1:])) for i in range(tp))
    return env


def env_outside_launch() -> dict:
    """This rank's environment without the launch's variables: a server this rank starts is no
    rank of the launch."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(LAUNCH_PREFIXES)}


def start_child_server(cmd: list[str], env: dict, log_path: str) -> subprocess.Popen:
    """`cmd` as this rank's child (SIGTERM when the rank dies), its output in log_path."""
    with open(log_path, "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)


def wait_until_healthy(process: subprocess.Popen, url: str, timeout_s: float) -> bool:
    """True once url answers /health; False when the process exits first or timeout_s passes."""
    from megagrpo.rollout.servers import Server

    server = Server(url, timeout_s, retries=0)
    deadline = time.time() + timeout_s
    while not server.healthy():
        if process.poll() is not None or time.time() > deadline:
            return False
        time.sleep(1)
    return True


def stop_child_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()  # vLLM shuts its engine down (within --shutdown-timeout)
        try:
            process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def die_with_parent() -> None:
    """In the server's process: SIGTERM when this rank dies (a launcher's SIGKILL included)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def check_block(placement: Placement) -> None:
    """A server's ranks must be on one node (it runs there, on their devices)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 0)
    if local_size and local_rank + placement.generator_tp > local_size:
        raise ServingError(f"generator server {placement.server_index} (launch ranks {placement.rank}-"
                           f"{placement.rank + placement.generator_tp - 1}) would span two nodes: its node runs "
                           f"{local_size} ranks. Choose rollout.ranks and rollout.tensor_parallel_size so that "
                           "each server's ranks lie on one node")


def serve(cfg: Config, placement: Placement, log=lambda line: print(f"[megagrpo] {line}", flush=True)) -> None:
    """A generating rank's whole job: its block's server (first rank) up and published, held
    until the trainers are done (returns), or an error when it stops or the trainers vanish."""
    from megagrpo.rollout.servers import address_towards

    timeout = cfg.rollout.server_timeout_s
    store = launch_store(timeout)
    process = None
    try:
        if placement.starts_server:
            check_block(placement)
            host = address_towards(f"http://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
            port, index = free_port(), placement.server_index
            os.makedirs(cfg.output_dir, exist_ok=True)
            log_path = os.path.abspath(os.path.join(cfg.output_dir, f"vllm_server_{index}.log"))
            process = start_child_server(server_command(cfg, placement, host, port), server_env(placement), log_path)
            url = f"http://{host}:{port}"
            if not wait_until_healthy(process, url, timeout):
                raise ServingError(f"generator server {index} ({url}) " + (
                    f"exited with {process.returncode}" if process.poll() is not None else
                    f"did not answer /health within rollout.server_timeout_s = {timeout:g} s")
                    + f"; its log: {log_path}:\n{log_tail(log_path)}")
            store.set(server_key(index), url)
            log(f"generator server {index} serving at {url} (launch ranks {placement.rank}-"
                f"{placement.rank + placement.generator_tp - 1}; log {log_path})")
        while True:
            if process is not None and process.poll() is not None:
                raise ServingError(f"generator server {placement.server_index} exited with {process.returncode} "
                                   f"during the job; its log: {log_path}:\n{log_tail(log_path)}")
            try:
                if store.check([DONE_KEY]):
                    store.set(left_key(placement.rank), "1")
                    return
            except RuntimeError:  # (torch's DistError) the store went with the trainers' rank 0
                raise ServingError("the trainers' rendezvous store is gone: trainer rank 0 ended without "
                                   "finishing the job (its error is above)") from None
            time.sleep(1)
    finally:
        if process is not None:
            stop_child_server(process)


def log_tail(path: str, lines: int = 30) -> str:
    """The log's last lines, after its last error line when that is further up (vLLM's engine
    logs the cause, then the API process its own traceback)."""
    with open(path, errors="replace") as f:
        log = f.readlines()
    errors = [line for line in log[:-lines] if "Error: " in line]
    return (f"... {errors[-1].strip()}\n...\n" if errors else "") + "".join(log[-lines:])


def generator_ranks_client(cfg: Config):
    """A trainer rank's generator under placement disaggregated: the generating ranks' servers
    (their URLs from the launch's store); trainer rank 0 says the job is done when it closes."""
    from megagrpo.rollout.servers import ServerGenerator

    placement = Placement.from_env(cfg)
    store = launch_store(cfg.rollout.server_timeout_s)
    is_main = torch.distributed.get_rank() == 0
    urls = server_urls(store, placement, cfg.rollout.server_timeout_s,
                       log=lambda line: print(f"[megagrpo] {line}", flush=True) if is_main else None)
    release = (lambda: release_generating_ranks(store, placement)) if is_main else None
    return ServerGenerator(cfg, urls, on_close=release)
