"""Generation by `vllm serve` processes started apart from the job (rollout.servers).

The servers sample and score through vLLM's OpenAI completions route (prompts and completions
as token ids, the sampler's log-probs, one seeded request per prompt), so every rank asks for
its own prompts at once and a server batches all the ranks' requests; a prompt's samples depend
only on its seed and the weights, as in the co-located engine (tests/test_rollout_servers.py
shows the same completions, token for token). New weights go from trainer rank 0 to every
server's workers through vLLM's weight-transfer API (its RL routes, VLLM_SERVER_DEV_MODE=1)
with megagrpo's gloo backend (weight_transfer.py): one transfer group spans rank 0 and the
workers of all the servers, and each update is named by its number. How to start a server:
docs/async.md.

    generator = ServerGenerator(cfg, ["http://node7:8000"])   # waits for /health, checks the model
    groups = generator.generate(prompt_ids, n=8, seeds=seeds)  # as VLLMGenerator.generate
    generator.load_weights(stream)                              # every rank: rank 0 sends the stream
"""
from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable
from urllib.parse import urlparse

import requests
import torch

from megagrpo.config.schema import Config, max_sequence_length
from megagrpo.policy.batch import Completion


class ServerError(RuntimeError):
    """A vLLM server did not answer as it must; the message names its URL and the fix."""


class Server:
    """One `vllm serve`: its URL, its model's name and context length, its weight-transfer workers."""

    def __init__(self, url: str, timeout_s: float, retries: int, settings: str = "rollout.server_"):
        """settings: the prefix of the config keys that set timeout_s and retries, as errors name them."""
        self.url, self.timeout_s, self.retries, self.settings = url.rstrip("/"), timeout_s, retries, settings

    def wait_until_ready(self, log=print, takes_weights: bool = True) -> None:
        """Wait for /health (a server may still be starting); then read what it serves.
        takes_weights: its weight-transfer routes must answer (a generator's; a teacher's not)."""
        deadline = time.time() + self.timeout_s
        said = False
        while not self.healthy():
            if time.time() > deadline:
                raise ServerError(f"vLLM server {self.url} did not answer /health within {self.settings}timeout_s "
                                  f"= {self.timeout_s:g} s: is it started, and reachable from this node?")
            if not said:
                log(f"waiting for the vLLM server {self.url}")
                said = True
            time.sleep(1)
        model = self.get("v1/models")["data"][0]
        self.model, self.max_model_len = model["id"], model.get("max_model_len")
        if not takes_weights:
            return
        try:
            self.workers = self.get("get_world_size")["world_size"]
        except ServerError as e:
            raise ServerError(f"{e}; start the server with VLLM_SERVER_DEV_MODE=1 in its environment (its weight-"
                              "transfer routes; docs/async.md)") from None

    def healthy(self) -> bool:
        """Whether /health answers 200 now."""
        try:
            return requests.get(f"{self.url}/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def get(self, path: str) -> dict:
        return self._call(requests.get, path, None)

    def post(self, path: str, body: dict | None = None, retry: bool = True) -> dict:
        return self._call(requests.post, path, body, retry)

    def _call(self, method, path: str, body: dict | None, retry: bool = True) -> dict:
        """One request (its JSON reply), tried again (rollout.server_retries) when the server
        does not answer or answers 5xx; a 4xx (a request it refuses) is not, nor a step of a
        weight update (retry=False: half an update cannot be sent again)."""
        error = None
        tries = 1 + self.retries if retry else 1
        for attempt in range(tries):
            if attempt:
                time.sleep(min(2 ** attempt, 10))
            try:
                with method(f"{self.url}/{path}", json=body, timeout=self.timeout_s) as reply:
                    if reply.status_code < 400:
                        return reply.json() if reply.content else {}
                    error = f"HTTP {reply.status_code}: {reply.text[:500]}"
            except requests.RequestException as e:
                error = f"{type(e).__name__}: {e}"
                continue
            if reply.status_code < 500:
                break
        raise ServerError(f"vLLM server {self.url} failed /{path} ({tries} tries, "
                          f"{self.settings}timeout_s {self.timeout_s:g} s each): {error}")

    def prompt_logprobs(self, ids: list[int], start: int, temperature: float) -> list[float]:
        """The log-probs of ids[start:] given what precedes each (the server's prompt_logprobs)."""
        reply = self.post("v1/completions", {"model": self.model, "prompt": ids, "max_tokens": 1,
                                             "temperature": temperature, "prompt_logprobs": 0})
        entries = reply["choices"][0]["prompt_logprobs"]
        return [entries[k][str(ids[k])]["logprob"] for k in range(start, len(ids))]

    def generate_tokens(self, body: dict) -> list[Completion]:
        """A request to vLLM's token route, /inference/v1/generate (rollout.partial_rollouts):
        its choices, each token with the version of the weights that sampled it, as the server
        itself tracks them (the label of the weight update it was sampled after: its training
        step). A request paused through an update gets tokens of two versions."""
        reply = self.post("inference/v1/generate", body)
        completions = []
        for choice in sorted(reply["choices"], key=lambda c: c["index"]):
            versions = [int(span["version"]) for span in choice["weight_versions"] or []
                        for _ in range(span["start"], span["end"])]
            completions.append(Completion(choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]],
                                          choice["finish_reason"] == "length", versions=versions))
        return completions

    def check_token_route(self) -> None:
        """The token route answers (it is off unless the server runs with --enable-scale-out)."""
        try:
            reply = requests.post(f"{self.url}/inference/v1/generate", json={}, timeout=self.timeout_s)
        except requests.RequestException as e:
            raise ServerError(f"vLLM server {self.url} did not answer /inference/v1/generate: {e}") from None
        if reply.status_code in (403, 404):  # (enabled, an empty request is a 400 or 422)
            raise ServerError(f"vLLM server {self.url} does not serve /inference/v1/generate (HTTP "
                              f"{reply.status_code}), which rollout.partial_rollouts reads each token's weight "
                              "version from: restart it with --enable-scale-out")


