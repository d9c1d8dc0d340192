"""On-policy distillation against GRPO, side by side from the same start (docs/distillation.md).

The student is the tiny quickstart's warm-started model (mostly wrong guesses). The teacher is
the same tiny model warm-started on worked answers only (tools/make_demo_data.py
--worked-share 1, tools/warm_start.py): it answers the held-out additions nearly always right.
Both runs take the same prompts, seeds, learning rate and steps; one learns from the
answer_match reward (GRPO), the other from the teacher alone (teacher.task_weight 0: the reward
is still computed and logged). Held-out accuracy (the exact-answer check, mean of
--eval-generations samples per prompt at temperature 1) every --eval-every steps; the first
step each run comes within 5 points of the teacher's.

    python bench/distillation_learning.py --tiny runs/tiny --steps 20

--tiny: the tiny quickstart's folder (TINY=1 bash launch/quickstart.sh, or the suite's
/tmp/megagrpo-suite/tiny) with model, data and warm. One process, one rank per run.
Prints a table, writes JSON (bench/results/distillation_learning.json).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_teacher(tiny: str, out: str) -> str:
    """The tiny model warm-started on worked answers only; returns its folder."""
    data, teacher = os.path.join(out, "teacher_data"), os.path.join(out, "teacher")
    if not os.path.isfile(os.path.join(teacher, "config.json")):
        subprocess.run([sys.executable, "tools/make_demo_data.py", "--out", data, "--worked-share", "1"],
                       cwd=ROOT, check=True)
        subprocess.run([sys.executable, "tools/warm_start.py", "--model", os.path.join(tiny, "model"), "--data",
                        os.path.join(data, "sft.jsonl"), "--out", teacher, "--steps", "300"], cwd=ROOT, check=True)
    return teacher


def held_out(model: str, tiny: str, out: str, generations: int) -> float:
    """The model's held-out accuracy (megagrpo eval, sampled)."""
    subprocess.run([sys.executable, "-m", "megagrpo.cli", "eval", "--model", model, "--data",
                    os.path.join(tiny, "data", "eval.jsonl"), "--config", "configs/tiny_arith.yaml", "--output", out,
                    f"logging.eval_num_generations={generations}"], cwd=ROOT, check=True, capture_output=True)
    return json.load(open(os.path.join(out, "eval_results.json")))["rewards/answer_match"]


def train(name: str, args, *overrides) -> tuple[list, float]:
    """One run; returns its held-out history [(step, accuracy)] and seconds."""
    out = os.path.join(args.out, name)
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, not a resumed one
    started = time.time()
    subprocess.run([sys.executable, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                    f"model.name_or_path={os.path.join(args.tiny, 'warm')}",
                    f"data.train_file={os.path.join(args.tiny, 'data', 'train.jsonl')}",
                    f"data.eval_file={os.path.join(args.tiny, 'data', 'eval.jsonl')}",
                    f"output_dir={out}", "logging.progress_bar=false", f"grpo.max_steps={args.steps}",
                    f"logging.eval_steps={args.eval_every}", f"logging.eval_num_generations={args.eval_generations}",
                    f"grpo.kl_coef={args.kl_coef}", "checkpoint.save_steps=0", "checkpoint.save_hf_at_end=false",
                    *overrides],
                   cwd=ROOT, check=True, capture_output=True)
    seconds = time.time() - started
    history = {}
    for line in open(os.path.join(out, "eval_history.jsonl")):
        row = json.loads(line)
        history[row["step"]] = row["rewards/answer_match"]
    return sorted(history.items()), seconds


def first_within(history: list, target: float, points: float = 0.05):
    return next((step for step, accuracy in history if accuracy >= target - points), None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", default="runs/tiny", help="the tiny quickstart's folder (model, data, warm)")
    p.add_argument("--out", default="runs/distillation_learning", help="the runs' folder")
    p.add_argument("--steps", type=int, default=20, help="training steps of each run (default 20)")
    p.add_argument("--eval-every", type=int, default=2, help="held-out evaluation every N steps (default 2)")
    p.add_argument("--eval-generations", type=int, default=4, help="samples per held-out prompt (default 4)")
    p.add_argument("--kl-coef", type=float, default=0.0,
                   help="grpo.kl_coef of both runs (default 0: the reference, the student's start, mostly "
                        "guesses wrong)")
    args = p.parse_args()
    teacher = build_teacher(args.tiny, args.out)
    teacher_accuracy = held_out(teacher, args.tiny, os.path.join(args.out, "teacher_eval"), args.eval_generations)
    opd, opd_seconds = train("opd", args, f"teacher.model={teacher}", "teacher.task_weight=0")
    grpo, grpo_seconds = train("grpo", args)
    print(f"teacher held-out accuracy {teacher_accuracy:.3f}\n")
    print("| step | on-policy distillation | GRPO |\n| --- | --- | --- |")
    for (step, a), (_, b) in zip(opd, grpo):
        print(f"| {step} | {a:.3f} | {b:.3f} |")
    figures = {
        "teacher_accuracy": teacher_accuracy, "steps": args.steps, "kl_coef": args.kl_coef,
        "eval_generations": args.eval_generations,
        "opd_history": opd, "grpo_history": grpo,
        "opd_first_step_within_5_points": first_within(opd, teacher_accuracy),
        "grpo_first_step_within_5_points": first_within(grpo, teacher_accuracy),
        "opd_seconds": round(opd_seconds, 1), "grpo_seconds": round(grpo_seconds, 1),
    }
    print(f"\nfirst step within 5 points of the teacher: distillation {figures['opd_first_step_within_5_points']}, "
          f"GRPO {figures['grpo_first_step_within_5_points']}; seconds {opd_seconds:.0f} vs {grpo_seconds:.0f}")
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "distillation_learning.json"), "w") as f:
        json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
