"""Per-rank model-state memory and step time per layout, measured in the ranks, next to the
planner's estimate (megagrpo plan).

    python bench/parallel_memory.py            # builds a ~27M-parameter Qwen2 locally

Layouts (float32): dp=1, dp=2, dp=4, tp=2 under ZeRO-3; pp=2 under ZeRO-1 (pipelines take
ZeRO 0-1), next to dp=2 under ZeRO-1; launched with the deepspeed launcher. Each rank builds
the policy engine exactly as the trainer does, runs optimizer steps on a fixed synthetic batch
(the same global batch in every layout: 32 sequences of 128 tokens; a pipeline runs it as 4
micro-batches through train_batch with the GRPO loss at the last stage), and sums
the bytes of every tensor alive in the process (deduplicated by storage) before the model is
built and after the step: parameters, gradients, optimizer state, master copies. Prints a
table with ratios to dp=1 and writes JSON.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# name, ranks, tp, pp, ZeRO stage
LAYOUTS = [("dp1", 1, 1, 1, 3), ("dp2", 2, 1, 1, 3), ("dp4", 4, 1, 1, 3), ("tp2", 2, 2, 1, 3),
           ("dp2-z1", 2, 1, 1, 1), ("pp2-z1", 2, 1, 2, 1)]
GLOBAL_SEQUENCES, SEQUENCE_LENGTH = 32, 128


def live_tensor_bytes() -> int:
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
                storage = obj.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        except Exception:  # noqa: BLE001 - objects that are half torn down
            continue
    return total


def _config(model, data, tp, pp, stage):
    from megagrpo.validation import load_config
    return load_config(os.path.join(ROOT, "configs/tiny_arith.yaml"), [
        f"model.name_or_path={model}", f"data.train_file={data}", "data.eval_file=null",
        "grpo.kl_coef=0", f"parallel.tensor_parallel_size={tp}",
        f"parallel.pipeline_parallel_size={pp}", f"deepspeed=configs/ds_zero{stage}.json",
        "model.dtype=float32", "grpo.per_device_train_batch_size=8"])


def probe(model, out_dir, tp, pp, stage):
    """Runs inside each rank (under the deepspeed launcher)."""
    from megagrpo.cluster.distributed import init_distributed
    from megagrpo.policy import build_policy
    from megagrpo.policy.batch import Completion, make_batch

    topology = init_distributed(tp_size=tp, pp_size=pp)
    before = live_tensor_bytes()
    cfg = _config(model, os.path.join(out_dir, "data.jsonl"), tp, pp, stage)
    # small communication buckets, so that what is measured is the model state, not buffers
    cfg.deepspeed = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 10**6,
                                           "allgather_bucket_size": 10**6,
                                           "stage3_prefetch_bucket_size": 10**6,
                                           "stage3_param_persistence_threshold": 0,
                                           "contiguous_gradients": False}}
    policy = build_policy(cfg, topology, total_steps=10)
    sequences_per_rank = GLOBAL_SEQUENCES // topology.dp_size
    gen = torch.Generator().manual_seed(topology.dp_rank)
    vocab = policy.engine.module.config.vocab_size
    prompts = [torch.randint(3, vocab, (32,), generator=gen).tolist() for _ in range(sequences_per_rank)]
    completions = [Completion(torch.randint(3, vocab, (SEQUENCE_LENGTH - 32,), generator=gen).tolist(),
                              [0.0] * (SEQUENCE_LENGTH - 32), False) for _ in range(sequences_per_rank)]
    batch = make_batch(prompts, completions, torch.randn(sequences_per_rank, generator=gen), pad_id=0)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        policy.optimize(batch, policy.micro_batches(batch))  # the GRPO update, whatever the layout
        times.append(time.perf_counter() - start)
    after = live_tensor_bytes()
    with open(os.path.join(out_dir, f"rank{topology.rank}.json"), "w") as f:
        json.dump({"state_bytes": after - before, "step_s": min(times[1:])}, f)
    torch.distributed.barrier()  # leave together


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--probe", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--layout", type=int, nargs=3, default=(1, 1, 3), help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", default="bench/results/parallel_memory.json")
    args = p.parse_args()
    if args.probe:
        return probe(*args.probe, *args.layout)

    from megagrpo.planning import make_plan
    work = tempfile.mkdtemp(prefix="megagrpo-memory-")
    model = os.path.join(work, "model")
    subprocess.run([sys.executable, f"{ROOT}/tools/make_tiny_model.py", "--out", model,
                    "--hidden-size", "512", "--layers", "8", "--heads", "8", "--kv-heads", "8",
                    "--intermediate-size", "1536", "--vocab-size", "512"], check=True, stdout=subprocess.DEVNULL)
    rows = []
    for name, ranks, tp, pp, stage in LAYOUTS:
        out = os.path.join(work, name)
        os.makedirs(out)
        with open(os.path.join(out, "data.jsonl"), "w") as f:
            f.write('{"prompt": "1 + 1", "answer": "2"}\n' * 64)
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus",
                        str(ranks), "--master_port", "29577", os.path.abspath(__file__),
                        "--probe", model, out, "--layout", str(tp), str(pp), str(stage)],
                       check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": ROOT})
        measured = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(ranks)]
        os.environ["WORLD_SIZE"] = str(ranks)
        cfg = _config(model, os.path.join(out, "data.jsonl"), tp, pp, stage)
        plan = make_plan(cfg, ranks).bytes_per_rank
        estimate = plan["params"] + plan["grads"] + plan["optimizer"]
        state = max(m["state_bytes"] for m in measured)
        rows.append({"layout": name, "ranks": ranks, "tp": tp, "pp": pp, "zero": stage, "measured_bytes": state,
                     "estimate_bytes": estimate, "step_s": max(m["step_s"] for m in measured)})
    base = rows[0]
    print(f"\n{'layout':<7}{'ranks':>6}{'measured MiB':>14}{'vs dp1':>8}{'plan MiB':>10}"
          f"{'plan/meas':>10}{'step s':>8}{'vs dp1':>8}")
    for r in rows:
        r["memory_vs_dp1"] = r["measured_bytes"] / base["measured_bytes"]
        r["estimate_over_measured"] = r["estimate_bytes"] / r["measured_bytes"]
        r["step_vs_dp1"] = r["step_s"] / base["step_s"]
        print(f"{r['layout']:<7}{r['ranks']:>6}{r['measured_bytes'] / 2**20:>14.1f}"
              f"{r['memory_vs_dp1']:>8.2f}{r['estimate_bytes'] / 2**20:>10.1f}"
              f"{r['estimate_over_measured']:>10.2f}{r['step_s']:>8.2f}{r['step_vs_dp1']:>8.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
