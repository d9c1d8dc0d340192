"""OpenMP's wait policy with several CPU ranks per node: the same GRPO job with libgomp's
threads spinning (OMP_WAIT_POLICY=ACTIVE, libgomp's default) and sleeping (PASSIVE, what
`import megagrpo` sets unless the user did; docs/cpu-stack.md).

    python bench/omp_wait_policy.py [--tiny runs/tiny] [--layouts 2x1 4x2]

A layout RANKSxTP is `deepspeed --num_gpus RANKS` with ZeRO-3 and AutoTP tp TP on the tiny
model, vLLM co-located, 2 steps of 16 completions per rank. Per layout and policy: the job's
wall time, the trainer's start-up ("ready", metrics.jsonl startup/*), the first and second
step (train/time/step), and whether the exported weights are byte-identical to the other
policy's. Prints a table with passive/active ratios, writes JSON to bench/results/.
"""
import argparse
import filecmp
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_overhead import ROOT, ensure_tiny  # noqa: E402

BIN = os.path.dirname(sys.executable)


def run_job(tiny, out, ranks, tp, policy):
    cmd = [f"{BIN}/deepspeed", "--num_gpus", str(ranks), "--master_port", str(29600 + ranks * 10 + tp),
           "--module", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
           f"model.name_or_path={tiny}/warm", f"data.train_file={tiny}/data/train.jsonl", "data.eval_file=null",
           f"output_dir={out}", "logging.progress_bar=false", "grpo.max_steps=2", "logging.sample_steps=0",
           "checkpoint.save_steps=0", "grpo.per_device_train_batch_size=16", f"parallel.tensor_parallel_size={tp}",
           "deepspeed=configs/ds_zero3.json"]
    env = {**os.environ, "OMP_WAIT_POLICY": policy, "DS_ACCELERATOR": "cpu", "PYTHONPATH": ROOT}
    start = time.time()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    wall = time.time() - start
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r["train/time/step"] for r in rows if "train/time/step" in r]
    ready = next(r["startup/total_s"] for r in rows if "startup/total_s" in r)
    return {"wall_s": round(wall, 1), "ready_s": round(ready, 1), "step1_s": round(steps[0], 2),
            "step2_s": round(steps[1], 2)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", default=os.path.join(ROOT, "runs", "tiny"))
    p.add_argument("--layouts", nargs="+", default=["2x1", "4x2"], help="RANKSxTP, e.g. 4x2")
    args = p.parse_args()
    ensure_tiny(args.tiny)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts:
            ranks, tp = map(int, layout.split("x"))
            outs = {policy: os.path.join(tmp, f"{layout}_{policy}") for policy in ("ACTIVE", "PASSIVE")}
            row = {"layout": f"{ranks} ranks, tp {tp}"}
            for policy, out in outs.items():
                row[policy.lower()] = run_job(args.tiny, out, ranks, tp, policy)
            row["identical_weights"] = filecmp.cmp(*(os.path.join(o, "hf", "model.safetensors")
                                                     for o in outs.values()), shallow=False)
            results.append(row)
    print("| layout | policy | wall (s) | ready (s) | step 1 (s) | step 2 (s) | exported weights |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in results:
        for policy in ("active", "passive"):
            r = row[policy]
            cells = [row["layout"], policy, r["wall_s"], r["ready_s"], r["step1_s"], r["step2_s"], ""]
            print("| " + " | ".join(map(str, cells)) + " |")
        ratio = row["passive"]["wall_s"] / row["active"]["wall_s"]
        same = "identical" if row["identical_weights"] else "DIFFERENT"
        print(f"| {row['layout']} | passive / active | {ratio:.2f}x | | | | {same} |")
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    path = os.path.join(ROOT, "bench", "results", "omp_wait_policy.json")
    json.dump(results, open(path, "w"), indent=1)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
