"""Launch overhead on the tiny model: from the launcher's start to the first GRPO step, for
each way of starting 2 ranks on this machine.

    python bench/launch_overhead.py [--tiny runs/tiny] [--repeats 1]

  deepspeed   `deepspeed --num_gpus 2 --module megagrpo.train` (no script, the floor)
  local       launch/train.sh, one-host hostfile: hostfile check + config validation, then the
              deepspeed runner starts both ranks here
  pdsh        launch/train.sh over hostfiles/localhost_pair: ssh probe of both hosts, then
              pdsh starts one rank per "node" over a real sshd on 127.0.0.1
  slurm       sbatch launch/slurm.sbatch (srun, 2 tasks) on a one-node SLURM cluster
              (munged, slurmctld, slurmd started here); measured from sbatch
  mpirun      launch/mpirun.sh: mpirun starts 2 ranks, mpi4py discovery
"first step" is when rank 0 writes the first line of prompts_seen.jsonl (step 1 has begun:
every rank has built its model, its rollout engine and the process group). The daemons are
started before the clock and stopped at the end. Prints a table, writes JSON to bench/results/.
The machine is shared: numbers move with its load; compare rows of one run.
"""
import argparse
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


def ensure_tiny(tiny):
    if os.path.isfile(os.path.join(tiny, "warm", "config.json")):
        return
    py = sys.executable
    subprocess.run([py, "tools/make_demo_data.py", "--out", f"{tiny}/data"], cwd=ROOT, check=True)
    subprocess.run([py, "tools/make_tiny_model.py", "--out", f"{tiny}/model", "--corpus",
                    f"{tiny}/data/sft.jsonl"], cwd=ROOT, check=True)
    subprocess.run([py, "tools/warm_start.py", "--model", f"{tiny}/model", "--data",
                    f"{tiny}/data/sft.jsonl", "--out", f"{tiny}/warm"], cwd=ROOT, check=True)


def overrides(tiny, out):
    return [f"model.name_or_path={tiny}/warm", f"data.train_file={tiny}/data/train.jsonl",
            "data.eval_file=", f"output_dir={out}", "logging.progress_bar=false",
            "rollout.engine=hf", "grpo.max_steps=2", "grpo.per_device_train_batch_size=16",
            "checkpoint.save_hf_at_end=false"]


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
    args = p.parse_args()
    tiny = os.path.abspath(args.tiny)
    ensure_tiny(tiny)
    work = tempfile.mkdtemp(prefix="megagrpo-launch-bench-")
    results = {}
    with daemons.sshd(f"{work}/sshd") as ssh_env, daemons.slurm_cluster(f"{work}/slurm") as slurm_env:
        def slurm_done(log):
            job = log.split()[-1] if log.split() else ""
            state = subprocess.run(["scontrol", "show", "job", job], env={**os.environ, **slurm_env},
                                   capture_output=True, text=True).stdout
            return "JobState=COMPLETED" in state or "JobState=FAILED" in state

        for repeat in range(args.repeats):
            for name in ("deepspeed", "local", "pdsh", "slurm", "mpirun"):
                out = f"{work}/{name}-{repeat}"
                port = str(daemons.free_port())
                wait_job = None
                if name == "deepspeed":
                    cmd, env = [f"{BIN}/deepspeed", "--num_gpus", "2", "--master_port", port, "--module",
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
                results.setdefault(name, []).append({"first_step_s": round(first, 2), "total_s": round(total, 2)})
                print(f"  {name}: first step after {first:.1f} s, done after {total:.1f} s", flush=True)

    rows = {name: {key: min(r[key] for r in runs) for key in ("first_step_s", "total_s")}
            for name, runs in results.items()}
    floor = rows["deepspeed"]["first_step_s"]
    print(f"\n{'launcher':<10} {'to first step':>14} {'vs deepspeed':>13} {'2 steps, total':>15}")
    for name, row in rows.items():
        print(f"{name:<10} {row['first_step_s']:>12.1f} s {row['first_step_s'] / floor:>12.2f}x "
              f"{row['total_s']:>13.1f} s")
    load = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"ranks": 2, "model": "tiny Qwen2 (tools/make_tiny_model.py)", "rollout": "hf",
                   "best_of_repeats": rows, "runs": results, "load_average_after": load,
                   "cpus": os.cpu_count()}, f, indent=2)
    print(f"\nwrote {args.out} (load average after: {load[0]:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
