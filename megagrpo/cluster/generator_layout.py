"""The generator's layout: where it runs and over how many ranks each copy is sharded,
resolved from the config by one function, and the layouts refused (cluster/layout.py calls
the rules before anything starts). Nothing here writes into the config: everything that needs
the generator's tp asks generator_layout(cfg).

    layout = generator_layout(cfg)
    layout.generator_tp      # ranks per vLLM engine or server (rollout.tensor_parallel_size)
    layout.in_job            # an engine inside the trainer ranks (not servers, not generating ranks)
    layout.ranks_per_group   # the topology's generator groups: generator_tp in the job, else 1
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlparse

from megagrpo.config.schema import Config, require


@dataclass(frozen=True)
class GeneratorLayout:
    generator_tp: int   # ranks per generator: one vLLM engine, or one server
    in_job: bool        # the trainer ranks hold the engines (rollout.placement colocated, no rollout.servers)

    @property
    def ranks_per_group(self) -> int:
        """The trainer ranks that share one engine (the topology's generator groups): 1 when
        servers generate (rollout.servers, or the generating ranks: their tp is theirs)."""
        return self.generator_tp if self.in_job else 1


def generator_layout(cfg: Config) -> GeneratorLayout:
    """rollout.tensor_parallel_size, or its default: the trainer's tp for a vLLM engine in the
    job without pipelines, else 1."""
    r, p = cfg.rollout, cfg.parallel
    in_job = not r.servers and r.placement != "disaggregated"
    if r.tensor_parallel_size is not None:
        tp = r.tensor_parallel_size
    elif in_job and p.pipeline_parallel_size == 1 and r.engine == "vllm":
        tp = p.tensor_parallel_size
    else:
        tp = 1
    return GeneratorLayout(tp, in_job)


def check_generator_layout(cfg: Config, world: Optional[str]) -> GeneratorLayout:
    """The generator's layout (generator_layout), and the layouts refused.
    vLLM's external launcher forms its tp groups from consecutive ranks, so a generator group
    lies inside one trainer tp group or spans whole ones (docs/parallelism.md)."""
    r, tp, pp = cfg.rollout, cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size
    require(r.max_staleness >= 0, f"rollout.max_staleness={r.max_staleness} must be >= 0")
    require(not r.partial_rollouts or r.max_staleness > 0, "rollout.partial_rollouts continues the batches "
            "sampled ahead across a weight update: set rollout.max_staleness >= 1 (with rollout.servers or "
            "rollout.placement=disaggregated), or leave it off")
    if r.max_staleness:
        require(bool(r.servers) or r.placement == "disaggregated", f"rollout.max_staleness={r.max_staleness} "
                "samples ahead on servers (an engine inside the job samples between the steps): set "
                "rollout.servers or rollout.placement=disaggregated, or leave it 0")
        require(not cfg.grpo.dynamic_sampling, f"rollout.max_staleness={r.max_staleness} with "
                "grpo.dynamic_sampling: the rounds of a step depend on its rewards, so they cannot be sampled "
                "ahead; use one or the other")
    layout = generator_layout(cfg)
    if r.servers:
        check_servers(cfg)
        return layout
    if r.placement == "disaggregated":
        return layout  # the servers' layout: check_disaggregated
    t = layout.generator_tp
    key = f"rollout.tensor_parallel_size={t}"
    require(t >= 1, f"{key} must be >= 1")
    if t == 1:
        return layout
    require(r.engine == "vllm", f"{key} needs rollout.engine=vllm (transformers generate runs whole on each rank)")
    require(pp == 1, f"{key} with parallel.pipeline_parallel_size={pp}: under pipeline parallelism only "
            "the first stage's first rank receives whole weights to generate with; use 1")
    require(t % tp == 0 or tp % t == 0, f"{key} with parallel.tensor_parallel_size={tp}: a generator "
            f"group ({t} consecutive ranks) must lie inside one trainer tp group or span whole ones; "
            f"use a divisor or a multiple of {tp}")
    require(world is None or int(world) % t == 0,
            f"{key}: world size {world} is not divisible by it; launch a multiple of {t} ranks")
    check_engine_heads(cfg, key, t)
    return layout


def check_engine_heads(cfg: Config, key: str, t: int) -> None:
    """A vLLM engine of tp t splits the model's heads: t must divide them (key-value heads: one
    divides the other)."""
    model_config = os.path.join(cfg.model.name_or_path, "config.json")
    if os.path.isfile(model_config):
        with open(model_config) as f:
            model = json.load(f)
        heads = model.get("num_attention_heads")
        kv_heads = model.get("num_key_value_heads", heads)
        require(heads is None or heads % t == 0,
                f"{key} does not divide the model's {heads} attention heads; use a divisor of {heads}")
        require(kv_heads is None or kv_heads % t == 0 or t % kv_heads == 0,
                f"{key} and the model's {kv_heads} key-value heads: one must divide the other")


def check_disaggregated(cfg: Config, world: Optional[str]) -> Optional[str]:
    """rollout.placement=disaggregated: the generating ranks (rollout.ranks, whole servers of
    rollout.tensor_parallel_size) and a trainer left; returns the trainers' world size (None
    when the launch's is not known)."""
    r = cfg.rollout
    require(not r.servers, "rollout.placement=disaggregated starts its own servers on rollout.ranks of the launch: "
            "remove rollout.servers (or use them with placement colocated, the default)")
    require(r.engine == "vllm", "rollout.placement=disaggregated runs vLLM servers: remove rollout.engine=hf")
    require(r.ranks >= 1, f"rollout.placement=disaggregated needs rollout.ranks >= 1 (now {r.ranks}): how many of "
            "the launch's ranks generate, e.g. rollout.ranks=1")
    t = generator_layout(cfg).generator_tp
    require(t >= 1, f"rollout.tensor_parallel_size={t} must be >= 1")
    require(r.ranks % t == 0, f"rollout.ranks={r.ranks} is not a whole number of servers of "
            f"rollout.tensor_parallel_size={t} ranks each: use a multiple of {t}")
    check_engine_heads(cfg, f"rollout.tensor_parallel_size={t}", t)
    require(r.server_timeout_s > 0, f"rollout.server_timeout_s={r.server_timeout_s} must be > 0")
    require(r.server_retries >= 0, f"rollout.server_retries={r.server_retries} must be >= 0")
    if world is None:
        return None
    require(int(world) > r.ranks, f"rollout.ranks={r.ranks} leaves no rank to train in a launch of {world}: "
            f"launch more ranks (at least {r.ranks + 1}) or generate on fewer")
    return str(int(world) - r.ranks)


def check_servers(cfg: Config) -> None:
    """rollout.servers: URLs, and no engine of the job's own to lay out (rollout/servers.py)."""
    r = cfg.rollout
    for i, url in enumerate(r.servers):
        parsed = urlparse(str(url))
        require(parsed.scheme in ("http", "https") and parsed.hostname,
                f"rollout.servers[{i}]: '{url}' is not a server URL; write http://HOST:PORT (e.g. http://node7:8000)")
    require(r.engine == "vllm", "rollout.servers are vLLM servers: remove rollout.engine=hf (or the servers)")
    require(r.tensor_parallel_size in (None, 1), f"rollout.tensor_parallel_size={r.tensor_parallel_size} lays out "
            "an engine inside the job, and rollout.servers generate instead: shard a server with its own "
            "--tensor-parallel-size, and leave this key out")
    require(r.server_timeout_s > 0, f"rollout.server_timeout_s={r.server_timeout_s} must be > 0")
    require(r.server_retries >= 0, f"rollout.server_retries={r.server_retries} must be >= 0")
