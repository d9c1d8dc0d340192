"""Starting the job's process group, and the small collectives the trainer uses (all_reduce,
all_gather_1d). DeepSpeed compiles its CPU shared-memory all-reduce op as the group starts; its
build folder and build locks: cluster/op_builds.py. That op's /dev/shm buffers are never
unlinked (each run would leak ~70 MB of RAM per rank): release_shm_allreduce_name unlinks them.
These and the other upstream limits megagrpo works around: docs/upstream-issues.md.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from megagrpo.cluster.op_builds import prepare_op_build
from megagrpo.cluster.topology import Topology
from megagrpo.console import dropping_known_prints


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it), for a launcher's master port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_minutes: float = 30.0, tp_size: int = 1, pp_size: int = 1,
                     generator_tp: int = 1, sp_size: int = 1) -> Topology:
    """Create the job's process group (one plain process gets a world of one; with generating
    ranks apart, the trainers' world: cluster/placement.py)."""
    import deepspeed

    launch_env()
    local_rank = os.environ["LOCAL_RANK"]
    prepare_op_build(clear_lock=local_rank == "0")
    with dropping_known_prints():  # DeepSpeed prints "... built successfully" on every rank
        deepspeed.init_distributed(timeout=datetime.timedelta(minutes=timeout_minutes),
                                   distributed_port=int(os.environ.get("MASTER_PORT", "29500")))
    release_shm_allreduce_name()
    topology = Topology.from_env(tp_size, pp_size, generator_tp, sp_size).with_groups()
    if torch.cuda.is_available():
        torch.cuda.set_device(topology.local_rank)
    return topology


def launch_env() -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in the environment, whichever
    launcher started this process: deepspeed and torchrun set them; srun's are mapped (its
    MASTER_ADDR/PORT come from our script); under mpirun DeepSpeed's MPI discovery (mpi4py)
    finds them and rank 0's address; a plain process is a world of one."""
    if "OMPI_COMM_WORLD_RANK" in os.environ and "RANK" not in os.environ:
        from deepspeed.comm.comm import mpi_discovery
        mpi_discovery(distributed_port=int(os.environ.get("MASTER_PORT", "29500")), verbose=False)
    if "RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                          LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")


def release_shm_allreduce_name() -> None:
    """Unlink this rank's /dev/shm all-reduce buffer name once every rank has mapped it.

    DeepSpeed's CPU shared-memory all-reduce creates a ~70 MB /dev/shm file per rank and never
    unlinks it, so each run would leak RAM until reboot. The mappings stay valid after unlinking.
    """
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if torch.cuda.is_available() or not addr or not port:
        return
    dist.barrier()
    name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{dist.get_rank()}"
    if os.path.exists(name):
        os.unlink(name)


def _comm_device() -> torch.device:
    """NCCL serves only CUDA tensors; gloo serves CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def all_gather_1d(values: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate equal-length 1-D tensors from every rank of `group` (default: all), in rank
    order; returns on CPU."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return values.cpu()
    local = values.contiguous().to(_comm_device())
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts).cpu()


def all_reduce(values: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """Element-wise sum/max/min over the ranks of `group` (default: all); returns on CPU."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        values = values.to(_comm_device(), copy=True)
        dist.all_reduce(values, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                    "min": dist.ReduceOp.MIN}[op], group=group)
    return values.cpu()
