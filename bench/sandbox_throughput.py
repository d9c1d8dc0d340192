"""Sandbox throughput: executions per second of a trivial passing program, side by side:
bubblewrap + rlimits (the default), rlimits only, and a plain `python3 -I` subprocess (no
sandbox, the floor), each with 1, 2 and 4 parallel workers; plus the code reward end to end
(a correct solution and one unit test) under bubblewrap, and with `--baseline REF` the code
reward of another commit on the same batch, in alternating rounds, as a ratio.

    python bench/sandbox_throughput.py [--executions 100] [--repeats 3] [--baseline 4ada2dc]

Each rate is the best of `repeats` rounds (other work on the machine only slows a round down).
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megagrpo.sandbox import Sandbox, sandbox_python  # noqa: E402

PROGRAM = "print(sum(range(10)))"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the code reward of a source tree, timed in a process of its own: seconds for the batch
CODE_REWARD_ROUND = r"""
import json, sys, time
from megagrpo.rewards.code import CodeReward
workers, n = int(sys.argv[1]), int(sys.argv[2])
reward = CodeReward(sandbox="strict", workers=workers)
completions = ["```python\ndef add(a, b):\n    return a + b\n```"] * n
tests = [["assert add(1, 2) == 3"]] * n
reward(["q"] * 8, completions[:8], tests=tests[:8])
start = time.perf_counter()
scores = reward(["q"] * n, completions, tests=tests)
elapsed = time.perf_counter() - start
assert list(scores) == [1.0] * n, scores.reasons
reward.close()
print(json.dumps(elapsed))
"""


def code_reward_seconds(tree: str, workers: int, n: int) -> float:
    out = subprocess.run([sys.executable, "-c", CODE_REWARD_ROUND, str(workers), str(n)], cwd=tree,
                         env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def plain_run(_):
    out = subprocess.run([sandbox_python(), "-I", "-B", "-c", PROGRAM], capture_output=True, text=True)
    assert out.stdout.strip() == "45"


def rate(fn, executions, workers, repeats) -> float:
    best = 0.0
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(fn, range(min(8, executions))))  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(fn, range(executions)))
            best = max(best, executions / (time.perf_counter() - start))
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--executions", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", default=None, help="a commit whose code reward to time on the same batch")
    p.add_argument("--skip-sandbox", action="store_true", help="time the code reward only")
    p.add_argument("--out", default="bench/results/sandbox_throughput.json")
    args = p.parse_args()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sandboxes = {"bwrap+rlimits": Sandbox(mode="strict"), "rlimits only": Sandbox(mode="rlimits")}

    def sandboxed(sb):
        def run(_):
            r = sb.run(PROGRAM)
            assert r.ok and r.stdout.strip() == "45", r
        return run

    rows = []
    for workers in () if args.skip_sandbox else (1, 2, 4):
        plain = rate(plain_run, args.executions, workers, args.repeats)
        for name, sb in sandboxes.items():
            per_s = rate(sandboxed(sb), args.executions, workers, args.repeats)
            rows.append({"variant": name, "workers": workers, "executions_per_s": per_s,
                         "ms_per_execution": 1000 / per_s, "vs_plain": per_s / plain})
        rows.append({"variant": "plain subprocess", "workers": workers, "executions_per_s": plain,
                     "ms_per_execution": 1000 / plain, "vs_plain": 1.0})
    baseline = None
    if args.baseline:
        baseline = tempfile.mkdtemp(prefix="megagrpo-baseline-")
        subprocess.run(["git", "worktree", "add", "--detach", baseline, args.baseline], cwd=ROOT, check=True,
                       capture_output=True)
    try:
        for workers in (1, 2, 4):
            best = {"current": float("inf"), "baseline": float("inf")}
            for _ in range(args.repeats):  # alternating rounds: the same machine state for both
                best["current"] = min(best["current"], code_reward_seconds(ROOT, workers, args.executions))
                if baseline:
                    best["baseline"] = min(best["baseline"], code_reward_seconds(baseline, workers, args.executions))
            for tree in ("current", "baseline") if baseline else ("current",):
                name = "code reward" if tree == "current" else f"code reward @{args.baseline}"
                rows.append({"variant": name, "workers": workers, "executions_per_s": args.executions / best[tree],
                             "ms_per_execution": 1000 * best[tree] / args.executions, "vs_plain": None,
                             "vs_baseline": best["baseline"] / best["current"] if baseline else None})
    finally:
        if baseline:
            subprocess.run(["git", "worktree", "remove", "--force", baseline], cwd=ROOT, capture_output=True)
    print(f"{'variant':<26} {'workers':>7} {'exec/s':>8} {'ms/exec':>8} {'vs plain':>9} {'vs baseline':>12}")
    for r in rows:
        ratio = f"{r['vs_plain']:.2f}" if r["vs_plain"] is not None else "-"
        speed = f"{r['vs_baseline']:.2f}" if r.get("vs_baseline") is not None else "-"
        print(f"{r['variant']:<26} {r['workers']:>7} {r['executions_per_s']:>8.1f} "
              f"{r['ms_per_execution']:>8.1f} {ratio:>9} {speed:>12}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                               "load_average": os.getloadavg()},
                   "sandbox": sandboxes["bwrap+rlimits"].describe(),
                   "executions": args.executions, "repeats": args.repeats, "baseline": args.baseline,
                   "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
