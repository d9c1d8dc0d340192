"""Shared fixtures: the tiny model and demo task, built once per session with the real tools."""
import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
BIN = os.path.dirname(PYTHON)


def run(cmd, timeout=900, env=None, check=True, cwd=ROOT):
    """Run a command from the repository root; return the CompletedProcess (text output)."""
    full_env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                             f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """{data, model, warm} folders: demo task, random tiny Qwen2, warm-started tiny Qwen2."""
    base = tmp_path_factory.mktemp("tiny")
    paths = {k: str(base / k) for k in ("data", "model", "warm")}
    run([PYTHON, "tools/make_demo_data.py", "--out", paths["data"]])
    run([PYTHON, "tools/make_tiny_model.py", "--out", paths["model"], "--corpus",
         os.path.join(paths["data"], "sft.jsonl")])
    run([PYTHON, "tools/warm_start.py", "--model", paths["model"], "--data",
         os.path.join(paths["data"], "sft.jsonl"), "--out", paths["warm"]])
    return paths


def tiny_overrides(tiny, output_dir, **extra):
    """Overrides pointing configs/tiny_arith.yaml at the session's tiny model and data."""
    values = {"model.name_or_path": tiny["warm"],
              "data.train_file": os.path.join(tiny["data"], "train.jsonl"),
              "data.eval_file": os.path.join(tiny["data"], "eval.jsonl"),
              "output_dir": str(output_dir), "logging.progress_bar": "false", **extra}
    return [f"{k}={v}" for k, v in values.items()]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def pytest_sessionfinish(session, exitstatus):
    """Remove DeepSpeed shm all-reduce files left by ranks killed before they unlinked them
    (only old ones: a job starting elsewhere needs its files until all its ranks have mapped them)."""
    import re
    import time

    shm = "/dev/shm"
    if os.path.isdir(shm):
        for name in os.listdir(shm):
            path = os.path.join(shm, name)
            # DeepSpeed's shm all-reduce buffers; vLLM-CPU's tp/pp shm groups of crashed ranks
            if name.startswith("deepspeed_allreduce_buffer_") or re.search(r"-cpushm_\d+$", name):
                try:
                    if time.time() - os.stat(path).st_mtime > 300:
                        os.unlink(path)
                except OSError:
                    pass
