"""Weight transfer into an engine apart from the trainer: a `vllm serve` of the model fed through
vLLM's weight-transfer API with megagrpo's gloo backend (megagrpo/rollout/weight_transfer.py),
against a memcpy of the same bytes.

    python bench/weight_transfer.py --model /tmp/q05-4l      # 4-layer Qwen2.5-0.5B shape, 747 MiB

Starts the server (tests/helpers/daemons.py: vllm_server), runs tests/helpers/transfer_probe.py
against it (two updates of every weight, each checked: the server's prompt log-probs equal the
trainer's), prints the server's start time and each update's seconds and GB/s next to a memcpy,
writes JSON (bench/results/weight_transfer.json). For the co-located sync: bench/weight_sync.py.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
import daemons  # noqa: E402
from real_shape_run import memcpy_gbps  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder")
    p.add_argument("--out", default="bench/results/weight_transfer.json")
    args = p.parse_args()
    work = os.path.join("bench", "results", "weight_transfer")
    start = time.perf_counter()
    with daemons.vllm_server(args.model, work, "--weight-transfer-config", '{"backend": "gloo"}') as url:
        server_s = time.perf_counter() - start
        probe = subprocess.run([sys.executable, "tests/helpers/transfer_probe.py", "--url", url, "--model", args.model],
                               capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    if probe.returncode != 0:
        sys.exit(f"the probe failed:\n{probe.stderr[-3000:]}")
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    nbytes = result["bytes"]
    copy = nbytes / memcpy_gbps(nbytes) / 1e9
    print(f"\n{args.model}: {nbytes / 2**20:.0f} MiB; vllm serve up in {server_s:.1f} s")
    print(f"{'':<22}{'seconds':>9}{'GB/s':>8}{'x memcpy':>10}{'log-prob gap':>14}")
    print(f"{'memcpy':<22}{copy:>9.3f}{nbytes / copy / 1e9:>8.2f}{1.0:>10.1f}")
    for update in result["updates"]:
        print(f"{'update ' + update['version'] + ' (gloo)':<22}{update['seconds']:>9.3f}{update['gb_per_s']:>8.2f}"
              f"{update['seconds'] / copy:>10.1f}{update['gap']:>14.1e}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "bytes": nbytes, "server_start_s": server_s, "memcpy_s": copy, **result}, f,
                  indent=1)


if __name__ == "__main__":
    main()
