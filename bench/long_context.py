"""Long trajectories under sequence parallelism: for sp = 1, 2, 4 the longest single trajectory
whose training step (the fused log-prob pass, the GRPO loss, backward, the ZeRO-3 optimizer
step) stays within a per-rank memory budget, the peak against `megagrpo plan`'s, and the step
time per token against sp 1 at a length both run.

    python bench/long_context.py                          # sp 1 2 4, lengths 1k 2k 4k ... on CPU
    python bench/long_context.py --sp 1 2 --budget-gib 4 --lengths 1024 2048 4096 8192
    python bench/long_context.py --sp 1 --tiled-mlp --no-checkpointing    # model.tiled_mlp

The model has Qwen2.5-0.5B's widths, vocabulary and kv heads, cut to --layers layers, with 16
attention heads of 56 (the real one has 14 of 64, which sp 4 does not divide), random weights,
bf16 (tools/make_tiny_model.py --shape qwen2.5-0.5b). Each sp size is one launch of sp ranks
through torchrun (a world of sp ranks: dp 1), which trains one trajectory of each length in
increasing order (after a 256-token step, which allocates Adam's moments) until a rank's peak
passes the budget. The peak is the training step's peak RSS on CPU (the whole process: the plan
counts the interpreter and the model state too; the pass, forward and backward, and the
optimizer step are measured apart) and torch's peak allocation on GPU. The plan is
planning.peak_memory at that length without the rollout engine, which this bench does not
build, its runtime part the process's RSS before the model (no vLLM imported). --dp runs dp x sp
ranks, each training its own trajectory. Prints a table, writes JSON (bench/results/long_context.json by default).
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from megagrpo.cluster.distributed import free_port  # noqa: E402

BIN = os.path.dirname(sys.executable)


def settings(args, sp: int) -> list[str]:
    return [f"model.name_or_path={args.model}", f"model.dtype={args.dtype}",
            f"deepspeed=configs/{'ds_zero3_bf16' if args.dtype == 'bfloat16' else 'ds_zero3'}.json",
            f"parallel.sequence_parallel_size={sp}", "grpo.kl_coef=0", "grpo.per_device_train_batch_size=2",
            "grpo.num_generations=2", "grpo.max_tokens_per_microbatch=0", "grpo.packing=true",
            f"model.gradient_checkpointing={str(args.checkpointing).lower()}", "rollout.engine=hf",
            f"model.tiled_mlp={str(args.tiled_mlp).lower()}",
            f"grpo.logprob_chunk_size={args.chunk}", f"data.train_file={os.path.join(args.work, 'train.jsonl')}",
            "data.eval_file=null"]


def worker(args) -> None:
    """One launch: this rank's share of each length's training step."""
    import torch

    from megagrpo.cluster.distributed import all_reduce, init_distributed
    from megagrpo.monitoring import PhaseClock, status_gib
    from megagrpo.planning import make_plan, peak_memory, peak_total
    from megagrpo.policy import build_policy
    from megagrpo.policy.batch import Completion, make_batch
    from megagrpo.validation import load_config

    sp = int(os.environ["WORLD_SIZE"]) // args.dp
    cfg = load_config("configs/tiny_arith.yaml", settings(args, sp) + [f"rollout.max_new_tokens={max(args.lengths)}"])
    topology = init_distributed(sp_size=sp)
    started = status_gib("VmRSS")  # the interpreter, torch, DeepSpeed: no model yet
    policy = build_policy(cfg, topology, total_steps=len(args.lengths) + 1)
    clock, step = PhaseClock(), policy.engine.step

    def timed_step():  # the peaks of the pass (forward + backward) and of the optimizer step apart
        clock.lap("pass")
        step()
        clock.lap("step")
    policy.engine.step = timed_step
    cuda = torch.cuda.is_available()
    plan = make_plan(cfg, sp * args.dp)
    generator = torch.Generator().manual_seed(0)
    for length in [256] + args.lengths:  # a first step allocates Adam's moments: measured apart
        prompt = torch.randint(10, 1000, (32,), generator=generator).tolist()
        completion = torch.randint(10, 1000, (length - 32,), generator=generator).tolist()
        rows = [Completion(completion, [-1.0] * len(completion), False),
                Completion(completion[:64], [-1.0] * 64, False)]
        batch = make_batch([prompt, prompt], rows, torch.tensor([1.0, -1.0]), pad_id=0).to(policy.engine.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        clock.lap("before")
        at_rest = status_gib("VmRSS")
        start = time.perf_counter()
        metrics = policy.optimize(batch, [[0], [1]])
        seconds = time.perf_counter() - start
        rss = all_reduce(torch.tensor([started, at_rest, clock.peak_rss_gib["pass"], clock.peak_rss_gib["step"]],
                                      dtype=torch.float64), "max").tolist()
        started_gib, at_rest, pass_gib, step_gib = rss  # the largest rank's, GiB
        # the training step's own peak: RSS on CPU (the pass and the optimizer step apart), torch's on GPU
        peak = float(torch.cuda.max_memory_allocated()) if cuda else max(pass_gib, step_gib) * 2**30
        planned = peak_memory(cfg, plan, plan.params_trained, length)
        planned.pop("rollout")  # this bench builds no vLLM engine, and no vLLM in the runtime:
        planned["runtime"] = int(started_gib * 2**30)  # the process before the model, measured
        if topology.is_main and length in args.lengths:
            print("LONG_CONTEXT " + json.dumps({
                "sp": sp, "dp": args.dp, "length": length, "peak_gib": peak / 2**30,
                "plan_gib": peak_total(planned) / 2**30, "started_gib": started_gib, "at_rest_gib": at_rest,
                "pass_peak_gib": pass_gib, "step_peak_gib": step_gib,
                "plan": {k: v / 2**30 for k, v in planned.items()}, "seconds": seconds,
                "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}), flush=True)
        if peak > args.budget_gib * 2**30:
            break


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--budget-gib", type=float, default=3.0, help="per rank")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (each trains its own trajectory)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--chunk", type=int, default=1024, help="grpo.logprob_chunk_size")
    p.add_argument("--tiled-mlp", action=argparse.BooleanOptionalAction, default=False, help="model.tiled_mlp")
    p.add_argument("--work", default="/tmp/long_context")
    p.add_argument("--model", help="default: built in --work")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "long_context.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.model = args.model or os.path.join(args.work, f"qwen2.5-0.5b-{args.layers}l-16h-{args.dtype}")
    if args.worker:
        return worker(args)
    if not os.path.isfile(os.path.join(args.work, "train.jsonl")):
        subprocess.run([sys.executable, "tools/make_demo_data.py", "--out", args.work], cwd=ROOT, check=True)
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        subprocess.run([sys.executable, "tools/make_tiny_model.py", "--shape", "qwen2.5-0.5b", "--layers",
                        str(args.layers), "--heads", "16", "--dtype", args.dtype, "--out", args.model,
                        "--corpus", os.path.join(args.work, "sft.jsonl")], cwd=ROOT, check=True)
    rows = []
    for sp in args.sp:
        command = [f"{BIN}/torchrun", "--nproc_per_node", str(sp * args.dp), "--master_port",
                   str(free_port()), os.path.abspath(__file__), "--worker", "--dp", str(args.dp),
                   "--budget-gib", str(args.budget_gib), "--dtype", args.dtype,
                   "--chunk", str(args.chunk), "--work", args.work, "--model", args.model,
                   "--checkpointing" if args.checkpointing else "--no-checkpointing",
                   "--tiled-mlp" if args.tiled_mlp else "--no-tiled-mlp",
                   "--lengths", *map(str, args.lengths)]
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        found = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
                 if line.startswith("LONG_CONTEXT ")]
        if proc.returncode and not found:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        rows += found
        for row in found:
            print(f"sp {row['sp']} dp {row['dp']}  {row['length']:>6} tokens  peak {row['peak_gib']:6.2f} GiB (pass "
                  f"{row['pass_peak_gib']:.2f}, step {row['step_peak_gib']:.2f})  plan {row['plan_gib']:6.2f} GiB "
                  f"({row['peak_gib'] / row['plan_gib']:.2f})  {row['seconds']:7.1f} s", flush=True)
    summary = {}
    for sp in args.sp:
        within = [r for r in rows if r["sp"] == sp and r["peak_gib"] <= args.budget_gib]
        summary[sp] = max(within, key=lambda r: r["length"]) if within else None
    shared = max((r["length"] for r in rows if r["sp"] == args.sp[0] and summary[args.sp[0]]
                  and r["length"] <= summary[args.sp[0]]["length"]), default=None)
    print(f"\nbudget {args.budget_gib} GiB per rank, {args.dtype}, checkpointing {args.checkpointing}, "
          f"tiled MLP {args.tiled_mlp}")
    print(f"{'sp':>3} {'longest':>8} {'x sp 1':>7} {'peak GiB':>9} {'plan GiB':>9} {'peak/plan':>10} "
          f"{'s/1k tokens at ' + str(shared):>22}")
    for sp, best in summary.items():
        if best is None:
            print(f"{sp:>3}  none within the budget")
            continue
        at = next((r for r in rows if r["sp"] == sp and r["length"] == shared), None)
        first = summary[args.sp[0]]
        print(f"{sp:>3} {best['length']:>8} {best['length'] / first['length'] if first else 0:>7.2f} "
              f"{best['peak_gib']:>9.2f} {best['plan_gib']:>9.2f} {best['peak_gib'] / best['plan_gib']:>10.2f} "
              f"{(at['seconds'] / shared * 1000) if at else float('nan'):>22.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"budget_gib": args.budget_gib, "dtype": args.dtype, "checkpointing": args.checkpointing,
                   "tiled_mlp": args.tiled_mlp,
                   "layers": args.layers, "rows": rows, "longest": summary}, f, indent=1)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
