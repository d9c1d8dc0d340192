"""LoRA policies (model.lora, docs/lora.md): real peft adapters under real DeepSpeed ZeRO 0-3
with the co-located vLLM engine.

Probe runs (tests/helpers/lora_probe.py), one per layout: at initialisation (B = 0) the
policy's log-probs equal the base model's exactly, and so do the reference's (adapters
disabled); after each of 3 steps and the sync that moves the adapted layers only, vLLM scores
a fixed completion as the trainer does (within 1e-4 in fp32) and exactly as after a full
sync; the base weights are bit-identical after the steps, every adapter moved, and the
optimizer holds the adapters' state only. The exported adapter and merged folder, and their
offline conversions from the checkpoint, reproduce the live policy's logits within 1e-5.
Learning: the quickstart task with rank-16 adapters gains at least 20 points of held-out
accuracy, and `megagrpo eval` of its adapter folder scores what the run scored.
"""
import glob
import json
import os

import pytest
import torch
from conftest import PYTHON, run, tiny_overrides, torchrun
from safetensors.torch import load_file

from megagrpo.config.schema import ConfigError
from megagrpo.validation import load_config

LAYOUTS = {
    # every norm trained in full beside the adapters (peft: modules whose names end in "norm")
    "zero0_1rank_fp32_norms_saved": (1, ["deepspeed=configs/ds_zero0.json", "model.lora.modules_to_save=[norm]"]),
    # the adapted layers synced into one vLLM engine sharded over both ranks
    "zero3_2ranks_fp32_vllm_tp2": (2, ["deepspeed=configs/ds_zero3.json", "rollout.tensor_parallel_size=2"]),
    # two of the seven linear layers: their siblings (k, o) move with them, the MLP does not
    # (a learning rate that moves the log-probs per step by far more than bf16's sampler/trainer gap)
    "zero2_2ranks_bf16_checkpointing_qv": (2, ["deepspeed=configs/ds_zero2.json", "model.dtype=bfloat16",
                                               "model.gradient_checkpointing=true", "grpo.learning_rate=1e-2",
                                               "model.lora.target_modules=[q_proj,v_proj]"]),
}
BF16_GAP = 0.1  # vLLM's bf16 kernels against the trainer's, in log-prob


def _tensors(folder):
    out = {}
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        out.update(load_file(path))
    return out


def _logits(model, sequence):
    with torch.no_grad():
        return model.eval()(input_ids=torch.tensor([sequence])).logits


