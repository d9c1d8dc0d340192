"""Quickstart wall time on this machine (install excluded) and the GRPO step's time split.

    python bench/quickstart_time.py

Runs the quickstart's phases (demo data, tiny model, warm start, GRPO on 2 ranks through the
deepspeed launcher) in a fresh folder, times each, and reads the per-step time split back
from TensorBoard. Prints a table, writes JSON.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def timed(cmd):
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": ROOT})
    return time.perf_counter() - start


def main():
    out_json = sys.argv[1] if len(sys.argv) > 1 else "bench/results/quickstart_time.json"
    run = tempfile.mkdtemp(prefix="megagrpo-quickstart-")
    phases = {
        "demo_data": [sys.executable, "tools/make_demo_data.py", "--out", f"{run}/data"],
        "tiny_model": [sys.executable, "tools/make_tiny_model.py", "--out", f"{run}/model",
                       "--corpus", f"{run}/data/sft.jsonl"],
        "warm_start": [sys.executable, "tools/warm_start.py", "--model", f"{run}/model",
                       "--data", f"{run}/data/sft.jsonl", "--out", f"{run}/warm"],
        "grpo_2_ranks": [f"{BIN}/deepspeed", "--num_gpus", "2", "--master_port", "29533",
                         "--module", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                         f"model.name_or_path={run}/warm", f"data.train_file={run}/data/train.jsonl",
                         f"data.eval_file={run}/data/eval.jsonl", f"output_dir={run}/grpo",
                         "logging.progress_bar=false"],
    }
    result = {"phases_s": {name: timed(cmd) for name, cmd in phases.items()}}
    result["total_s"] = sum(result["phases_s"].values())
    acc = EventAccumulator(f"{run}/grpo/tensorboard", size_guidance={"scalars": 0})
    acc.Reload()
    split = {}
    for tag in acc.Tags()["scalars"]:
        if tag.startswith("train/time/"):
            values = [e.value for e in acc.Scalars(tag)]
            split[tag[len("train/time/"):]] = sum(values) / len(values)
    result["mean_step_split_s"] = split
    result["steps"] = len(acc.Scalars("train/time/step"))
    result["eval"] = json.load(open(f"{run}/grpo/eval_results.json"))
    print(f"\n{'phase':<16}{'seconds':>9}")
    for name, seconds in result["phases_s"].items():
        print(f"{name:<16}{seconds:>9.1f}")
    print(f"{'total':<16}{result['total_s']:>9.1f}")
    print(f"\nmean GRPO step ({result['steps']} steps), seconds:")
    for name, seconds in split.items():
        print(f"  {name:<12}{seconds:>8.3f}  ({100 * seconds / split['step']:.0f}%)")
    print(f"held-out accuracy {result['eval']['before']['rewards/answer_match']:.3f} -> "
          f"{result['eval']['after']['rewards/answer_match']:.3f}")
    os.makedirs(os.path.dirname(out_json), exist_ok=True)
    with open(out_json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
