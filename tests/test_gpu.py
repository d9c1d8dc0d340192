"""The GPU checks (bench/gpu_check.py) as tests, marker `gpu`: vLLM sleep/wake around a train
step, flash-attn packed log-probs against SDPA padded ones, 2 bf16 ZeRO-3 GRPO steps through the
DeepSpeed launcher, the weight sync against a device-to-device copy, NCCL collectives.

    python -m pytest -m gpu tests/test_gpu.py -v -rs
    bash bench/gpu_check.sh     # the same tests, with the results as one JSON (tests/helpers/gpu_report.py)

Each check runs in a process of its own (its CUDA context, vLLM engine or process group dies
with it) under its time limit, bench/gpu_check.py's TIMEOUTS, cut to what is left of the run's
budget when bench/gpu_check.sh sets one; pytest-timeout's limit is a backstop. A check whose
packages are absent (vllm's CUDA build, flash_attn, deepspeed, ...) is skipped with its
"missing: ..." reason, and every check is skipped where torch sees no CUDA device ("no CUDA:
...") before anything is prepared, so on CPU the module costs a second.
"""
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

# the end of bench/gpu_check.sh's budget (seconds since the epoch); no end when run by hand
DEADLINE = float(os.environ.get("GPU_CHECK_DEADLINE", "inf"))
MIN_STEP_S = 10  # a step with less time than this left is not started

pytestmark = pytest.mark.gpu


def time_limit(name: str) -> float:
    """The step's time limit, cut to what is left of the run's budget; skips the test when
    too little is left."""
    left = DEADLINE - time.time()
    if left < MIN_STEP_S:
        pytest.skip(f"not run: the run's time budget was spent before {name} ({left:.0f} s left)")
    return min(gpu_check.TIMEOUTS[name], left)


def check_case(name: str):
    """One check as a test case: skipped up front when it cannot run here, and pytest-timeout's
    limit (the test function alone, 30 s past the check's own) as a backstop."""
    problems, _ = gpu_check.missing_for(name)
    marks = [pytest.mark.timeout(gpu_check.TIMEOUTS[name] + 30, func_only=True)]
    if problems:
        marks.append(pytest.mark.skip(reason="; ".join(problems)))
    return pytest.param(name, marks=marks, id=name)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The demo task and the tiny models, built once for the module (the `prepare` step), in
    GPU_CHECK_WORK when it is set (bench/gpu_check.sh), else in a temporary folder."""
    folder = Path(os.environ.get("GPU_CHECK_WORK") or tmp_path_factory.mktemp("gpu_check"))
    entry = gpu_check.run_isolated("prepare", folder, time_limit("prepare"))
    if not entry["ok"]:
        pytest.fail("prepare failed: " + json.dumps(entry, indent=1)[-6000:], pytrace=False)
    return folder


@pytest.mark.parametrize("name", [check_case(name) for name in gpu_check.CHECKS])
def test_gpu_check(work, name, record_property):
    entry = gpu_check.run_isolated(name, work, time_limit(name))
    record_property("gpu_check", entry)  # its entry in bench/gpu_check.sh's JSON
    if str(entry["error"]).startswith("missing:"):
        pytest.skip(entry["error"])
    assert entry["ok"], json.dumps(entry, indent=1)[-6000:]
