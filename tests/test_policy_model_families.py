"""The model families people train besides Qwen2, as tiny random models from
tools/make_tiny_model.py --arch: Qwen3 (per-head q/k norms, a tied head), Llama 3 (llama3 rope
scaling, an untied head) and Mistral (an untied head, a sliding window), all with grouped-query
attention (4 heads, 2 key-value heads). Each trains 2 steps on one rank, on dp 2 x tp 2 with
ZeRO-3 (DeepSpeed's AutoTP) and in 2 pipeline stages with ZeRO-1 (megagrpo's pipeline, from
`convert hf-to-pipeline`; Qwen3's stages split by tp 2 as well, for its per-head norms), with
vLLM co-located, and the parallel runs are held to
the one-rank run: the step-1 loss, both gradient norms (to 1e-6: the drift of Qwen3's q/k norms
summed over one tp rank's heads only was 1.2e-5), the parameters after 2 steps, and vLLM's
log-probs after each sync. Each parallel run's step-2 checkpoint, converted offline with `megagrpo
convert to-hf`, equals its HF export. Mixtures of experts: tests/test_moe.py.

The random models' completions all score zero on the task, so the runs use a reward with spread
on any text (tests/helpers/spread_reward.py)."""
import json
import os
import sys

import pytest
import torch
from conftest import PYTHON, ROOT, run, tiny_overrides, torchrun
from runs import assert_same_run, values
from safetensors.torch import load_file

from megagrpo.checkpoints.convert import main as convert

COMMON = ["data.eval_file=null", "grpo.max_steps=2", "grpo.learning_rate=1e-4", "logging.sample_steps=0",
          "rewards.functions=[spread_reward:distinct_characters]"]
HELPERS = {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "helpers")])}  # the reward
SIZES = ["--hidden-size", "256", "--heads", "4", "--kv-heads", "2"]


def check_architecture(arch, model):
    config = json.load(open(model / "config.json"))
    tensors = load_file(str(model / "model.safetensors"))
    assert config["model_type"] == arch and config["num_key_value_heads"] < config["num_attention_heads"]
    if arch == "qwen3":
        assert config["tie_word_embeddings"] and "model.layers.0.self_attn.q_norm.weight" in tensors
    else:
        assert not config["tie_word_embeddings"] and "lm_head.weight" in tensors
    if arch == "llama":
        assert config["rope_parameters"]["rope_type"] == "llama3"
    if arch == "mistral":
        assert config["sliding_window"] == 4096
    return tensors


@pytest.mark.multirank
@pytest.mark.parametrize("arch", ["qwen3", "llama", "mistral"])
def test_a_model_family_trains_equal_to_one_rank_on_tensor_and_pipeline_layouts(tiny, tmp_path, arch):
    model, staged = tmp_path / "model", tmp_path / "staged"
    run([PYTHON, "tools/make_tiny_model.py", "--arch", arch, *SIZES, "--out", str(model),
         "--corpus", os.path.join(tiny["data"], "sft.jsonl")])
    start = check_architecture(arch, model)
    assert convert(["hf-to-pipeline", str(model), str(staged), "--pipeline-parallel-size", "2"]) == 0
    tp = 2 if arch == "qwen3" else 1  # in the pipeline

    def train(name, launch, model_path, *extra):
        out = tmp_path / name
        run([*launch, "megagrpo.train", "--config", "configs/tiny_arith.yaml",
             *tiny_overrides({**tiny, "warm": str(model_path)}, out), *COMMON, *extra], timeout=800, env=HELPERS)
        return out

    one = train("one_rank", [sys.executable, "-m"], model, "grpo.per_device_train_batch_size=16",
                "checkpoint.save_steps=0")
    layouts = {
        "dp2_tp2_zero3": train("dp2_tp2_zero3", torchrun(4, "-m"), model, "grpo.per_device_train_batch_size=8",
                               "parallel.tensor_parallel_size=2", "deepspeed=configs/ds_zero3.json",
                               "checkpoint.save_steps=2"),
        f"tp{tp}_pp2_zero1": train(f"tp{tp}_pp2_zero1", torchrun(2 * tp, "-m"), staged,
                                   "grpo.per_device_train_batch_size=16", f"parallel.tensor_parallel_size={tp}",
                                   "parallel.pipeline_parallel_size=2", "deepspeed=configs/ds_zero1.json",
                                   "checkpoint.save_steps=2"),
    }
    expected = load_file(str(one / "hf" / "model.safetensors"))
    assert max((expected[k] - start[k]).abs().max().item() for k in start) > 1e-4  # training moved them
    for name, out in layouts.items():
        assert len(values(out, "train/loss")) == 2, name
        exported = assert_same_run(out, one, loss_atol=1e-5, grad_norm_rtol=1e-6, param_atol=1e-5)
        assert max(values(out, "train/sampling/sampling_logp_difference/max")) < 1e-4, name
        converted = tmp_path / f"{name}_converted"
        assert convert(["to-hf", str(out / "checkpoints" / "step_00000002"), str(converted)]) == 0
        offline = load_file(str(converted / "model-00001.safetensors"))
        assert sorted(offline) == sorted(exported) and all(torch.equal(offline[k], exported[k]) for k in exported)
