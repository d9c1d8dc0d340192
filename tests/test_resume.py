"""Exact resume: a 2-rank ZeRO-3 run killed with SIGKILL after its step-3 checkpoint and resumed
ends bit-identical to an uninterrupted run, having seen the same prompts in the same order."""
import json
import os
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import BIN, ROOT, free_port, run, tiny_overrides


def _command(tiny, out, extra):
    return [f"{BIN}/deepspeed", "--num_gpus", "2", "--master_port", str(free_port()),
            "--module", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
            *tiny_overrides(tiny, out), "data.eval_file=null", "grpo.per_device_train_batch_size=16",
            "grpo.max_steps=6", "checkpoint.save_steps=3", "logging.sample_steps=0", *extra]


def _prompts_by_step(out):
    seen = {}
    with open(os.path.join(out, "prompts_seen.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            seen[row["step"]] = row["prompts"]  # a resumed run repeats the steps after its checkpoint
    return seen


def _wait_for(condition, timeout, proc):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before it could be killed")
        time.sleep(0.2)
    raise AssertionError("timed out waiting for the run")


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_sigkill_and_resume_is_exact(tiny, tmp_path, num_iterations):
    extra = [f"grpo.num_iterations={num_iterations}"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run(_command(tiny, straight, extra))

    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(_command(tiny, killed, extra), cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        latest = killed / "checkpoints" / "latest"
        _wait_for(lambda: latest.is_file() and latest.read_text() == "step_00000003", 600, proc)
        _wait_for(lambda: 4 in _prompts_by_step(killed), 120, proc)  # killed mid-run, past the save
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (killed / "hf").exists()
    resumed = run(_command(tiny, killed, extra))
    assert "at step 3" in resumed.stdout

    assert _prompts_by_step(killed) == _prompts_by_step(straight)
    assert sorted(_prompts_by_step(straight)) == [1, 2, 3, 4, 5, 6]
    a = load_file(str(straight / "hf" / "model.safetensors"))
    b = load_file(str(killed / "hf" / "model.safetensors"))
    start = load_file(os.path.join(tiny["warm"], "model.safetensors"))
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], start[k]) for k in a)  # training moved the weights
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"
