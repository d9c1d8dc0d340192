"""Probe for tests/test_gpu_checks.py's collectives check: one torchrun rank runs all_reduce,
all_gather and broadcast over the backend the trainer would use here (NCCL on CUDA tensors
where torch sees a GPU, gloo on CPU tensors otherwise), then a timed all_reduce of 256 MiB (64
MiB on CPU), and writes collectives_rank<r>.json to --out: the values each collective returned
(the test checks them), the backend, and the seconds.

    torchrun --nproc_per_node 2 tests/helpers/collectives_probe.py --out DIR
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    summed = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(summed)
    parts = [torch.empty(4, device=device) for _ in range(world)]
    dist.all_gather(parts, torch.full((4,), float(rank), device=device))
    sent = torch.full((4,), 42.0 if rank == 0 else -1.0, device=device)
    dist.broadcast(sent, src=0)

    big = torch.ones((64 if cuda else 16) * 2**20, device=device)  # float32: 256 MiB, 64 MiB
    dist.all_reduce(big)  # warm-up
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    dist.all_reduce(big)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result = {"rank": rank, "world": world, "backend": dist.get_backend(), "device": str(device),
              "all_reduce": sorted(set(summed.tolist())), "all_gather": [t.tolist() for t in parts],
              "broadcast": sent.tolist(), "big_all_reduce": sorted(set(big[:: 2**16].tolist())),
              "big_bytes": big.numel() * big.element_size(), "big_all_reduce_s": seconds,
              "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"collectives_rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
