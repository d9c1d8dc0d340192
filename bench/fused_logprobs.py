"""Per-token log-probs + entropy, forward and backward: the full-logits path against the chunked
fused one (megagrpo/policy/fused_logprobs.py), peak extra memory and wall time, side by side on CPU.

    python bench/fused_logprobs.py                                       # Qwen2.5-0.5B head
    python bench/fused_logprobs.py --n 2048 --hidden 256 --vocab 32000   # quick

Each variant runs in a fresh child process. Peak extra memory is the process's RSS high-water
mark (getrusage ru_maxrss) after the runs minus the same mark once the inputs exist, so it
counts the logits, their temporaries and the .grad tensors (N x H and V x H, alike for both).
The children run with MALLOC_MMAP_THRESHOLD_=1 MiB, so that glibc hands freed blocks back and
RSS follows the live tensors (by default it starts keeping ~32 MB blocks in its heap).
Time is the median of --repeats forward+backward runs. Prints a table, writes JSON.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(args):
    """One variant in this process; prints its result as one JSON line."""
    import torch

    from megagrpo.policy.fused_logprobs import fused_token_logprobs, naive_token_logprobs

    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    hidden = torch.randn(args.n, args.hidden, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden ** 0.5).to(dtype)
    weight.requires_grad_()
    targets = torch.randint(0, args.vocab, (args.n,), generator=g)
    token_w = torch.rand(args.n, generator=g)
    if args.variant == "fused":
        fn = lambda: fused_token_logprobs(hidden, weight, targets, args.temperature,  # noqa: E731
                                          args.chunk, with_entropy=not args.no_entropy)
    else:
        fn = lambda: naive_token_logprobs(hidden, weight, targets, args.temperature,  # noqa: E731
                                          with_entropy=not args.no_entropy)
    baseline = max_rss_mib()
    times = []
    for _ in range(args.repeats):
        hidden.grad = weight.grad = None
        start = time.perf_counter()
        logp, _ = fn()
        loss = (logp * token_w).sum()
        loss.backward()
        times.append(time.perf_counter() - start)
    print(json.dumps({"peak_extra_mib": max_rss_mib() - baseline,
                      "time_s": statistics.median(times), "loss": loss.item(),
                      "grad_weight_norm": weight.grad.float().norm().item()}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=8192, help="tokens")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: its default)")
    p.add_argument("--no-entropy", action="store_true")
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/fused_logprobs.json"))
    p.add_argument("--variant", choices=["naive", "fused"], help=argparse.SUPPRESS)  # child
    args = p.parse_args()
    if args.variant:
        return child(args)

    results = {}
    for variant in ("naive", "fused"):
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant],
                              capture_output=True, text=True, check=True,
                              env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2 ** 20)})
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    naive, fused = results["naive"], results["fused"]
    ratios = {k: fused[k] / naive[k] for k in ("peak_extra_mib", "time_s")}
    config = {k: v for k, v in vars(args).items() if k not in ("variant", "out")}
    config["logits_mib"] = args.n * args.vocab * 4 / 2 ** 20
    print(f"N={args.n} H={args.hidden} V={args.vocab} chunk={args.chunk} {args.dtype} "
          f"entropy={not args.no_entropy}; float32 N x V logits: {config['logits_mib']:.0f} MiB")
    print(f"{'':<16}{'naive':>10}{'fused':>10}{'fused/naive':>13}")
    print(f"{'peak extra MiB':<16}{naive['peak_extra_mib']:>10.0f}{fused['peak_extra_mib']:>10.0f}"
          f"{ratios['peak_extra_mib']:>13.3f}")
    print(f"{'fwd+bwd s':<16}{naive['time_s']:>10.3f}{fused['time_s']:>10.3f}"
          f"{ratios['time_s']:>13.3f}")
    print(f"loss naive {naive['loss']:.6f} fused {fused['loss']:.6f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": config, "results": results, "ratios_fused_over_naive": ratios}, f,
                  indent=1)


if __name__ == "__main__":
    main()
