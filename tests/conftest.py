"""Shared fixtures: the tiny model and demo task, built once per session with the real tools."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
BIN = os.path.dirname(PYTHON)


def run(cmd, timeout=600, env=None, check=True, cwd=ROOT):
    """Run a command from the repository root; return the CompletedProcess (text output).

    The command gets its own session. On timeout every process in it (launcher, ranks, vLLM
    workers) is sent SIGABRT first, so Python's faulthandler prints where each one hung, then
    killed; the error carries both outputs. Processes it leaves behind are killed as well.
    """
    full_env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
                **(env or {})}
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_session(proc.pid, signal.SIGABRT)
        time.sleep(5)
        _signal_session(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd} did not finish within {timeout} s (stacks below, from SIGABRT)\n"
                             f"--- stdout\n{out[-6000:]}\n--- stderr\n{err[-12000:]}")
    _signal_session(proc.pid, signal.SIGKILL)
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and result.returncode != 0:
        raise AssertionError(f"{cmd} exited {result.returncode}\n--- stdout\n{out[-6000:]}\n"
                             f"--- stderr\n{err[-6000:]}")
    return result


def _signal_session(pid: int, sig: int) -> None:
    """Signal the process group a `run` command leads (no-op once it is empty)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


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


def pytest_runtest_logreport(report):
    """Print a failure's report as it happens, not only in the summary at the end, so that a
    run cut short (a CI time limit) still shows why the tests before the cut failed."""
    if report.failed:
        text = report.longreprtext
        print(f"\n=== {report.nodeid} failed ({report.when}); end of its report:\n{text[-5000:]}\n===",
              flush=True)


def pytest_sessionfinish(session, exitstatus):
    """Remove DeepSpeed shm all-reduce files left by ranks killed before they unlinked them
    (only old ones: a job starting elsewhere needs its files until all its ranks have mapped them)."""
    import re

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
