"""Launch overhead on the tiny model: from the launcher's start to the first GRPO step, for
each way of starting 2 ranks on this machine.

    python bench/launch_overhead.py [--tiny runs/tiny] [--repeats 1]

  deepspeed   `deepspeed --num_gpus 2 --module megagrpo.train` (no script, the README's way)
  torchrun    `torchrun --nproc_per_node 2 -m megagrpo.train` (how the suite's layout tests start ranks)
  local       launch/train.sh, one-host hostfile: hostfile check + config validation, then the
              deepspeed runner starts both ranks here
  pdsh        launch/train.sh over hostfiles/localhost_pair: ssh probe of both hosts, then
              pdsh starts one rank per "node" over a real sshd on 127.0.0.1
  slurm       sbatch launch/slurm.sbatch (srun, 2 tasks) on a one-node SLURM cluster
              (munged, slurmctld, slurmd started here); measured from sbatch
  mpirun      launch/mpirun.sh: mpirun starts 2 ranks, mpi4py discovery
  quickstart  the quickstart's own job: `deepspeed --num_gpus 2`, vLLM co-located, held-out
              evaluation before the first step (the other rows generate with transformers)
"first step" is when rank 0 writes the first line of prompts_seen.jsonl (step 1 has begun:
every rank has built its model, its rollout engine and the process group); "ready" is the
trainer's own start-up timeline (metrics.jsonl startup/*: the slowest rank's seconds per phase
from its process start to its first rollout), printed per phase. The daemons are
started before the clock and stopped at the end. Prints a table, writes JSON to bench/results/.
The machine is shared: numbers move with its load; compare rows of one run.
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
import daemons  # noqa: E402

BIN = os.path.dirname(sys.executable)
LAUNCHERS = ["quickstart", "deepspeed", "torchrun", "local", "pdsh", "slurm", "mpirun"]


def ensure_tiny(tiny):
    if os.path.isfile(os.path.join(tiny, "warm", "config.json")):
        return
    py = sys.executable
    subprocess.run([py, "tools/make_demo_data.py", "--out", f"{tiny}/data"], cwd=ROOT, check=True)
    subprocess.run([py, "tools/make_tiny_model.py", "--out", f"{tiny}/model", "--corpus",
                    f"{tiny}/data/sft.jsonl"], cwd=ROOT, check=True)
    subprocess.run([py, "tools/warm_start.py", "--model", f"{tiny}/model", "--data",
                    f"{tiny}/data/sft.jsonl", "--out", f"{tiny}/warm"], cwd=ROOT, check=True)


def overrides(tiny, out, quickstart=False):
    common = [f"model.name_or_path={tiny}/warm", f"data.train_file={tiny}/data/train.jsonl", f"output_dir={out}",
              "logging.progress_bar=false", "grpo.max_steps=2", "checkpoint.save_hf_at_end=false"]
    if quickstart:
        return common + [f"data.eval_file={tiny}/data/eval.jsonl", "checkpoint.resume=none"]
    return common + ["data.eval_file=", "rollout.engine=hf", "grpo.per_device_train_batch_size=16"]


def startup_phases(out):
    """The trainer's start-up timeline (startup/<phase>_s) from metrics.jsonl."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "startup/total_s" in row:
                return {k[len("startup/"):-2]: round(v, 2) for k, v in row.items() if k.startswith("startup/")}
    return {}