@pytest.mark.multirank
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_lora_policy_on_the_real_stack(tiny, tmp_path, layout):
    ranks, extra = LAYOUTS[layout]
    out = tmp_path / "probe"
    run([*torchrun(ranks, "tests/helpers/lora_probe.py"), "--config", "configs/tiny_arith.yaml",
         *tiny_overrides(tiny, out, **{"grpo.learning_rate": 1e-3, "model.lora.r": 8}), *extra])
    fp32 = "bf16" not in layout
    results = [json.load(open(out / f"lora_rank{r}.json")) for r in range(ranks)]
    for r in results:
        assert r["is_lora"] and r["lora_B_zero_at_init"]
        assert r["policy_init"] == r["base"], "B = 0: the LoRA policy must score exactly as the base model"
        assert r["reference_init"] == r["policy_init"]
        before = r["base"]
        for step in r["steps"]:
            assert step["grad_norm"] > 0
            assert step["reference"] == r["base"], "the reference (adapters disabled) is the frozen base"
            assert step["engine"] == step["engine_full_sync"], "syncing the adapted layers only left vLLM behind"
            gap = max(abs(a - b) for a, b in zip(step["engine"], step["trainer"], strict=True))
            assert gap < (1e-4 if fp32 else BF16_GAP), (gap, step)
            # the engine holds this step's weights, not the step's before: 4x nearer to them on
            # average (in bf16 measured 6.7-33x; a gap within BF16_GAP alone would not tell)
            stale = sum(abs(a - b) for a, b in zip(step["engine"], before)) / len(before)
            assert sum(abs(a - b) for a, b in zip(step["engine"], step["trainer"])) / len(before) < stale / 4
            before = step["trainer"]
        moved = max(abs(a - b) for a, b in zip(r["steps"][-1]["trainer"], r["base"], strict=True))
        assert moved > 1e-2
        assert r["frozen_bit_identical"], r["frozen_max_change"]
        assert min(r["adapter_max_change"].values()) > 0, r["adapter_max_change"]
        assert all("lora_" in name or ".modules_to_save." in name for name in r["trained_names"])
        assert r["trained_numel"] < 0.1 * r["frozen_numel"]
        changed = {n for n in r["sent_full"] if "_proj." in n}
        if "qv" in layout:  # the attention projections (fused q/k/v in vLLM, o beside them), not the MLP
            changed = {n for n in changed if "self_attn" in n}
        if "norms_saved" in layout:
            changed |= {n for n in r["sent_full"] if "norm" in n}
            assert sum(".modules_to_save." in n for n in r["trained_names"]) == 5  # 2 per layer + the final norm
        assert set(r["steps"][0]["sent_changed_only"]) == changed
        assert not any("embed" in n for n in r["steps"][0]["sent_changed_only"])
    # the ranks' Adam moments together are the adapters' (ZeRO 1-3 split them), nothing of the base
    state = sum(r["optimizer_state_numel"] for r in results)
    assert results[0]["trained_numel"] <= state <= results[0]["trained_numel"] + 64 * ranks, state
    _check_exports(tiny, out, results[0]["sequence"], dtype=torch.float32 if fp32 else torch.bfloat16,
                   cli="zero3" in layout)


