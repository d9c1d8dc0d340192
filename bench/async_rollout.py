"""Overlap of generation and training: co-located engines against an external `vllm serve` with
rollout.max_staleness 0, 1 and 2, and against a generating rank in the job (rollout.placement
disaggregated, a third rank) with 0, 1 and 2, side by side in one run, 2 trainer ranks each (torchrun).

    python bench/async_rollout.py --agent-run runs/agent --arith-run runs/tiny [--steps 8] [--tasks single-turn]

Tasks: the agentic quickstart's (AGENT=1 bash launch/quickstart.sh builds runs/agent), its
`python` tool replaced by a stand-in for a remote API that answers after --tool-wait-s (0.2 s)
without using CPU (bench/remote_tools.py), so a rollout waits on tools; and the single-turn
arithmetic quickstart (runs/tiny, --arith-steps 40 as the quickstart trains), which is
compute-bound, with its held-out accuracy before and after (does staleness cost learning?); and
a long-tailed single-turn task: the same prompts on the random tiny model (runs/tiny/model),
which seldom stops, so completions run from a few tokens to 448 and a batch lasts as long as
its longest, against servers with and without rollout.partial_rollouts (an update does not wait
for the longest). Per
row, over the steps after the
first: seconds per step, the trainer's idle share (waiting for its batch, or for the batches in
flight before an update), the generator's busy share (the seconds the step's batch took to
sample, over the step), the largest staleness, and the weight update's seconds. The server
is a third process on the same cores: on a 2-core machine compute-bound rows cannot gain, and
only the waiting-bound rows can show the overlap. Prints a table, writes JSON.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
sys.path.insert(0, ROOT)
import daemons  # noqa: E402

from megagrpo.cluster.distributed import free_port  # noqa: E402

SERVER_ARGS = ("--weight-transfer-config", '{"backend": "gloo"}', "--logprobs-mode", "processed_logprobs",
               "--no-enable-chunked-prefill", "--enable-scale-out")


class Task(NamedTuple):
    run: str               # folder with data/ and the model folder
    model: str             # the model folder in it: warm (warm-started) or model (random)
    config: str
    steps: int
    evaluate: bool         # held-out accuracy before and after
    extra: list            # overrides of every row
    env: dict
    variants: list         # the server rows: (name, overrides)
    generating_rank: bool  # also rows with a generating rank in the job


def train(config: str, model: str, run: str, out: str, steps: int, *overrides: str, env=None, evaluate=False,
          ranks: int = 2) -> list[dict]:
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", str(ranks), "--master_port",
           str(free_port()), "-m", "megagrpo.train", "--config", config, f"model.name_or_path={run}/{model}",
           f"data.train_file={run}/data/train.jsonl",
           f"data.eval_file={run}/data/eval.jsonl" if evaluate else "data.eval_file=null", f"output_dir={out}",
           f"grpo.max_steps={steps}", "checkpoint.save_steps=0", "checkpoint.save_hf_at_end=false",
           "logging.sample_steps=0", "logging.progress_bar=false", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"train/loss"' in line]
    if evaluate:
        results = json.load(open(os.path.join(out, "eval_results.json")))
        rows[-1]["held_out"] = {when: results[when]["rewards/answer_match"] for when in ("before", "after")}
    return rows


def summary(rows: list[dict]) -> dict:
    steady = rows[1:]  # the first step pays the first requests and compilations

    def mean(key):
        return statistics.mean(r.get(key, 0.0) for r in steady)
    step = mean("train/time/step")
    if "train/rollout/wait_s" in steady[0]:  # sampled ahead: the trainer waits for its batch, and before an update
        waited, sampling = mean("train/rollout/wait_s") + mean("train/time/rollout_ahead"), \
            mean("train/rollout/sampling_s")
    else:  # sampled in the step: the trainer waits for all of it
        waited = sampling = mean("train/time/rollout")
    return {"step_s": step, "trainer_idle": waited / step, "generator_busy": min(1.0, sampling / step),
            "staleness_max": max((r.get("train/rollout/staleness", 0) for r in rows), default=0),
            "weight_sync_s": mean("train/time/weight_sync"), "steps": len(steady),
            "held_out_accuracy": rows[-1].get("held_out")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agent-run", default="runs/agent", help="folder with warm/ and data/ of the agentic task")
    p.add_argument("--arith-run", default="runs/tiny", help="folder with warm/ and data/ of the arithmetic task")
    p.add_argument("--steps", type=int, default=8, help="steps of the agentic task")
    p.add_argument("--arith-steps", type=int, default=40,
                   help="steps of the single-turn task, with held-out accuracy before and after (the quickstart's 40)")
    p.add_argument("--tool-wait-s", type=float, default=0.2)
    p.add_argument("--work", default="bench/results/async_rollout_runs")
    p.add_argument("--out", default="bench/results/async_rollout.json")
    p.add_argument("--tasks", nargs="+", default=["agentic", "single-turn", "long-tail"],
                   choices=["agentic", "single-turn", "long-tail"])
    args = p.parse_args()
    staleness = [(f"max_staleness {k}", [f"rollout.max_staleness={k}"]) for k in (0, 1, 2)]
    partial = staleness[:2] + [(f"max_staleness {k}, partial", [f"rollout.max_staleness={k}",
                                                                 "rollout.partial_rollouts=true"]) for k in (1, 2)]
    tasks = {  # (the keys' first word is what --tasks names)
        "agentic, tool waits": Task(args.agent_run, "warm", "configs/tiny_agent.yaml", args.steps, False,
                                    ["rollout.tools=[{name: bench.remote_tools:python}]"],
                                    {"BENCH_TOOL_WAIT_S": str(args.tool_wait_s)}, staleness, True),
        "single-turn": Task(args.arith_run, "warm", "configs/tiny_arith.yaml", args.arith_steps, True, [], {},
                            staleness, True),
        # the random tiny model seldom stops: lengths from a few tokens to 448, a batch as long as its longest
        "long-tail, single-turn": Task(args.arith_run, "model", "configs/tiny_arith.yaml", args.steps, False,
                                       ["rollout.max_new_tokens=448", "grpo.per_device_train_batch_size=16"], {},
                                       partial, False),
    }
    results = []
    for task, (run, model, config, steps, evaluate, extra, env, variants, generating_rank) in tasks.items():
        if task.split(",")[0] not in args.tasks:
            continue
        work = os.path.join(args.work, task.split(",")[0].replace(" ", "_"))
        start = time.perf_counter()
        rows = train(config, model, run, f"{work}/colocated", steps, *extra, env=env, evaluate=evaluate)
        results.append({"task": task, "placement": "co-located", **summary(rows)})
        with daemons.vllm_server(f"{run}/{model}", work, *SERVER_ARGS) as url:
            for name, overrides in variants:
                rows = train(config, model, run, f"{work}/servers_{name.replace(' ', '_').replace(',', '')}", steps,
                             *extra, f"rollout.servers=[{url}]", *overrides, env=env, evaluate=evaluate)
                results.append({"task": task, "placement": f"server, {name}", **summary(rows)})
        for k in (0, 1, 2) if generating_rank else ():
            rows = train(config, model, run, f"{work}/generating_rank_k{k}", steps, *extra,
                         "rollout.placement=disaggregated", "rollout.ranks=1", f"rollout.max_staleness={k}", env=env,
                         evaluate=evaluate, ranks=3)
            results.append({"task": task, "placement": f"generating rank, max_staleness {k}", **summary(rows)})
        print(f"{task}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    base = {r["task"]: r["step_s"] for r in results if r["placement"] == "co-located"}
    header = f"{'task':<24}{'placement':<36}{'s/step':>8}{'vs co-loc':>10}{'trainer idle':>14}" \
             f"{'gen busy':>10}{'stale max':>10}{'sync s':>8}  held-out before -> after"
    print(header)
    for r in results:
        r["speedup_vs_colocated"] = base[r["task"]] / r["step_s"]
        print(f"{r['task']:<24}{r['placement']:<36}{r['step_s']:>8.2f}{r['speedup_vs_colocated']:>9.2f}x"
              f"{r['trainer_idle']:>13.0%}{r['generator_busy']:>10.0%}{r['staleness_max']:>10.0f}"
              f"{r['weight_sync_s']:>8.2f}  " + (f"{r['held_out_accuracy']['before']:.1%} -> "
                                                  f"{r['held_out_accuracy']['after']:.1%}"
                                                  if r["held_out_accuracy"] else "-"))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "arith_steps": args.arith_steps, "tool_wait_s": args.tool_wait_s,
                   "cpus": os.cpu_count(), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
