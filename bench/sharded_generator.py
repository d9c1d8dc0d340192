"""The vLLM generator sharded over 2 ranks (rollout.tensor_parallel_size 2: one engine, each rank
half of it) against an engine per rank (1), side by side: the rollout's tokens/s over both
ranks, each rank's engine weight bytes and its resident memory after the engine is built. Each
rank asks for its own prompts, as dp ranks do; the tp 2 engine runs both ranks' prompts as one
pooled batch (rollout/generator_group.py).

    python bench/sharded_generator.py --model runs/tiny/warm --prompts runs/tiny/data/train.jsonl

Runs each layout as a 2-rank job through the DeepSpeed launcher (a process holds one vLLM
parallel layout). Prints a table, writes JSON (bench/results/sharded_generator.json).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def worker(args) -> None:
    """One rank of a layout: build the engine, sample this rank's prompts `repeats` times."""
    import torch

    from megagrpo.cluster.distributed import init_distributed
    from megagrpo.data import load_prompts
    from megagrpo.monitoring import status_gib
    from megagrpo.policy.models import load_tokenizer
    from megagrpo.rollout.generator_group import GeneratorGroup
    from megagrpo.rollout.generators import VLLMGenerator
    from megagrpo.validation import load_config

    cfg = load_config("configs/tiny_arith.yaml", [
        f"model.name_or_path={args.model}", f"data.train_file={args.prompts}", "data.eval_file=null",
        f"rollout.tensor_parallel_size={args.generator_tp}", f"rollout.max_new_tokens={args.max_new_tokens}"])
    topology = init_distributed(generator_tp=args.generator_tp)
    clock = time.perf_counter()
    engine = VLLMGenerator(cfg, args.model, seed=0)
    build_s = time.perf_counter() - clock
    group = GeneratorGroup(topology, engine)
    prompts, _ = load_prompts(args.prompts, load_tokenizer(args.model), 128)
    mine = prompts[topology.rank * args.num_prompts:(topology.rank + 1) * args.num_prompts]

    group.generate(mine[:2], args.num_generations, list(range(2)))  # warm-up
    torch.distributed.barrier()
    tokens, clock = 0, time.perf_counter()
    for r in range(args.repeats):
        groups = group.generate(mine, args.num_generations, [r * 1000 + i for i in range(len(mine))])
        tokens += sum(len(c.token_ids) for g in groups for c in g)
    torch.distributed.barrier()
    seconds = time.perf_counter() - clock

    def weight_bytes(w):
        return sum(t.numel() * t.element_size() for t in w.model_runner.get_model().parameters())
    row = {"rank": topology.rank, "tokens": tokens, "seconds": seconds, "build_s": build_s,
           "weight_bytes": engine.llm.collective_rpc(weight_bytes)[0], "rss_gib": status_gib("VmRSS")}
    with open(os.path.join(args.out_dir, f"rank{topology.rank}.json"), "w") as f:
        json.dump(row, f)
    torch.distributed.barrier()


def run_layout(args, generator_tp: int) -> dict:
    out_dir = tempfile.mkdtemp(prefix=f"sharded_tp{generator_tp}_")
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--log_level", "error",
           os.path.abspath(__file__), "--worker", "--generator-tp", str(generator_tp), "--out-dir", out_dir,
           "--model", args.model, "--prompts", args.prompts, "--num-prompts", str(args.num_prompts),
           "--num-generations", str(args.num_generations), "--max-new-tokens", str(args.max_new_tokens),
           "--repeats", str(args.repeats)]
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": ROOT},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(2)]
    tokens, seconds = sum(r["tokens"] for r in ranks), max(r["seconds"] for r in ranks)
    return {"ranks": ranks, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "weight_bytes_per_rank": ranks[0]["weight_bytes"], "rss_gib_per_rank": max(r["rss_gib"] for r in ranks),
            "build_s": max(r["build_s"] for r in ranks)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--num-prompts", type=int, default=8, help="per rank")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/sharded_generator.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--generator-tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    results = {f"tp{t}": run_layout(args, t) for t in (1, 2)}
    one, two = results["tp1"], results["tp2"]
    results["ratios_tp2_to_tp1"] = {key: two[value] / one[value] for key, value in (
        ("tokens_per_s", "tokens_per_s"), ("weight_bytes_per_rank", "weight_bytes_per_rank"),
        ("rss_per_rank", "rss_gib_per_rank"))}
    results["setup"] = {k: v for k, v in vars(args).items() if k not in ("worker", "generator_tp", "out_dir")}
    print(f"\n{'vLLM tp':<9}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'weights/rank':>14}{'RSS/rank GiB':>14}"
          f"{'build s':>9}")
    for t in (1, 2):
        r = results[f"tp{t}"]
        print(f"{t:<9}{r['tokens']:>8}{r['seconds']:>9.2f}{r['tokens_per_s']:>10.0f}{r['weight_bytes_per_rank']:>14}"
              f"{r['rss_gib_per_rank']:>14.2f}{r['build_s']:>9.1f}")
    ratios = results["ratios_tp2_to_tp1"]
    print(f"tp 2 / tp 1: tokens/s {ratios['tokens_per_s']:.2f}x, weight bytes per rank "
          f"{ratios['weight_bytes_per_rank']:.3f}x, RSS per rank {ratios['rss_per_rank']:.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
