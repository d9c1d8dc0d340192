"""A GRPO run at a real model's shape, measured against the planner: peak RSS of every rank
next to `megagrpo plan`'s peak, the step's time split, RSS per step, the weight sync against
a memcpy of the same bytes, and the peak memory of `megagrpo convert to-hf` on its checkpoint.

    python bench/real_shape_run.py                                   # Qwen2.5-0.5B, bf16, 2 ranks
    python bench/real_shape_run.py --layers 4 --dtype float32 --steps 3

The model is built locally with its real configuration and random weights
(tools/make_tiny_model.py --shape), the task is the demo arithmetic task. The run goes through
the deepspeed launcher with vLLM co-located and kl_coef > 0 (so the reference is built); a
sampler reads every rank's RSS from /proc twice a second. Prints a table, writes JSON
(bench/results/real_shape_run.json by default).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from megagrpo.cluster.distributed import free_port

BIN = os.path.dirname(sys.executable)


def rank_processes(marker: str) -> dict:
    """{rank: pid} of the trainer processes whose command line contains `marker`."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline").read()
            if marker not in cmdline or "megagrpo.train" not in cmdline or "deepspeed.launcher" in cmdline:
                continue
            env = dict(item.split("=", 1) for item in open(f"/proc/{pid}/environ").read().split("\0") if "=" in item)
            if "RANK" in env:
                found[int(env["RANK"])] = int(pid)
        except (OSError, ValueError):
            continue
    return found


def rss_gib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2**20
    except (OSError, StopIteration):
        return 0.0


class RSSSampler(threading.Thread):
    """Peak RSS per rank over the run, sampled every `interval` seconds."""

    def __init__(self, marker: str, interval: float = 0.5):
        super().__init__(daemon=True)
        self.marker, self.interval, self.peak, self.done = marker, interval, {}, threading.Event()

    def run(self):
        while not self.done.is_set():
            for rank, pid in rank_processes(self.marker).items():
                self.peak[rank] = max(self.peak.get(rank, 0.0), rss_gib(pid))
            time.sleep(self.interval)