class ServerFleet:
    """vLLM's weight-sync client protocol (the four calls of HTTPVLLMWeightSyncClient) over
    several servers at once: each server's workers join the one transfer group after those of
    the servers before it."""

    def __init__(self, servers: list[Server], pause_mode: str = "wait"):
        """pause_mode: wait (requests in flight finish before the update) or keep (they stop
        where they are and go on with the new weights: rollout.partial_rollouts)."""
        self.servers, self.pause_mode = servers, pause_mode
        self.world_size = sum(s.workers for s in servers)

    def _each(self, call) -> None:
        with ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
            for done in [pool.submit(call, server) for server in self.servers]:
                done.result()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        offsets, first = [], init_info["rank_offset"]
        for server in self.servers:
            offsets.append(first)
            first += server.workers
        self._each(lambda s: s.post("init_weight_transfer_engine", {
            "init_info": {**init_info, "rank_offset": offsets[self.servers.index(s)]}}, retry=False))

    def start_weight_update(self) -> None:
        # paused first (no forward pass runs: one during vLLM's layerwise reload fails the engine,
        # "Tensor on device cpu is not on the expected device meta"); new requests wait
        self._each(lambda s: (s.post(f"pause?mode={self.pause_mode}"), s.post("start_weight_update", retry=False)))

    def update_weights(self, update_info: dict) -> None:
        self._each(lambda s: s.post("update_weights", {"update_info": update_info}, retry=False))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        # and the prefix cache, whose blocks hold keys and values of the previous weights
        self._each(lambda s: (s.post("finish_weight_update", {"weight_version": weight_version}, retry=False),
                              s.post("reset_prefix_cache"), s.post("resume")))

    def shutdown_weight_transfer_engine(self) -> None:
        self._each(lambda s: s.post("shutdown_weight_transfer_engine"))


def address_towards(url: str) -> str:
    """This node's address on the route to the server of `url` (where its workers reach the
    transfer group's sender)."""
    parsed = urlparse(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(parsed.hostname), parsed.port or 80))  # no packet is sent
        return s.getsockname()[0]


