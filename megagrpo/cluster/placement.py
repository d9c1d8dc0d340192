"""Which ranks of a launch train and which generate (rollout.placement), and how the two sides
find each other.

Co-located (the default), every rank trains and generates. Disaggregated, the last
rollout.ranks ranks of the launch generate: each block of rollout.tensor_parallel_size of them
runs one `vllm serve` of the policy (rollout/serving.py), and the first ranks form the torch
world alone (WORLD_SIZE is the launch's less the generating ranks), so DeepSpeed, the topology
and every collective see only the trainers. The two sides meet in the launch's rendezvous store
(MASTER_ADDR:MASTER_PORT, held by trainer rank 0 or by torchrun's agent): each server publishes
its URL there, the trainers read them and generate through them as through rollout.servers, and
trainer rank 0 says there when the job is done.

    launch_env()                       # (cluster/distributed.py) RANK, WORLD_SIZE, ... from any launcher
    placement = Placement.from_env(cfg)
    if not placement.trains: serve(cfg, placement)  # until the trainers are done
    placement.enter_trainer_world()    # then init_distributed: the trainers' world
"""
from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlparse

from megagrpo.config.schema import Config, require

DONE_KEY = "megagrpo/trainers_done"
LAUNCH_WORLD = "MEGAGRPO_LAUNCH_WORLD_SIZE"  # a trainer rank's WORLD_SIZE is the trainers'


def server_key(index: int) -> str:
    """Where server `index` publishes its URL."""
    return f"megagrpo/generator_server/{index}"


def left_key(rank: int) -> str:
    """Where generating rank `rank` says it saw DONE_KEY (trainer rank 0, which may hold the
    store, waits for every one before it leaves)."""
    return f"megagrpo/generator_left/{rank}"


@dataclass(frozen=True)
class Placement:
    rank: int                  # in the launch
    world_size: int            # of the launch
    generating_ranks: int = 0  # the launch's last ranks, which only generate
    server_tp: int = 1         # ranks per server (rollout.tensor_parallel_size)

    @classmethod
    def from_env(cls, cfg: Config) -> "Placement":
        r = cfg.rollout
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get(LAUNCH_WORLD, os.environ.get("WORLD_SIZE", "1")))
        if r.placement != "disaggregated":
            return cls(rank, world)
        return cls(rank, world, r.ranks, r.tensor_parallel_size or 1)

    @property
    def trainer_world_size(self) -> int:
        return self.world_size - self.generating_ranks

    @property
    def trains(self) -> bool:
        return self.rank < self.trainer_world_size

    @property
    def server_count(self) -> int:
        return self.generating_ranks // self.server_tp

    @property
    def server_index(self) -> int:
        """The server this generating rank belongs to."""
        return (self.rank - self.trainer_world_size) // self.server_tp

    @property
    def starts_server(self) -> bool:
        """Whether this generating rank starts its block's server (the others lend it their devices)."""
        return not self.trains and (self.rank - self.trainer_world_size) % self.server_tp == 0

    def enter_trainer_world(self) -> None:
        """A trainer rank: the torch world is the trainers' (and, on one node, so are the ranks
        DeepSpeed's shared-memory all-reduce counts as local)."""
        if not self.generating_ranks:
            return
        if os.environ.get("LOCAL_SIZE") == str(self.world_size):
            os.environ["LOCAL_SIZE"] = str(self.trainer_world_size)
        os.environ.update({"WORLD_SIZE": str(self.trainer_world_size), LAUNCH_WORLD: str(self.world_size)})


def engine_tp(cfg: Config) -> int:
    """Ranks per vLLM engine inside the job (the topology's generator groups): 1 when servers
    generate (rollout.servers, or placement disaggregated: their tp is theirs)."""
    if cfg.rollout.servers or cfg.rollout.placement == "disaggregated":
        return 1
    return cfg.rollout.tensor_parallel_size


def launch_store(timeout_s: float):
    """A client of the launch's rendezvous store (MASTER_ADDR:MASTER_PORT); waits up to
    timeout_s for it to be up."""
    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def server_urls(store, placement: Placement, timeout_s: float, log=print) -> list[str]:
    """The URLs the generating ranks published, in server order (each waited for up to
    timeout_s: a server's start takes a while)."""
    keys = [server_key(i) for i in range(placement.server_count)]
    deadline = time.time() + timeout_s
    said = False
    while not store.check(keys):
        if time.time() > deadline:
            missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
            first = placement.trainer_world_size + int(missing[0]) * placement.server_tp
            raise RuntimeError(f"generator server(s) {', '.join(missing)} did not start within "
                               f"rollout.server_timeout_s = {timeout_s:g} s (server {missing[0]} is launch rank "
                               f"{first}'s: its log is vllm_server_{missing[0]}.log in output_dir on its node)")
        if not said:
            log(f"waiting for {placement.server_count} generator server(s) on launch ranks "
                f"{placement.trainer_world_size}-{placement.world_size - 1}")
            said = True
        time.sleep(0.5)
    return [store.get(k).decode() for k in keys]


def release_generating_ranks(store, placement: Placement, timeout_s: float = 60.0) -> None:
    """Trainer rank 0 at the end of the job: tell the generating ranks, and wait until each has
    seen it (the store may live in this process)."""
    store.set(DONE_KEY, "1")
    store.wait([left_key(r) for r in range(placement.trainer_world_size, placement.world_size)],
               datetime.timedelta(seconds=timeout_s))


# ---- the generator layout's rules (cluster/layout.py calls them before anything starts) ----

def check_generator_layout(cfg: Config, world: Optional[str]) -> None:
    """rollout.tensor_parallel_size: its default (the trainer's tp) and the layouts refused.
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
    if r.servers:
        check_servers(cfg)
        return
    if r.placement == "disaggregated":
        return  # the servers' layout: check_disaggregated
    if r.tensor_parallel_size is None:
        r.tensor_parallel_size = tp if pp == 1 and r.engine == "vllm" else 1
    t = r.tensor_parallel_size
    key = f"rollout.tensor_parallel_size={t}"
    require(t >= 1, f"{key} must be >= 1")
    if t == 1:
        return
    require(r.engine == "vllm", f"{key} needs rollout.engine=vllm (transformers generate runs whole on each rank)")
    require(pp == 1, f"{key} with parallel.pipeline_parallel_size={pp}: under pipeline parallelism only "
            "the first stage's first rank receives whole weights to generate with; use 1")
    require(t % tp == 0 or tp % t == 0, f"{key} with parallel.tensor_parallel_size={tp}: a generator "
            f"group ({t} consecutive ranks) must lie inside one trainer tp group or span whole ones; "
            f"use a divisor or a multiple of {tp}")
    require(world is None or int(world) % t == 0,
            f"{key}: world size {world} is not divisible by it; launch a multiple of {t} ranks")
    check_engine_heads(cfg, key, t)


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
    t = r.tensor_parallel_size = r.tensor_parallel_size or 1
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
    r.tensor_parallel_size = 1
    require(r.server_timeout_s > 0, f"rollout.server_timeout_s={r.server_timeout_s} must be > 0")
    require(r.server_retries >= 0, f"rollout.server_retries={r.server_retries} must be >= 0")