def _check_exports(tiny, out, sequence, dtype, cli):
    """The run's exports (adapter folder, merged HF folder) and the offline conversions (the
    checkpoint to each, the adapter folder merged into its base) against the live policy's
    logits; with `cli` the conversions go through `megagrpo convert`, else in this process."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megagrpo.checkpoints import convert

    live = torch.load(out / "live_logits.pt").float()
    # (W + s B A) x against W x + s B (A x): float32 rounds the two differently, by a few ulps of
    # the largest logit (1.4e-5 at 10.7 seen): held to 2e-6 of it, 1e-5 at the tiny model's scale.
    # bf16 rounds the merged weight to 8 bits: a logit moves by up to ~2^-8 of the largest one
    scale = float(live.abs().max())
    bound = scale * (2e-6 if dtype == torch.float32 else 2 ** -6)

    def gap(folder, adapter=False):
        if adapter:
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny["warm"], dtype=dtype), folder)
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        return float((_logits(model, sequence).float() - live).abs().max())

    # peft runs the live policy's operations: in float32 to 1e-5, in bf16 to bf16's rounding
    assert gap(str(out / "adapter"), adapter=True) < (1e-5 if dtype == torch.float32 else bound)
    assert gap(str(out / "hf")) < bound
    ckpt = sorted(glob.glob(str(out / "checkpoints" / "step_*")))[-1]
    states = torch.load(glob.glob(os.path.join(ckpt, "*model_states.pt"))[0], weights_only=False)
    # no frozen base weights in the checkpoint (the tied head neither): the module's state, and
    # under ZeRO 1-3 the optimizer's parameters
    names = [*(states["module"] or {}), *(states["param_shapes"][0] if states.get("param_shapes") else {})]
    assert names and all("lora_" in n or ".modules_to_save." in n for n in names), names
    dtype_name = str(dtype).removeprefix("torch.")
    if cli:
        run([PYTHON, "-m", "megagrpo.cli", "convert", "to-adapter", ckpt, str(out / "converted_adapter")])
        run([PYTHON, "-m", "megagrpo.cli", "convert", "to-hf", ckpt, str(out / "converted_hf")])
        run([PYTHON, "-m", "megagrpo.cli", "convert", "adapter-to-hf", str(out / "adapter"), str(out / "merged_hf"),
             "--model", tiny["warm"], "--dtype", dtype_name])
    else:
        quiet = {"log": lambda _: None}
        convert.to_adapter(ckpt, str(out / "converted_adapter"), **quiet)
        convert.to_hf(ckpt, str(out / "converted_hf"), **quiet)
        convert.adapter_to_hf(str(out / "adapter"), str(out / "merged_hf"), tiny["warm"], dtype_name, **quiet)
    exported, converted = _tensors(out / "adapter"), _tensors(out / "converted_adapter")
    assert exported.keys() == converted.keys() and all(torch.equal(exported[k], converted[k]) for k in exported)
    exported, converted = _tensors(out / "hf"), _tensors(out / "converted_hf")
    assert exported.keys() == converted.keys() and all(torch.equal(exported[k], converted[k]) for k in exported)
    # the adapter folder merged offline into the base folder's weights, cast to the run's dtype
    # first: the run's own merge, bit for bit
    merged = _tensors(out / "merged_hf")
    assert merged.keys() == exported.keys() and all(torch.equal(merged[k], exported[k]) for k in exported)
    assert all(t.dtype == dtype for t in merged.values())
    assert gap(str(out / "merged_hf")) < bound


@pytest.mark.multirank
def test_lora_learns_the_quickstart_task_and_its_adapter_evaluates_alike(tiny, tmp_path):
    out = tmp_path / "lora"
    run([*torchrun(2, "-m", "megagrpo.train"),
         "--config", "configs/tiny_lora.yaml", *tiny_overrides(tiny, out), "checkpoint.save_steps=0"], timeout=900)
    results = json.load(open(out / "eval_results.json"))
    before, after = results["before"]["rewards/answer_match"], results["after"]["rewards/answer_match"]
    assert after - before >= 0.20, results
    proc = run([PYTHON, "-m", "megagrpo.cli", "eval", "--model", str(out / "adapter"), "--config",
                "configs/tiny_lora.yaml", "--data", os.path.join(tiny["data"], "eval.jsonl"),
                "--output", str(tmp_path / "eval")])
    offline = json.load(open(tmp_path / "eval" / "eval_results.json"))
    assert offline["rewards/answer_match"] == after, (offline, results["after"], proc.stdout[-2000:])


def _config(tiny, *overrides):
    return load_config("configs/tiny_lora.yaml", [f"model.name_or_path={tiny['warm']}",
                                                  f"data.train_file={tiny['data']}/train.jsonl",
                                                  f"data.eval_file={tiny['data']}/eval.jsonl", *overrides])


@pytest.mark.parametrize("overrides,message", [
    (["model.lora.target_modules=[q_proj,qkv_proj]"],
     "'qkv_proj' matches no linear layer of .*; its linear layers are down_proj, gate_proj, k_proj, o_proj, "
     "q_proj, up_proj, v_proj"),
    (["parallel.tensor_parallel_size=2"], "tensor_parallel_size=2 is not supported.*set parallel.tensor_parallel_size"),
    (["parallel.pipeline_parallel_size=2"], "pipeline_parallel_size=2 is not supported"),
    (["grpo.sync_ref_model=true"], "sync_ref_model with model.lora is not supported"),
    (["model.lora.modules_to_save=[lm_head]"], "lm_head"),
    (["model.lora.modules_to_save=[embed_tokens]"], "ties embed_tokens to the output head"),
    (["model.lora.dropout=1.0"], r"model.lora.dropout: 1.0 must be in \[0, 1\)"),
])
def test_lora_settings_are_checked_before_anything_is_built(tiny, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(tiny, *overrides)


def test_trl_names_turn_lora_on(tiny):
    assert _config(tiny, "model.lora.r=0", "use_peft=true").model.lora.r == 16
    assert _config(tiny, "use_peft=false").model.lora.r == 0
    cfg = _config(tiny, "lora_r=4", "lora_alpha=8", "lora_target_modules=[q_proj]")
    assert (cfg.model.lora.r, cfg.model.lora.alpha, cfg.model.lora.target_modules) == (4, 8.0, ["q_proj"])


