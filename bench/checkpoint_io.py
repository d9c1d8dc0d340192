"""Checkpoint save/load time and bytes, and offline conversion throughput and peak memory.

    python bench/checkpoint_io.py            # the tiny model and a ~100M-parameter Qwen2

For each model (built locally, float32): a one-rank ZeRO-3 DeepSpeed engine as the trainer
builds it saves a checkpoint with megagrpo's atomic save and loads it back (timed, bytes on
disk); then `megagrpo convert to-hf` runs in a fresh process, timed, with its peak RSS (the
process's ru_maxrss) next to the largest tensor and one output shard (goal: peak <= largest
tensor + one shard + 20%, above the interpreter's own baseline, measured by `convert --help`
in the same way); then `convert hf-to-pipeline` rewrites that HF folder as 2 stage files, timed
with its peak RSS. Prints a table and writes JSON.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = {"tiny": ["--hidden-size", "128", "--layers", "2", "--heads", "2", "--kv-heads", "2",
                   "--intermediate-size", "384", "--vocab-size", "512"],
          "100M": ["--hidden-size", "768", "--layers", "12", "--heads", "12", "--kv-heads", "12",
                   "--intermediate-size", "3072", "--vocab-size", "32000"]}
SHARD_MB = 64


def _peak_rss_mb(cmd) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of one child process (its own rusage, from wait4)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": ROOT})
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} exited {proc.returncode}")
    return time.perf_counter() - start, usage.ru_maxrss / 1024


def save_and_load(model_dir, ckpt_root):
    """Runs in a child: build the engine, save, load; print JSON."""
    import torch

    from megagrpo.checkpoints import checkpoint
    from megagrpo.cluster.distributed import init_distributed
    from megagrpo.policy import build_policy
    from megagrpo.validation import load_config

    topology = init_distributed()
    data = os.path.join(ckpt_root, "data.jsonl")
    with open(data, "w") as f:
        f.write('{"prompt": "1 + 1", "answer": "2"}\n' * 8)
    cfg = load_config(os.path.join(ROOT, "configs/tiny_arith.yaml"), [
        f"model.name_or_path={model_dir}", f"data.train_file={data}", "data.eval_file=null",
        "model.dtype=float32", "grpo.kl_coef=0"])
    policy = build_policy(cfg, topology, total_steps=10)
    engine = policy.engine
    loss = engine(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.float().mean()
    engine.backward(loss)  # one step, so that the optimizer state (Adam moments) exists
    engine.step()
    start = time.perf_counter()
    state = checkpoint.TrainerState(step=1, sampler={}, world_size=1, dp_size=1, num_prompts=8, total_steps=10,
                                    prompts_per_step=1, model=model_dir)
    path = checkpoint.save(policy, ckpt_root, state, 2, topology)
    save_s = time.perf_counter() - start
    start = time.perf_counter()
    checkpoint.load(engine, path, 0)
    load_s = time.perf_counter() - start
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    largest = max(p.ds_numel for p in engine.module.parameters()) * 4
    params = sum(p.ds_numel for p in engine.module.parameters())
    print(json.dumps({"path": path, "save_s": save_s, "load_s": load_s, "bytes": size,
                      "largest_tensor_bytes": largest, "params": params, "torch": torch.__version__}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--out", default="bench/results/checkpoint_io.json")
    args = p.parse_args()
    if args.child:
        return save_and_load(*args.child)
    work = tempfile.mkdtemp(prefix="megagrpo-ckpt-")
    rows = []
    _, baseline_mb = _peak_rss_mb([sys.executable, "-m", "megagrpo.cli", "convert", "--help"])
    for name, shape in MODELS.items():
        model = os.path.join(work, name)
        subprocess.run([sys.executable, f"{ROOT}/tools/make_tiny_model.py", "--out", model, *shape],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        root = os.path.join(work, f"{name}_ckpt")
        os.makedirs(root)
        child = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model, root],
                               check=True, capture_output=True, text=True, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": ROOT})
        r = json.loads(child.stdout.strip().splitlines()[-1])
        out = os.path.join(work, f"{name}_hf")
        convert_s, peak_mb = _peak_rss_mb([sys.executable, "-m", "megagrpo.cli", "convert", "to-hf",
                                           r["path"], out, "--shard-mb", str(SHARD_MB)])
        written = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
        staged = os.path.join(work, f"{name}_pp2")
        staged_s, staged_peak_mb = _peak_rss_mb([sys.executable, "-m", "megagrpo.cli", "convert",
                                                 "hf-to-pipeline", out, staged, "--pipeline-parallel-size", "2"])
        budget_mb = (r["largest_tensor_bytes"] / 2**20 + SHARD_MB) * 1.2
        rows.append({"model": name, "params": r["params"], "checkpoint_bytes": r["bytes"],
                     "save_s": r["save_s"], "load_s": r["load_s"], "convert_s": convert_s,
                     "convert_gb_per_s": written / 1e9 / convert_s, "peak_rss_mb": peak_mb,
                     "peak_over_baseline_mb": peak_mb - baseline_mb, "budget_mb": budget_mb,
                     "baseline_mb": baseline_mb, "hf_to_pipeline_s": staged_s,
                     "hf_to_pipeline_gb_per_s": written / 1e9 / staged_s,
                     "hf_to_pipeline_peak_over_baseline_mb": staged_peak_mb - baseline_mb})
    print(f"\n{'model':<6}{'params':>10}{'ckpt MB':>9}{'save s':>8}{'load s':>8}{'conv s':>8}"
          f"{'GB/s':>7}{'peak-base MB':>14}{'budget MB':>11}{'pp2 s':>7}{'pp2 GB/s':>9}{'pp2 peak-base':>14}")
    for r in rows:
        print(f"{r['model']:<6}{r['params'] / 1e6:>9.1f}M{r['checkpoint_bytes'] / 1e6:>9.1f}"
              f"{r['save_s']:>8.2f}{r['load_s']:>8.2f}{r['convert_s']:>8.2f}{r['convert_gb_per_s']:>7.2f}"
              f"{r['peak_over_baseline_mb']:>14.0f}{r['budget_mb']:>11.0f}{r['hf_to_pipeline_s']:>7.2f}"
              f"{r['hf_to_pipeline_gb_per_s']:>9.2f}{r['hf_to_pipeline_peak_over_baseline_mb']:>14.0f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
