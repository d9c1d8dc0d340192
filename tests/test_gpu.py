"""The GPU checks of bench/gpu_check.py as tests: vLLM sleep/wake around a train step, flash-attn
packed log-probs against SDPA padded ones, 2 bf16 ZeRO-3 GRPO steps through the DeepSpeed
launcher, the weight sync against a device-to-device copy, NCCL collectives.

Each check runs in its own process under its time limit, as bench/gpu_check.sh runs them (the
functions are bench/gpu_check.py's; nothing is repeated here). The whole module is skipped
where torch sees no CUDA device; a check whose packages are absent (vllm's CUDA build,
flash_attn, deepspeed, ...) is skipped with its "missing: ..." reason.
"""
import importlib.util
import json
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "bench", "gpu_check.py"))
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)"),
]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The demo task and the tiny models, built once for the module (the `prepare` step)."""
    folder = tmp_path_factory.mktemp("gpu_check")
    entry = gpu_check.run_isolated("prepare", folder)
    assert entry["ok"], json.dumps(entry, indent=1)[-6000:]
    return folder


@pytest.mark.parametrize("name", gpu_check.CHECKS)
def test_gpu_check(work, name):
    entry = gpu_check.run_isolated(name, work)
    if str(entry["error"]).startswith("missing:"):
        pytest.skip(entry["error"])
    assert entry["ok"], json.dumps(entry, indent=1)[-6000:]