def timed_launch(cmd, env, out, wait_job=None):
    """Seconds to the first step and to the end; wait_job(stdout) waits for a batch job."""
    log = open(f"{out}.log", "w")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, **env},
                            stdout=log, stderr=subprocess.STDOUT)
    first = None
    seen = os.path.join(out, "prompts_seen.jsonl")
    while True:
        if first is None and os.path.exists(seen) and os.path.getsize(seen) > 0:
            first = time.perf_counter() - start
        if proc.poll() is not None and (wait_job is None or wait_job(open(f"{out}.log").read())):
            if first is None and os.path.exists(seen) and os.path.getsize(seen) > 0:
                first = time.perf_counter() - start
            break
        time.sleep(0.05 if first is None else 0.5)
    total = time.perf_counter() - start
    if proc.returncode != 0 or first is None:
        raise RuntimeError(f"{cmd[:3]} failed ({proc.returncode}); see {out}.log")
    return first, total


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", default=os.path.join(ROOT, "runs", "tiny"))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "launch_overhead.json"))
    p.add_argument("--only", nargs="*", default=LAUNCHERS, choices=LAUNCHERS, help="launchers to time")
    args = p.parse_args()
    tiny = os.path.abspath(args.tiny)
    ensure_tiny(tiny)
    work = tempfile.mkdtemp(prefix="megagrpo-launch-bench-")
    results = {}
    sshd = daemons.sshd(f"{work}/sshd") if "pdsh" in args.only else contextlib.nullcontext({})
    slurm = daemons.slurm_cluster(f"{work}/slurm") if "slurm" in args.only else contextlib.nullcontext({})
    with sshd as ssh_env, slurm as slurm_env:
        def slurm_done(log):
            job = log.split()[-1] if log.split() else ""
            state = subprocess.run(["scontrol", "show", "job", job], env={**os.environ, **slurm_env},
                                   capture_output=True, text=True).stdout
            return "JobState=COMPLETED" in state or "JobState=FAILED" in state

        for repeat in range(args.repeats):
            for name in args.only:
                out = f"{work}/{name}-{repeat}"
                port = str(daemons.free_port())
                wait_job = None
                if name in ("quickstart", "deepspeed"):
                    cmd, env = [f"{BIN}/deepspeed", "--num_gpus", "2", "--master_port", port, "--module",
                                "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                                *overrides(tiny, out, quickstart=name == "quickstart")], {}
                elif name == "torchrun":
                    cmd, env = [f"{BIN}/torchrun", "--nproc_per_node", "2", "--master_port", port, "-m",
                                "megagrpo.train", "--config", "configs/tiny_arith.yaml", *overrides(tiny, out)], {}
                elif name == "local":
                    cmd = ["bash", "launch/train.sh", *overrides(tiny, out)]
                    env = {"HOSTFILE": "hostfiles/localhost_2", "MASTER_PORT": port}
                elif name == "pdsh":
                    cmd = ["bash", "launch/train.sh", *overrides(tiny, out)]
                    env = {**ssh_env, "HOSTFILE": "hostfiles/localhost_pair", "MASTER_PORT": port}
                elif name == "slurm":
                    cmd = ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
                           "--gpus-per-node=0", f"--output={out}.job.log", f"--export=ALL,MASTER_PORT={port}",
                           "launch/slurm.sbatch", *overrides(tiny, out)]
                    env, wait_job = slurm_env, slurm_done
                else:
                    cmd = ["bash", "launch/mpirun.sh", *overrides(tiny, out)]
                    env = {"HOSTFILE": "hostfiles/localhost_2", "MASTER_PORT": port}
                first, total = timed_launch(cmd, env, out, wait_job)
                phases = startup_phases(out)
                results.setdefault(name, []).append({"first_step_s": round(first, 2), "total_s": round(total, 2),
                                                     "startup": phases})
                print(f"  {name}: first step after {first:.1f} s, done after {total:.1f} s; ready in "
                      f"{phases.get('total', 0):.1f} s: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()
                                                                    if k != "total"), flush=True)

    rows = {}
    for name, runs in results.items():
        best = min(runs, key=lambda r: r["first_step_s"])
        rows[name] = {"first_step_s": best["first_step_s"], "total_s": min(r["total_s"] for r in runs),
                      "startup": best["startup"]}
    floor = rows.get("deepspeed", next(iter(rows.values())))["first_step_s"]
    print(f"\n{'launcher':<10} {'to first step':>14} {'vs deepspeed':>13} {'2 steps, total':>15}")
    for name, row in rows.items():
        print(f"{name:<10} {row['first_step_s']:>12.1f} s {row['first_step_s'] / floor:>12.2f}x "
              f"{row['total_s']:>13.1f} s")
    phases = list(dict.fromkeys(p for row in rows.values() for p in row["startup"]))
    print("\nstart-up per phase (the slowest rank's seconds from its process start; launcher not included)")
    print(f"{'launcher':<10} " + " ".join(f"{p[:13]:>13}" for p in phases))
    for name, row in rows.items():
        print(f"{name:<10} " + " ".join(f"{row['startup'].get(p, 0):>13.1f}" for p in phases))
    load = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"ranks": 2, "model": "tiny Qwen2 (tools/make_tiny_model.py)",
                   "rollout": "vllm (quickstart), hf (the others)",
                   "best_of_repeats": rows, "runs": results, "load_average_after": load,
                   "cpus": os.cpu_count()}, f, indent=2)
    print(f"\nwrote {args.out} (load average after: {load[0]:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
