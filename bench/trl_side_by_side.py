"""TRL's GRPOTrainer against megagrpo on the same real model and task, one after the other on
one machine: seconds per step, peak resident memory, held-out reward after N steps.

    python bench/trl_side_by_side.py                       # SmolLM2-135M-Instruct, chain_sum, 8 steps
    python bench/trl_side_by_side.py --model /tmp/smol32 --steps 2 --prompts-per-step 2 \\
        --generations 4 --max-new-tokens 16 --eval-size 8  # a smoke run
    python bench/trl_side_by_side.py --systems megagrpo    # one side only

The model folder comes from tools/get_model.py (written when absent), the prompts from
tools/prepare_data.py --reasoning-gym TASK. Both sides train on the same prompts in file order
(no shuffling), prompts-per-step x generations completions per optimizer step, one process
each, with the reasoning_gym reward (megagrpo.rewards.reasoning_gym) and the same G, max new
tokens, learning rate, KL coefficient (TRL: beta), temperature, dtype, seed and loss settings:
the megagrpo config (--config) with this script's flags as overrides is resolved once, and
TRL's GRPOConfig is built from it (loss_type, epsilon, schedule, Adam betas, ...).

  - TRL 1.16: generation with transformers' generate (use_vllm=False); per_device_train_batch_size
    = prompts x G completions, gradient_accumulation_steps 1, so one generation batch is one
    optimizer step. Step time: a TrainerCallback's on_step_begin -> on_step_end. bfloat16 is
    TRL's own mixed precision (bf16=True: float32 weights under accelerate's bf16 autocast).
  - megagrpo: its co-located vLLM engine, `python -m megagrpo.train` in one process (ZeRO 0).
    Step time: train/time/step from metrics.jsonl.

Per system: mean seconds per step over the steps after the first (the first alone when there is
one), the peak RSS of the process tree (psutil, sampled every 0.2 s) and of its largest process
(ru_maxrss), the job's wall time, and the held-out mean reward of the final model, greedy, scored
for both sides (and the base model, once) by the same `megagrpo eval` command. OMP_WAIT_POLICY is
set in both processes' environments (--omp-wait-policy, default ACTIVE: a lone process on an
idle machine; on cores shared with other work ACTIVE's spinning threads slow both sides ~5x:
pass PASSIVE there).
Prints a table with megagrpo/TRL ratios, writes JSON (bench/results/trl_side_by_side.json).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("trl", "megagrpo")
QUICKSTART_TASK_ARGS = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}'  # launch/quickstart.sh
REWARD = "rewards/reasoning_gym"  # the held-out metric both sides are compared on


# ---- the TRL side (runs in its own process: --trl-worker SPEC.json) ---------------------------

def trl_worker(spec_path):
    """Train with TRL's GRPOTrainer as the spec says, save the final model, write the timings."""
    spec = json.load(open(spec_path))
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megagrpo.rewards.reasoning_gym import reasoning_gym as score

    def reasoning_gym(prompts, completions, reasoning_gym, **_):  # TRL logs it as rewards/reasoning_gym
        """megagrpo's reward under TRL's signature; a conversational completion is its assistant text."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return list(score(prompts, texts, reasoning_gym=reasoning_gym))

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.steps, self.begin, self.train_begin = [], None, None

        def on_train_begin(self, args, state, control, **kwargs):
            self.train_begin = time.time()

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(time.perf_counter() - self.begin)

    rows = [json.loads(line) for line in open(spec["train_file"]) if line.strip()]
    # conversational prompts: TRL renders them with the tokenizer's chat template, as megagrpo does
    dataset = Dataset.from_list([{"prompt": messages(r["prompt"], spec["system_prompt"]), "answer": r["answer"],
                                  "reasoning_gym": r["reasoning_gym"]} for r in rows])
    config = GRPOConfig(**spec["grpo_config"])
    timer = StepTimer()
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=[reasoning_gym], args=config,
                          train_dataset=dataset, callbacks=[timer])
    trainer.train()
    trainer.save_model(spec["final_model"])
    trainer.processing_class.save_pretrained(spec["final_model"])
    logged = [h for h in trainer.state.log_history if "reward" in h]
    with open(spec["result"], "w") as f:
        json.dump({"step_s": timer.steps, "train_begin": timer.train_begin,
                   "train_reward": [h["reward"] for h in logged],
                   "completion_length": [h["completions/mean_length"] for h in logged],
                   "logged_step_time": [h.get("step_time") for h in logged]}, f)


def trl_config(cfg, args, out):
    """GRPOConfig keyword arguments matching the resolved megagrpo config `cfg`."""
    g, r = cfg.grpo, cfg.rollout
    return dict(
        output_dir=out, max_steps=args.steps, num_generations=g.num_generations,
        per_device_train_batch_size=g.per_device_train_batch_size * g.gradient_accumulation_steps,
        gradient_accumulation_steps=1, max_completion_length=r.max_new_tokens, learning_rate=g.learning_rate,
        beta=g.kl_coef, temperature=r.temperature, top_p=r.top_p, top_k=max(r.top_k, 0), loss_type=g.loss_type,
        epsilon=g.epsilon, epsilon_high=g.epsilon_high, scale_rewards=g.scale_rewards,
        mask_truncated_completions=g.mask_truncated_completions, num_iterations=g.num_iterations,
        top_entropy_quantile=g.top_entropy_quantile, entropy_coef=g.entropy_coef,
        # transformers' "constant" ignores warmup; megagrpo's is constant after the warmup
        lr_scheduler_type="constant_with_warmup" if g.lr_scheduler_type == "constant" else g.lr_scheduler_type,
        warmup_steps=g.warmup_steps, weight_decay=g.weight_decay,
        adam_beta1=g.adam_beta1, adam_beta2=g.adam_beta2, max_grad_norm=g.max_grad_norm, seed=g.seed,
        shuffle_dataset=cfg.data.shuffle, gradient_checkpointing=cfg.model.gradient_checkpointing,
        # bfloat16: TRL's own default, float32 weights under bf16 autocast (megagrpo's DeepSpeed bf16 keeps
        # float32 master weights too; bf16 weights would round most of an update away)
        model_init_kwargs={"dtype": "float32"}, bf16=cfg.model.dtype == "bfloat16", use_cpu=True,
        use_vllm=False, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True)


# ---- running and measuring a process ----------------------------------------------------------

def run_measured(cmd, env, log_path):
    """Run cmd to its end, output to log_path; wall seconds and peak RSS (tree sum, sampled; and
    the largest process's ru_maxrss), in GiB. Raises with the log's tail when it fails."""
    import psutil

    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        peak, done = [0], threading.Event()

        def sample():
            root = psutil.Process(proc.pid)
            while not done.wait(0.2):
                try:
                    tree = [root] + root.children(recursive=True)
                except psutil.Error:
                    return
                total = 0
                for p in tree:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                peak[0] = max(peak[0], total)

        sampler = threading.Thread(target=sample, daemon=True)
        start = time.time()
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.time() - start
        done.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = "".join(open(log_path).readlines()[-30:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}; {log_path} ends:\n{tail}")
    return {"start": start, "wall_s": wall, "peak_rss_gib": peak[0] / 2**30,
            "max_process_rss_gib": usage.ru_maxrss / 2**20}  # ru_maxrss: KiB on Linux


def mean(values):
    return sum(values) / len(values) if values else float("nan")


def mean_after_first(steps):
    return mean(steps[1:]) if len(steps) > 1 else steps[0]


TABLE = [("s / step (mean after the first)", "mean_step_s", "{:.2f}"), ("first step (s)", "first_step_s", "{:.2f}"),
         ("peak RSS, process tree (GiB)", "peak_rss_gib", "{:.2f}"),
         ("peak RSS, largest process (GiB)", "max_process_rss_gib", "{:.2f}"),
         ("start to first step (s)", "ready_s", "{:.1f}"), ("job wall time (s)", "wall_s", "{:.1f}"),
         ("completion tokens, mean", "completion_length_mean", "{:.1f}"),
         ("train reward, mean over steps", "train_reward_mean", "{:.3f}"),
         (f"held-out {REWARD} after training", "eval_after", "{:.3f}")]
RATIOS = ("mean_step_s", "first_step_s", "peak_rss_gib", "max_process_rss_gib", "ready_s", "wall_s")


def print_table(results, systems):
    both = len(systems) == 2
    print(f"\n| {results['settings']['task']}, {results['settings']['steps']} steps | " + " | ".join(systems) + " |"
          + (" megagrpo / TRL |" if both else ""))
    print("| --- " * (len(systems) + 1 + both) + "|")
    for label, key, fmt in TABLE:
        cells = [fmt.format(results[s][key]) if results[s][key] is not None else "-" for s in systems]
        if both:
            ratio = results.get("ratios_megagrpo_over_trl", {}).get(key)
            cells.append(f"{ratio:.2f}x" if ratio is not None else "")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"held-out {REWARD} of the base model: {results['base_eval'][REWARD]:.3f} "
          f"({results['settings']['eval_prompts']} prompts, greedy, megagrpo eval)")


# ---- inputs -----------------------------------------------------------------------------------

def prepare(args, data):
    """The model folder (when absent) and the train/held-out prompts; their numbers."""
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        # float32 whatever --dtype: both sides cast it when they load it
        subprocess.run([sys.executable, "tools/get_model.py", "--out", args.model, "--dtype", "float32"],
                       cwd=ROOT, check=True)
    subprocess.run([sys.executable, "tools/prepare_data.py", "--reasoning-gym", args.task, "--out", data,
                    "--train-size", str(args.train_size), "--eval-size", str(args.eval_size),
                    "--seed", str(args.seed), "--task-args", args.task_args],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return [sum(1 for line in open(os.path.join(data, f"{name}.jsonl")) if line.strip()) for name in ("train", "eval")]


def messages(prompt, system_prompt):
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": prompt}]


def longest_prompt(model, data, system_prompt):
    """Tokens of the longest chat-rendered prompt (megagrpo's data.max_prompt_length: none is dropped)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    longest = 0
    for name in ("train", "eval"):
        for line in open(os.path.join(data, f"{name}.jsonl")):
            text = tokenizer.apply_chat_template(messages(json.loads(line)["prompt"], system_prompt),
                                                 tokenize=False, add_generation_prompt=True)
            longest = max(longest, len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return longest


def common_overrides(args, data):
    """The megagrpo settings of both training and evaluation."""
    given = {"model.dtype": args.dtype, "grpo.learning_rate": args.learning_rate, "grpo.kl_coef": args.kl_coef,
             "grpo.loss_type": args.loss_type, "rollout.temperature": args.temperature}
    return [f"model.name_or_path={args.model}", *(f"{k}={v}" for k, v in given.items() if v is not None),
            f"data.train_file={data}/train.jsonl", "data.eval_file=null", "data.shuffle=false",
            f"grpo.max_steps={args.steps}", f"grpo.num_generations={args.generations}",
            f"grpo.per_device_train_batch_size={args.prompts_per_step * args.generations}",
            "grpo.gradient_accumulation_steps=1",
            "rollout.engine=vllm", "rollout.placement=colocated", "rollout.servers=[]",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            "rewards.functions=[{name: reasoning_gym, weight: 1.0}]", "deepspeed=configs/ds_zero0.json",
            "parallel.tensor_parallel_size=1", "logging.progress_bar=false", "logging.sample_steps=0",
            "logging.eval_steps=0", "logging.report_to=[jsonl]", "logging.eval_num_generations=1",
            "checkpoint.save_steps=0", "checkpoint.resume=none", "model.lora.r=0"]


def child_env(args):
    return {**os.environ, "OMP_WAIT_POLICY": args.omp_wait_policy, "PYTHONPATH": ROOT,
            "TOKENIZERS_PARALLELISM": "false"}


# ---- the two systems and the evaluation ---------------------------------------------------------

def run_megagrpo(args, overrides, work):
    out = os.path.join(work, "megagrpo")
    cmd = [sys.executable, "-m", "megagrpo.train", "--config", args.config, *overrides, f"output_dir={out}"]
    run = run_measured(cmd, child_env(args), os.path.join(work, "megagrpo.log"))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    steps = [r["train/time/step"] for r in rows if "train/time/step" in r]
    phases = {k.rsplit("/", 1)[1]: sum(r[k] for r in rows if k in r) / len(steps)
              for k in sorted({k for r in rows for k in r if k.startswith("train/time/") and k != "train/time/step"})}
    ready = next((r["startup/total_s"] for r in rows if "startup/total_s" in r), None)
    shutil.rmtree(os.path.join(out, "checkpoints"))  # DeepSpeed's state, GBs; the bench needs hf/ only
    return {**run, "step_s": steps, "ready_s": ready, "phase_mean_s": phases,
            "train_reward": [r["train/reward"] for r in rows if "train/reward" in r],
            "completion_length": [r["train/completions/mean_length"] for r in rows
                                  if "train/completions/mean_length" in r],
            "final_model": os.path.join(out, "hf")}


def run_trl(args, cfg, work):
    out = os.path.join(work, "trl")
    spec = {"model": args.model, "train_file": cfg.data.train_file,
            "system_prompt": cfg.data.system_prompt, "final_model": os.path.join(out, "final"),
            "result": os.path.join(work, "trl_result.json"),
            "grpo_config": trl_config(cfg, args, out)}
    spec_path = os.path.join(work, "trl_spec.json")
    json.dump(spec, open(spec_path, "w"), indent=1)
    run = run_measured([sys.executable, os.path.abspath(__file__), "--trl-worker", spec_path], child_env(args),
                       os.path.join(work, "trl.log"))
    result = json.load(open(spec["result"]))
    return {**run, "step_s": result["step_s"], "ready_s": result["train_begin"] - run["start"],
            "train_reward": result["train_reward"], "completion_length": result["completion_length"],
            "logged_step_time": result["logged_step_time"], "final_model": spec["final_model"]}


def evaluate(args, model, overrides, data, out):
    """Held-out metrics of an HF folder, greedy, by `megagrpo eval` (the same code for every model)."""
    cmd = [sys.executable, "-m", "megagrpo.cli", "eval", "--model", model, "--data", f"{data}/eval.jsonl",
           "--config", args.config, "--output", out, *overrides]
    run_measured(cmd, child_env(args), out + ".log")
    return json.load(open(os.path.join(out, "eval_results.json")))


# ---- main ---------------------------------------------------------------------------------------

def main():
    default_config = "configs/smollm2_reasoning.yaml"
    if not os.path.isfile(os.path.join(ROOT, default_config)):
        default_config = "configs/tiny_arith.yaml"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trl-worker", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("--model", default="runs/smollm2/model", help="HF folder (tools/get_model.py writes it when absent)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the config's model.dtype")
    p.add_argument("--task", default="chain_sum", help="reasoning-gym task (default chain_sum)")
    p.add_argument("--task-args", default=QUICKSTART_TASK_ARGS,
                   help="the task's options as JSON (tools/prepare_data.py; default: the quickstart's)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--generations", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--learning-rate", type=float, help="default: the config's grpo.learning_rate")
    p.add_argument("--kl-coef", type=float, help="megagrpo grpo.kl_coef, TRL beta (default: the config's)")
    p.add_argument("--temperature", type=float, help="default: the config's rollout.temperature")
    p.add_argument("--loss-type", default=None, help="default: the megagrpo config's grpo.loss_type")
    p.add_argument("--seed", type=int, default=0, help="the data's seed (the trainers use the config's grpo.seed)")
    p.add_argument("--train-size", type=int, default=None, help="training prompts (default steps x prompts-per-step)")
    p.add_argument("--eval-size", type=int, default=64, help="held-out prompts")
    p.add_argument("--config", default=default_config, help=f"megagrpo base config (default {default_config})")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS, help="which to run, in order")
    p.add_argument("--omp-wait-policy", default="ACTIVE", choices=["ACTIVE", "PASSIVE"])
    p.add_argument("--out-dir", default="runs/trl_side_by_side", help="runs, logs and data (emptied first)")
    p.add_argument("--json", default="bench/results/trl_side_by_side.json")
    args = p.parse_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker)

    args.model, work, args.json = map(os.path.abspath, (args.model, args.out_dir, args.json))
    os.chdir(ROOT)
    sys.path.insert(0, ROOT)
    args.train_size = args.train_size or args.steps * args.prompts_per_step
    shutil.rmtree(work, ignore_errors=True)
    data = os.path.join(work, "data")
    os.makedirs(data)
    n_train, n_eval = prepare(args, data)
    from megagrpo.validation import load_config
    overrides = common_overrides(args, data)
    system_prompt = load_config(args.config, overrides).data.system_prompt
    longest = longest_prompt(args.model, data, system_prompt)
    overrides.append(f"data.max_prompt_length={longest}")
    cfg = load_config(args.config, overrides)
    print(f"{args.task}: {n_train} training prompts, {n_eval} held out (longest prompt {longest} tokens); "
          f"{args.steps} steps of {args.prompts_per_step} prompts x {args.generations}, {args.max_new_tokens} "
          f"new tokens, lr {cfg.grpo.learning_rate}, kl {cfg.grpo.kl_coef}, temperature {cfg.rollout.temperature}, "
          f"loss {cfg.grpo.loss_type}, "
          f"{cfg.model.dtype}, OMP_WAIT_POLICY={args.omp_wait_policy}", flush=True)

    eval_overrides = [o for o in overrides if not o.startswith("model.name_or_path=")]
    results = {"settings": {**{k: v for k, v in vars(args).items() if k != "trl_worker"},
                            "train_prompts": n_train, "eval_prompts": n_eval, "loss_type": cfg.grpo.loss_type,
                            "trl_config": trl_config(cfg, args, "<out>")}}
    print("evaluating the base model ...", flush=True)
    results["base_eval"] = evaluate(args, args.model, eval_overrides, data,
                                    os.path.join(work, "eval_base"))
    for system in args.systems:
        print(f"training with {system} ...", flush=True)
        run = run_trl(args, cfg, work) if system == "trl" else run_megagrpo(args, overrides, work)
        run["eval"] = evaluate(args, run["final_model"], eval_overrides, data, os.path.join(work, f"eval_{system}"))
        results[system] = {**run, "mean_step_s": mean_after_first(run["step_s"]), "first_step_s": run["step_s"][0],
                           "train_reward_mean": mean(run["train_reward"]),
                           "completion_length_mean": mean(run["completion_length"]),
                           "eval_after": run["eval"][REWARD]}
    if len(args.systems) == 2:
        results["ratios_megagrpo_over_trl"] = {key: results["megagrpo"][key] / results["trl"][key]
                                               for key in RATIOS if results["trl"][key] and results["megagrpo"][key]}

    print_table(results, args.systems)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"-> {args.json}  (runs and logs: {work})")


if __name__ == "__main__":
    main()
