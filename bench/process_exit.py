"""The end of a process: the interpreter's teardown against megagrpo/process_exit.py's
exit_without_teardown, side by side, for the processes a job and the suite start.

    python bench/process_exit.py [--tiny runs/tiny] [--repeats 3]

  imports   a process that imports what a rank imports (megagrpo.train, vLLM), then exits
  engine    the same with a vLLM engine built on the tiny model that has generated (a rank at
            the end of its run, less the trainer)
Each process prints the time when its work is done; the exit is from then to the process's end
as its parent sees it (the atexit hooks, vLLM's engine shutdown and, with `teardown`, the
interpreter's garbage collections and module clearing). That a tp=2 engine's shared memory is
still removed is a test (tests/test_policy_parallel.py). Prints a table (median of the repeats,
without/with ratio), writes JSON to bench/results/.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_overhead import ROOT, ensure_tiny  # noqa: E402

CHILD = r"""
import os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import megagrpo.train  # noqa: F401  (a rank's imports)
import vllm
case, way, model = sys.argv[1:4]
if case == "engine":
    llm = vllm.LLM(model=model, dtype="float32", kv_cache_memory_bytes=256 * 2**20, max_model_len=128,
                   enforce_eager=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], vllm.SamplingParams(max_tokens=16), use_tqdm=False)
print(f"DONE {time.time()}", flush=True)
if way == "without_teardown":
    from megagrpo.process_exit import exit_without_teardown
    exit_without_teardown(0)
sys.exit(0)
"""


def exit_seconds(case: str, way: str, model: str) -> float:
    proc = subprocess.run([sys.executable, "-c", CHILD, case, way, model], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=600)
    ended = time.time()
    done = [line for line in proc.stdout.splitlines() if line.startswith("DONE ")]
    if proc.returncode != 0 or not done:
        raise SystemExit(f"{case}/{way} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return ended - float(done[0].split()[1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", default=os.path.join(ROOT, "runs", "tiny"), help="the tiny model's run folder")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "process_exit.json"))
    args = p.parse_args()
    ensure_tiny(args.tiny)
    model = os.path.join(args.tiny, "warm")
    rows = []
    for case in ("imports", "engine"):
        seconds = {way: [] for way in ("teardown", "without_teardown")}
        for _ in range(args.repeats):
            for way in seconds:  # interleaved: the machine's load falls on both alike
                seconds[way].append(exit_seconds(case, way, model))
        median = {way: statistics.median(v) for way, v in seconds.items()}
        rows.append({"case": case, "teardown_s": round(median["teardown"], 2),
                     "without_teardown_s": round(median["without_teardown"], 2),
                     "ratio": round(median["without_teardown"] / median["teardown"], 3), "runs": seconds})
    print("| process | exit with the teardown (s) | without (s) | without / with |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['case']} | {row['teardown_s']} | {row['without_teardown_s']} | {row['ratio']} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "repeats": args.repeats}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
