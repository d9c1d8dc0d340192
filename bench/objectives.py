"""Learning per objective: the quickstart task (tiny model, 2 CPU ranks, ZeRO-3, vLLM) trained
with every loss type for the same number of steps, side by side in one run: held-out accuracy
before and after, and GRPO's wall time.

    python bench/objectives.py [--tiny runs/tiny] [--steps 40] [--ranks 2]

Needs the tiny quickstart's model and data (TINY=1 bash launch/quickstart.sh builds runs/tiny). Prints a
table, writes JSON. The objectives are docs/objectives.md's.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "dapo (default)": [],
    "grpo": ["grpo.loss_type=grpo"],
    "bnpo": ["grpo.loss_type=bnpo"],
    "dr_grpo": ["grpo.loss_type=dr_grpo"],
    "cispo": ["grpo.loss_type=cispo", "grpo.epsilon_high=4.0"],
    "sapo": ["grpo.loss_type=sapo"],
    "gspo": ["grpo.loss_type=grpo", "grpo.importance_sampling_level=sequence", "grpo.epsilon=3e-4",
             "grpo.epsilon_high=4e-4"],
}


def train(args, name: str, overrides: list[str], port: int) -> dict:
    out = os.path.join(args.out_dir, name.split()[0])
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(args.ranks),
           "--master_port", str(port), "--module", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
           f"model.name_or_path={args.tiny}/warm", f"data.train_file={args.tiny}/data/train.jsonl",
           f"data.eval_file={args.tiny}/data/eval.jsonl", f"output_dir={out}", "checkpoint.resume=none",
           f"grpo.max_steps={args.steps}", "logging.progress_bar=false", "checkpoint.save_steps=0",
           "checkpoint.save_hf_at_end=false", *overrides]
    subprocess.run(["rm", "-rf", out], check=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    results = json.load(open(os.path.join(out, "eval_results.json")))
    return {"before": results["before"]["rewards/answer_match"], "after": results["after"]["rewards/answer_match"],
            "seconds": seconds, "overrides": overrides}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", default="runs/tiny", help="the quickstart's folder (warm model and data)")
    p.add_argument("--steps", type=int, default=40, help="GRPO steps per objective (the quickstart's 40)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--only", nargs="*", default=None, help="a subset of the objectives")
    p.add_argument("--out-dir", default="bench/results/objectives")
    p.add_argument("--out", default="bench/results/objectives.json")
    args = p.parse_args()
    if not os.path.isfile(os.path.join(args.tiny, "warm", "config.json")):
        raise SystemExit(f"{args.tiny}/warm is missing: run TINY=1 bash launch/quickstart.sh first (or pass --tiny)")
    results = {}
    for i, (name, overrides) in enumerate(VARIANTS.items()):
        if args.only and name.split()[0] not in args.only:
            continue
        results[name] = train(args, name, overrides, 29700 + i)
        print(f"{name}: {results[name]['before']:.3f} -> {results[name]['after']:.3f} "
              f"in {results[name]['seconds']:.0f} s", flush=True)
    default = results.get("dapo (default)")
    print(f"\n{'objective':<16}{'before':>8}{'after':>8}{'vs default':>12}{'seconds':>9}")
    for name, r in results.items():
        versus = f"{r['after'] - default['after']:+.3f}" if default else "-"
        print(f"{name:<16}{r['before']:>8.3f}{r['after']:>8.3f}{versus:>12}{r['seconds']:>9.0f}")
    results["setup"] = vars(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
