"""LoRA against full fine-tuning: per-rank model-state memory (measured, and planned by
`megagrpo plan`), the step's time, and the weight sync's (every weight, against the adapted
layers only).

    python bench/lora.py                       # the tiny model and a 4-layer Qwen2.5-0.5B-shaped one
    python bench/lora.py --models tiny --rank 8

Models are built locally with random weights (tools/make_tiny_model.py; `--shape qwen2.5-0.5b
--layers 4`: 196M parameters, the real hidden size and 151,936-token vocabulary). Each (model,
policy) runs in 2 ranks under the deepspeed launcher, ZeRO-3, float32, kl_coef 0.04: each rank
builds the policy engine as the trainer does, sums the bytes of every live tensor before and
after (parameters, gradients, optimizer state, master copies and, for full fine-tuning, the
reference model), times the reference pass and the update on a fixed synthetic batch (8
sequences of 96 tokens per step), then builds its vLLM engine and times the sync of every
weight and of what a LoRA step changes. Prints a table with ratios to full fine-tuning and
writes JSON (bench/results/lora.json).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.parallel_memory import live_tensor_bytes  # noqa: E402

MODELS = {"tiny": [], "qwen2.5-0.5b-4l": ["--shape", "qwen2.5-0.5b", "--layers", "4"]}
SEQUENCES, LENGTH, STEPS = 8, 96, 3


def _config(model, data, rank):
    from megagrpo.validation import load_config
    return load_config(os.path.join(ROOT, "configs/tiny_arith.yaml"), [
        f"model.name_or_path={model}", f"data.train_file={data}", "data.eval_file=null", "grpo.kl_coef=0.04",
        "model.dtype=float32", "deepspeed=configs/ds_zero3.json", "grpo.per_device_train_batch_size=4",
        "grpo.num_generations=4", f"model.lora.r={rank}", "rollout.max_new_tokens=64", "rollout.cpu_kv_cache_gb=0.1",
        "data.max_prompt_length=32"])


def probe(model, out_dir, rank):
    """Runs inside each rank (under the deepspeed launcher)."""
    from megagrpo.cluster.distributed import init_distributed
    from megagrpo.policy import build_policy
    from megagrpo.policy.batch import Completion, make_batch
    from megagrpo.rollout.generators import VLLMGenerator
    from megagrpo.rollout.weight_sync import sync_weights

    topology = init_distributed()
    before = live_tensor_bytes()
    cfg = _config(model, os.path.join(out_dir, "data.jsonl"), rank)
    # small communication buckets, so that what is measured is the model state, not buffers
    cfg.deepspeed = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 10**6, "allgather_bucket_size": 10**6,
                                           "stage3_prefetch_bucket_size": 10**6,
                                           "stage3_param_persistence_threshold": 0, "contiguous_gradients": False}}
    policy = build_policy(cfg, topology, total_steps=10)
    sequences_per_rank = SEQUENCES // topology.dp_size
    gen = torch.Generator().manual_seed(topology.dp_rank)
    vocab = policy.engine.module.config.vocab_size
    prompts = [torch.randint(3, vocab, (32,), generator=gen).tolist() for _ in range(sequences_per_rank)]
    completions = [Completion(torch.randint(3, vocab, (LENGTH - 32,), generator=gen).tolist(),
                              [0.0] * (LENGTH - 32), False) for _ in range(sequences_per_rank)]
    batch = make_batch(prompts, completions, torch.randn(sequences_per_rank, generator=gen), pad_id=0)
    reference_s, update_s = [], []
    for _ in range(STEPS):
        micro_batches = policy.micro_batches(batch)
        start = time.perf_counter()
        batch.ref_logp = policy.logprobs(batch, micro_batches, reference=True)
        reference_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        policy.optimize(batch, micro_batches)
        update_s.append(time.perf_counter() - start)
    state = live_tensor_bytes() - before
    rollout = VLLMGenerator(cfg, model, seed=0)
    sync = {}
    for kind, changed_only in (("all", False), ("changed", True)):
        times = [sync_weights(policy.full_tensors(changed_only=changed_only), rollout, partial=changed_only)
                 for _ in range(3)]
        sync[kind] = min(times[1:])
    sent = {kind: sum(t.numel() for _, t in policy.full_tensors(changed_only=flag))
            for kind, flag in (("all", False), ("changed", True))}
    with open(os.path.join(out_dir, f"rank{topology.rank}.json"), "w") as f:
        json.dump({"state_bytes": state, "reference_s": min(reference_s[1:]), "update_s": min(update_s[1:]),
                   "sync_all_s": sync["all"], "sync_changed_s": sync["changed"],
                   "sent_all": sent["all"], "sent_changed": sent["changed"]}, f)
    torch.distributed.barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--probe", nargs=3, metavar=("MODEL", "OUT", "RANK"), help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--models", nargs="+", default=sorted(MODELS), choices=sorted(MODELS))
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--out", default="bench/results/lora.json")
    args = p.parse_args()
    if args.probe:
        return probe(args.probe[0], args.probe[1], int(args.probe[2]))

    from megagrpo.planning import make_plan
    work = tempfile.mkdtemp(prefix="megagrpo-lora-")
    subprocess.run([sys.executable, f"{ROOT}/tools/make_demo_data.py", "--out", os.path.join(work, "data")],
                   check=True, stdout=subprocess.DEVNULL)
    rows = []
    for name in args.models:
        model = os.path.join(work, name)
        subprocess.run([sys.executable, f"{ROOT}/tools/make_tiny_model.py", "--out", model, *MODELS[name],
                        "--corpus", os.path.join(work, "data", "sft.jsonl")], check=True, stdout=subprocess.DEVNULL)
        for policy, rank in (("full", 0), (f"lora r{args.rank}", args.rank)):
            out = os.path.join(work, f"{name}-{rank}")
            os.makedirs(out)
            with open(os.path.join(out, "data.jsonl"), "w") as f:
                f.write('{"prompt": "1 + 1", "answer": "2"}\n' * 64)
            subprocess.run([os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2",
                            "--master_port", "29578", os.path.abspath(__file__), "--probe", model, out, str(rank)],
                           check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "PYTHONPATH": ROOT})
            measured = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
            os.environ["WORLD_SIZE"] = "2"
            plan = make_plan(_config(model, os.path.join(out, "data.jsonl"), rank), 2)
            rows.append({"model": name, "policy": policy, "params": plan.params_total, "trained": plan.params_trained,
                         "planned_bytes": sum(plan.bytes_per_rank[k]
                                              for k in ("params", "grads", "optimizer", "reference")),
                         **{k: max(m[k] for m in measured) for k in measured[0]}})
    print(f"\n{'model':<17}{'policy':<9}{'trained':>10}{'state MiB':>11}{'plan MiB':>10}{'vs full':>8}"
          f"{'ref s':>7}{'update s':>9}{'vs full':>8}{'sync all s':>11}{'sync changed s':>15}{'changed/all':>12}")
    for r in rows:
        full = next(f for f in rows if f["model"] == r["model"] and f["policy"] == "full")
        r["state_vs_full"] = r["state_bytes"] / full["state_bytes"]
        r["plan_over_measured"] = r["planned_bytes"] / r["state_bytes"]
        r["step_vs_full"] = (r["reference_s"] + r["update_s"]) / (full["reference_s"] + full["update_s"])
        r["sync_changed_over_all"] = r["sync_changed_s"] / r["sync_all_s"]
        print(f"{r['model']:<17}{r['policy']:<9}{r['trained'] / 1e6:>9.2f}M{r['state_bytes'] / 2**20:>11.1f}"
              f"{r['planned_bytes'] / 2**20:>10.1f}{r['state_vs_full']:>8.2f}{r['reference_s']:>7.2f}"
              f"{r['update_s']:>9.2f}{r['step_vs_full']:>8.2f}{r['sync_all_s']:>11.3f}{r['sync_changed_s']:>15.3f}"
              f"{r['sync_changed_over_all']:>12.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
