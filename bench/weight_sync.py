"""Weight-sync cost: the trainer's weights into the co-located vLLM engine in place, each part
measured on its own, side by side in one run:

    python bench/weight_sync.py --model runs/tiny/model                      # one rank
    torchrun --nproc_per_node 2 bench/weight_sync.py --model /tmp/q05-4l     # ZeRO-3 over 2 ranks

Per model, best of --repeats, the rows interleaved in each repeat:
  memcpy         the same bytes copied into preallocated tensors: the floor of any sync
  gather         the trainer's stream alone (megagrpo's policy: ZeRO-3 gathers bucket by bucket),
                 nothing loaded
  vllm load      vLLM's in-place reload (`reload_weights`) of the same tensors, already whole in
                 memory: what vLLM itself needs
  vllm load, as upstream   the same with the input embedding prepacked for a GEMM on every
                 reload, as vLLM 0.32 does on CPU (megagrpo skips it: rollout/generators.py)
  sync           what the trainer runs: the gathers streaming into the reload
On CPU one more reload runs under cProfile, split into the kernels' prepack (oneDNN), tensor
copies and the rest. Prints a table; rank 0 writes JSON (bench/results/weight_sync.json).
"""
import argparse
import cProfile
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megagrpo.cluster.distributed import init_distributed  # noqa: E402
from megagrpo.config.loading import read_config  # noqa: E402
from megagrpo.console import quiet_library_output  # noqa: E402
from megagrpo.policy import build_policy  # noqa: E402
from megagrpo.rollout.generators import VLLMGenerator, _input_embeddings_skip_gemm_prepack  # noqa: E402
from megagrpo.rollout.weight_sync import sync_weights  # noqa: E402


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def prepack_input_embeddings(worker) -> None:
    """Put back vLLM's own method on the input embeddings (a GEMM prepack at every load)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    for layer in worker.model_runner.get_model().modules():
        if type(getattr(layer, "quant_method", None)).__name__ == "LookupOnly":
            layer.quant_method = UnquantizedEmbeddingMethod()


def reload_split(engine, tensors) -> dict:
    """Seconds of one reload by what they were spent on (cProfile's own times)."""
    profile = cProfile.Profile()
    profile.enable()
    engine.load_weights(iter(tensors))
    profile.disable()
    stats = pstats.Stats(profile).stats  # {(file, line, name): (calls, ncalls, own, cumulative, callers)}
    total = sum(own for _, _, own, _, _ in stats.values())
    prepack = sum(own for (_, _, name), (_, _, own, _, _) in stats.items()
                  if "onednn" in name or "convert_weight_packed" in name or "dnnl" in name)
    copies = sum(own for (_, _, name), (_, _, own, _, _) in stats.items() if "copy_" in name)
    return {"prepack_s": prepack, "copies_s": copies, "rest_s": total - prepack - copies}


def measure(path: str, repeats: int, topology, overrides: list[str]) -> dict:
    cfg = read_config("configs/tiny_arith.yaml", [
        f"model.name_or_path={path}", "model.dtype=float32", "grpo.kl_coef=0",
        "grpo.per_device_train_batch_size=8", "deepspeed=configs/ds_zero3.json", *overrides])
    policy = build_policy(cfg, topology, total_steps=1)
    engine = VLLMGenerator(cfg, path, seed=0)
    whole = [(name, tensor.clone()) for name, tensor in policy.full_tensors()]  # every rank gathers
    nbytes = sum(t.numel() * t.element_size() for _, t in whole)
    targets = [torch.empty_like(t) for _, t in whole]

    def memcpy():
        for dst, (_, src) in zip(targets, whole):
            dst.copy_(src)

    def as_upstream() -> float:
        engine.llm.collective_rpc(prepack_input_embeddings)
        try:
            return timed(lambda: engine.load_weights(iter(whole)))
        finally:
            engine.llm.collective_rpc(_input_embeddings_skip_gemm_prepack)

    rows = {"memcpy": lambda: timed(memcpy), "gather": lambda: timed(lambda: [None for _ in policy.full_tensors()]),
            "vllm load": lambda: timed(lambda: engine.load_weights(iter(whole))), "vllm load, as upstream": as_upstream,
            "sync": lambda: timed(lambda: sync_weights(policy.full_tensors(), engine))}  # each: its seconds
    best = {name: float("inf") for name in rows}
    for _ in range(repeats):
        for name, seconds in rows.items():
            best[name] = min(best[name], seconds())
    split = reload_split(engine, whole) if not torch.cuda.is_available() else {}
    return {"model": path, "ranks": topology.world_size, "overrides": overrides, "bytes": nbytes,
            "rows": {name: {"seconds": s, "gb_per_s": nbytes / s / 1e9, "x_memcpy": s / best["memcpy"]}
                     for name, s in best.items()},
            "vllm_load_split": split}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="HF folder (repeatable)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/weight_sync.json")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. rollout.sync_bucket_mb=1024 "
                   "deepspeed=configs/ds_zero2.json")
    args = p.parse_args()
    quiet_library_output()
    topology = init_distributed()
    results = [measure(path, args.repeats, topology, args.overrides) for path in args.model]
    if topology.rank != 0:
        return
    for r in results:
        print(f"\n{r['model']}: {r['bytes'] / 2**20:.0f} MiB, {r['ranks']} rank(s), best of {args.repeats}",
              " ".join(r["overrides"]))
        print(f"{'':<26}{'seconds':>9}{'GB/s':>8}{'x memcpy':>10}")
        for name, row in r["rows"].items():
            print(f"{name:<26}{row['seconds']:>9.3f}{row['gb_per_s']:>8.2f}{row['x_memcpy']:>10.1f}")
        if r["vllm_load_split"]:
            print("one vllm load, by cProfile's own time: "
                  + ", ".join(f"{k[:-2]} {v:.3f} s" for k, v in r["vllm_load_split"].items()))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
