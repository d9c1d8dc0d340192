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
import os
import time
from dataclasses import dataclass

from megagrpo.cluster.generator_layout import generator_layout
from megagrpo.config.schema import Config

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
    generator_tp: int = 1      # ranks per server (rollout.tensor_parallel_size)

    @classmethod
    def from_env(cls, cfg: Config) -> "Placement":
        r = cfg.rollout
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get(LAUNCH_WORLD, os.environ.get("WORLD_SIZE", "1")))
        if r.placement != "disaggregated":
            return cls(rank, world)
        return cls(rank, world, r.ranks, generator_layout(cfg).generator_tp)

    @property
    def trainer_world_size(self) -> int:
        return self.world_size - self.generating_ranks

    @property
    def trains(self) -> bool:
        return self.rank < self.trainer_world_size

    @property
    def server_count(self) -> int:
        return self.generating_ranks // self.generator_tp

    @property
    def server_index(self) -> int:
        """The server this generating rank belongs to."""
        return (self.rank - self.trainer_world_size) // self.generator_tp

    @property
    def starts_server(self) -> bool:
        """Whether this generating rank starts its block's server (the others lend it their devices)."""
        return not self.trains and (self.rank - self.trainer_world_size) % self.generator_tp == 0

    def enter_trainer_world(self) -> None:
        """A trainer rank: the torch world is the trainers' (and, on one node, so are the ranks
        DeepSpeed's shared-memory all-reduce counts as local)."""
        if not self.generating_ranks:
            return
        if os.environ.get("LOCAL_SIZE") == str(self.world_size):
            os.environ["LOCAL_SIZE"] = str(self.trainer_world_size)
        os.environ.update({"WORLD_SIZE": str(self.trainer_world_size), LAUNCH_WORLD: str(self.world_size)})


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
            first = placement.trainer_world_size + int(missing[0]) * placement.generator_tp
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