def scalars(out: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(os.path.join(out, "tensorboard"))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def memcpy_gbps(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    dst.copy_(src)
    return nbytes / (time.perf_counter() - start) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the shape's")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--deepspeed", default=None, help="default: configs/ds_zero3_bf16.json or ds_zero3.json")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (all ranks)")
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--kl-coef", type=float, default=0.04)
    p.add_argument("--work", default=os.path.join(ROOT, "runs", "bench_real_shape"))
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "real_shape_run.json"))
    p.add_argument("overrides", nargs="*", help="extra key=value settings for the run")
    args = p.parse_args()
    ds = args.deepspeed or f"configs/{'ds_zero3_bf16' if args.dtype == 'bfloat16' else 'ds_zero3'}.json"
    data = os.path.join(args.work, "data")
    model = os.path.join(args.work, f"{args.shape}-{args.layers or 'full'}-{args.dtype}")
    out = os.path.join(args.work, f"run-{os.path.basename(model)}-{args.ranks}r")
    if not os.path.isdir(data):
        subprocess.run([sys.executable, "tools/make_demo_data.py", "--out", data], cwd=ROOT, check=True)
    if not os.path.isfile(os.path.join(model, "config.json")):
        subprocess.run([sys.executable, "tools/make_tiny_model.py", "--shape", args.shape, "--dtype", args.dtype,
                        "--out", model, "--corpus", os.path.join(data, "sft.jsonl"),
                        *(["--layers", str(args.layers)] if args.layers else [])], cwd=ROOT, check=True)
    per_rank = args.prompts * args.generations // args.ranks
    settings = [f"model.name_or_path={model}", f"model.dtype={args.dtype}", f"deepspeed={ds}",
                f"data.train_file={os.path.join(data, 'train.jsonl')}", "data.eval_file=null",
                f"grpo.kl_coef={args.kl_coef}", f"grpo.num_generations={args.generations}",
                f"grpo.per_device_train_batch_size={per_rank}", f"rollout.max_new_tokens={args.new_tokens}",
                f"grpo.max_steps={args.steps}", f"checkpoint.save_steps={args.steps}", "logging.sample_steps=0",
                "logging.progress_bar=false", f"output_dir={out}", *args.overrides]
    plan = subprocess.run([f"{BIN}/megagrpo", "plan", "--world-size", str(args.ranks), "--config",
                           "configs/tiny_arith.yaml", *settings], cwd=ROOT, capture_output=True, text=True)
    print(plan.stdout)
    planned = float(re.search(r"\n  total +([\d.]+) GiB", plan.stdout).group(1))
    from megagrpo.planning import count_parameters
    weights_gib = count_parameters(model)[0] * (4 if args.dtype == "float32" else 2) / 2**30

    sampler = RSSSampler(f"output_dir={out}")
    sampler.start()
    start = time.perf_counter()
    run = subprocess.run([f"{BIN}/deepspeed", "--num_gpus", str(args.ranks), "--master_port", str(free_port()),
                          "--module", "megagrpo.train", "--config", "configs/tiny_arith.yaml", *settings],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    wall = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    if run.returncode != 0:
        print(run.stdout[-4000:], run.stderr[-4000:], sep="\n")
        raise SystemExit(f"the run failed (exit {run.returncode})")
    s = scalars(out)
    sync = s.get("train/time/weight_sync", [])
    checkpoint = os.path.join(out, "checkpoints", f"step_{args.steps:08d}")
    convert = subprocess.Popen([f"{BIN}/megagrpo", "convert", "to-hf", checkpoint, os.path.join(out, "converted")],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(convert.pid, 0)  # this child's own peak RSS (kB)
    convert.returncode, convert_peak = os.waitstatus_to_exitcode(status), usage.ru_maxrss / 2**20
    measured = max(sampler.peak.values())
    result = {
        "shape": args.shape, "layers": args.layers, "dtype": args.dtype, "deepspeed": ds, "ranks": args.ranks,
        "steps": args.steps, "completions_per_step": args.prompts * args.generations, "new_tokens": args.new_tokens,
        "planned_peak_gib_per_rank": planned, "measured_peak_gib_per_rank": sampler.peak,
        "measured_over_planned": measured / planned, "wall_seconds": wall,
        "rss_gib_per_step": s.get("train/memory/rss_gib", []),
        "time_split_seconds": {k.split("/")[-1]: v for k, v in s.items() if k.startswith("train/time/")},
        "weight_sync_gbps": [weights_gib * 2**30 / t / 1e9 for t in sync],
        "memcpy_gbps": memcpy_gbps(int(weights_gib * 2**30)),
        "convert_to_hf_peak_gib": convert_peak, "convert_ok": convert.returncode == 0,
    }
    print(f"{'':<34}{'value':>12}")
    print(f"{'planned peak per rank (GiB)':<34}{planned:>12.2f}")
    for rank, peak in sorted(sampler.peak.items()):
        print(f"{f'measured peak, rank {rank} (GiB)':<34}{peak:>12.2f}")
    print(f"{'measured / planned':<34}{measured / planned:>12.2f}")
    print(f"{'RSS per step (GiB, largest rank)':<34}  {', '.join(f'{v:.2f}' for v in result['rss_gib_per_step'])}")
    for phase, values in result["time_split_seconds"].items():
        print(f"{f'time/{phase} (s per step)':<34}  {', '.join(f'{v:.1f}' for v in values)}")
    print(f"{'weight sync GB/s | memcpy GB/s':<34}  {', '.join(f'{v:.2f}' for v in result['weight_sync_gbps'])}"
          f" | {result['memcpy_gbps']:.2f}")
    print(f"{'convert to-hf peak RSS (GiB)':<34}{convert_peak:>12.2f}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"-> {args.json}")


if __name__ == "__main__":
    main()
