"""A verifiers environment learns at quickstart size, run by verifiers itself (megagrpo/hubs):
GRPO on the tiny model, warm-started as the tiny quickstart's (mostly off-by-one answers), with
`rollout.environment: verifiers:vf-arith`, the two-turn verifiers environment of
tests/helpers/vf_arith (two additions, the second asked after the first is answered; its
reward, the share answered right, is the `agent` reward). Held-out reward before and after, and
the time a step takes with verifiers' harness program per episode.

    bash launch/install_hub.sh verifiers
    python bench/verifiers_learning.py --tiny runs/tiny --steps 30

--tiny: the tiny quickstart's folder (TINY=1 bash launch/quickstart.sh, or the suite's
/tmp/megagrpo-suite/tiny) with model, data and warm. One process, one rank.
Prints a table, writes JSON (bench/results/verifiers_learning.json).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", default="runs/tiny", help="the tiny quickstart's folder (model, data, warm)")
    p.add_argument("--out", default="runs/verifiers_learning", help="the run's folder")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps (default 30)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--generations", type=int, default=4, help="episodes per prompt (default 4)")
    p.add_argument("--learning-rate", type=float, default=5e-4, help="(default 5e-4)")
    p.add_argument("--turns", type=int, default=2, choices=[1, 2],
                   help="questions an episode asks (default 2; 1: the tiny quickstart's task through verifiers)")
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT}/tests/helpers", "PYTHONUNBUFFERED": "1"}
    data = os.path.join(args.out, "data")
    shutil.rmtree(os.path.join(args.out, "grpo"), ignore_errors=True)  # a fresh run, not a resumed one
    subprocess.run([sys.executable, "tools/prepare_data.py", "--verifiers", "vf-arith", "--out", data,
                    "--train-size", "512", "--eval-size", "32"], cwd=ROOT, env=env, check=True)
    started = time.time()
    subprocess.run([sys.executable, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                    f"model.name_or_path={os.path.join(args.tiny, 'warm')}",
                    f"data.train_file={data}/train.jsonl", f"data.eval_file={data}/eval.jsonl",
                    f"output_dir={args.out}/grpo", "logging.progress_bar=false",
                    "rollout.environment=verifiers:vf-arith",
                    f"rollout.environment_config={{taskset: {{turns: {args.turns}}}}}",
                    f"rollout.max_turns={args.turns}", "rollout.max_new_tokens=16",
                    "rollout.max_model_len=256", f"grpo.num_generations={args.generations}",
                    f"grpo.per_device_train_batch_size={args.prompts * args.generations}",
                    f"grpo.learning_rate={args.learning_rate}", f"grpo.max_steps={args.steps}",
                    "checkpoint.save_steps=0", "checkpoint.save_hf_at_end=false",
                    "rewards.functions=[{name: agent}]"], cwd=ROOT, env=env, check=True)
    seconds = time.time() - started
    results = json.load(open(os.path.join(args.out, "grpo", "eval_results.json")))
    rows = [json.loads(line) for line in open(os.path.join(args.out, "grpo", "metrics.jsonl"))]
    steps = [row for row in rows if "train/agent/episodes" in row]
    figures = {
        "turns": args.turns,
        "held_out_reward_before": results["before"]["rewards/agent"],
        "held_out_reward_after": results["after"]["rewards/agent"],
        "steps": args.steps, "episodes_per_step": args.prompts * args.generations,
        "seconds": round(seconds, 1),
        "seconds_per_step": round(sum(row["train/time/step"] for row in steps if "train/time/step" in row)
                                  / max(1, len(steps)), 1),
        "seconds_in_agent_per_episode": round(sum(row["train/agent/seconds_in_agent"] for row in steps)
                                              / max(1, len(steps)), 2),
        "failed_episodes": sum(row["train/agent/failed_crash"] + row["train/agent/failed_timeout"] for row in steps),
    }
    print("| figure | value |\n| --- | --- |")
    for key, value in figures.items():
        print(f"| {key} | {value} |")
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "verifiers_learning.json"), "w") as f:
        json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