class ServerGenerator:
    """The generator interface of rollout/generators.py over `vllm serve` processes."""

    def __init__(self, cfg: Config, urls: list[str], log=lambda line: print(f"[megagrpo] {line}", flush=True),
                 on_close=None):
        """on_close: called last by close() (the generating ranks' release)."""
        self.cfg, self.on_close = cfg.rollout, on_close
        r = cfg.rollout
        self.servers = [Server(url, r.server_timeout_s, r.server_retries) for url in urls]
        for server in self.servers:
            server.wait_until_ready(log)
            needed = r.max_model_len or max_sequence_length(cfg)
            if server.max_model_len is not None and server.max_model_len < needed:
                raise ServerError(f"vLLM server {server.url} serves {server.max_model_len} tokens of context, and this "
                                  f"run needs {needed} (data.max_prompt_length + rollout.max_new_tokens): restart "
                                  f"it with --max-model-len {needed}")
        self.is_sender = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if self.is_sender:
            log(f"generation: vLLM server(s) {', '.join(s.url for s in self.servers)} "
                f"({sum(s.workers for s in self.servers)} workers); weights sent from rank 0 after every step; "
                f"max staleness {r.max_staleness}")
        self.sender = None  # the transfer group's sending end, made at the first update
        self.partial = r.partial_rollouts
        if self.partial:
            for server in self.servers:
                server.check_token_route()
        self.pool = ThreadPoolExecutor(max_workers=64)

    def generate(self, prompt_ids: list[list[int]], n: int, seeds: list[int],
                 greedy: bool = False, max_tokens: list[int] | None = None) -> list[list[Completion]]:
        """n samples per prompt, one request per prompt (all at once, spread over the servers);
        prompt i's samples depend only on seeds[i] and the weights."""
        r = self.cfg

        def sample(i: int) -> list[Completion]:
            server = self.servers[seeds[i] % len(self.servers)]
            body = {
                "model": server.model, "prompt": prompt_ids[i], "n": n, "seed": seeds[i],
                "temperature": 0.0 if greedy else r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                "max_tokens": max_tokens[i] if max_tokens else r.max_new_tokens, "stop": list(r.stop) or None,
                "logprobs": 0, "return_token_ids": True,
                # explicit, so that a server's defaults from its model folder (generation_config.json:
                # e.g. Qwen2.5-Instruct's repetition_penalty 1.05) do not change what is sampled
                "repetition_penalty": 1.0, "min_p": 0.0}
            if self.partial:  # vLLM's token route: each token's weight version
                return server.generate_tokens({
                    "model": body["model"], "token_ids": body["prompt"], "sampling_params": {
                        k: v for k, v in body.items() if k not in ("model", "prompt", "return_token_ids")}})
            reply = server.post("v1/completions", body)
            choices = sorted(reply["choices"], key=lambda c: c["index"])
            return [Completion(token_ids=c["token_ids"], logprobs=c["logprobs"]["token_logprobs"],
                               truncated=c["finish_reason"] == "length") for c in choices]
        return list(self.pool.map(sample, range(len(prompt_ids))))

    def logprobs(self, requests: list[tuple[list[int], int]]) -> list[list[float]]:
        """Per (token_ids, prompt_len): the log-probs of token_ids[prompt_len:] given what
        precedes them (the servers' prompt_logprobs)."""
        def one(i: int) -> list[float]:
            ids, start = requests[i]
            return self.servers[i % len(self.servers)].prompt_logprobs(ids, start, temperature=0.0)
        return list(self.pool.map(one, range(len(requests))))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False,
                     step: int = 0) -> None:
        """Every rank that holds the stream runs it (its gathers are collective); rank 0 sends it
        to every server's workers, which load each tensor as it arrives (a partial stream, a
        LoRA policy's changed layers, leaves the others as they are). The servers name the new
        weights by `step`, the training steps in them."""
        from megagrpo.rollout.weight_transfer import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine

        if not self.is_sender:
            for _ in named_tensors:
                pass
            return
        if self.sender is None:
            from megagrpo.cluster.distributed import free_port
            fleet = ServerFleet(self.servers, "keep" if self.partial else "wait")
            self.sender = GlooTrainerWeightTransferEngine.trainer_init(
                GlooTrainerInitInfo(address_towards(self.servers[0].url), free_port(),
                                    world_size=1 + fleet.world_size, timeout_s=self.cfg.server_timeout_s, rank=0),
                client=fleet)
        self.sender.send_stream(named_tensors, weight_version=str(step))

    def sleep(self) -> None:
        pass  # the servers' memory is theirs

    def wake_up(self, tags: tuple[str, ...] = ()) -> None:
        pass

    def close(self) -> None:
        """Leave the transfer group (a later job makes its own)."""
        if self.sender is not None:
            self.sender.client.shutdown_weight_transfer_engine()
            self.sender = None
        self.pool.shutdown(wait=False)
        if self.on_close is not None:
            self.on_close()
