"""The configurations users actually run, each trained in a test: bf16, ZeRO-2, ZeRO-3 with
CPU offload, no reference model (kl_coef 0), truncated completions masked, CISPO with the
entropy and off-policy masks (docs/objectives.md), tensor parallelism
under ZeRO 0, 1 and 2, and a model with an untied LM head (most large checkpoints) on one rank
and in a pipeline, with its HF export and both `megagrpo convert` directions.

Every run is 2 GRPO steps with vLLM co-located; each must finish, log a finite train/loss at
both steps and move the parameters (its HF export against the starting weights). The model is
a random tiny Qwen2 with an untied head (tools/make_tiny_model.py --no-tie-embeddings); the
task's reward would score all its completions zero (no advantage, no gradient), so the runs
use a reward with spread on any text (tests/helpers/spread_reward.py). The fp32 layouts and the
CPU-offloaded optimizer are also held to the one-rank run: the same losses, gradient norms and
parameters. The bf16 run (ZeRO-3 through the DeepSpeed launcher, one of the GPU checks that
bench/gpu_check.sh runs) is held to the float32 one-rank run within bf16's bounds at step 1,
whose completions both sample alike (same seeds, same starting weights).
"""
import dataclasses
import importlib.util
import json
import math
import os
import sys

import pytest
import torch
from conftest import BIN, PYTHON, ROOT, free_port, run, tiny_overrides, torchrun
from runs import assert_same_run as assert_runs_equal
from runs import metrics
from safetensors.torch import load_file

COMMON = ["data.eval_file=null", "grpo.max_steps=2", "grpo.learning_rate=1e-4", "logging.sample_steps=0",
          "checkpoint.save_steps=0", "grpo.per_device_train_batch_size=16",  # 2 prompts x 8 completions
          "rewards.functions=[spread_reward:distinct_characters]",
          # a GPU machine without vLLM's CUDA build (bench/gpu_check.sh) samples with transformers
          *([] if importlib.util.find_spec("vllm") else ["rollout.engine=hf"])]
HELPERS = {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "helpers")])}  # the reward


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """{data, warm}: the demo task and a random tiny Qwen2 with an untied LM head (under "warm",
    where tiny_overrides takes the starting model from)."""
    base = tmp_path_factory.mktemp("untied")
    paths = {"data": str(base / "data"), "warm": str(base / "model")}
    run([PYTHON, "tools/make_demo_data.py", "--out", paths["data"]])
    run([PYTHON, "tools/make_tiny_model.py", "--out", paths["warm"], "--corpus",
         os.path.join(paths["data"], "sft.jsonl"), "--no-tie-embeddings"])
    # The model's config has a pad_token_id, and a random model samples that token: its
    # embedding row gets no gradient (padding_idx) in the HF model and in the pipeline's
    # embedding stage alike, or pp=2 would differ from one rank.
    config = json.load(open(os.path.join(paths["warm"], "config.json")))
    assert config["pad_token_id"] is not None
    start = load_file(os.path.join(paths["warm"], "model.safetensors"))
    assert config["tie_word_embeddings"] is False and "lm_head.weight" in start
    assert not torch.equal(start["lm_head.weight"], start["model.embed_tokens.weight"])
    return paths


def _train_args(model, out, extra):
    return ["megagrpo.train", "--config", "configs/tiny_arith.yaml", *tiny_overrides(model, out), *COMMON, *extra]


def train_one_rank(model, out, *extra, timeout=600):
    return run([sys.executable, "-m", *_train_args(model, out, extra)], timeout=timeout, env=HELPERS)


def train_two_ranks(model, out, *extra):
    return run([*torchrun(2, "-m"), *_train_args(model, out, extra)], timeout=800, env=HELPERS)


def check_trained(out, start_folder) -> tuple[dict, dict]:
    """The run logged a finite loss at steps 1 and 2 and its HF export holds the starting
    model's tensors, some of them moved by training. Returns (scalars, exported tensors)."""
    values = metrics(out)
    assert [s for s, _ in values["train/loss"]] == [1, 2], values["train/loss"]
    assert all(math.isfinite(v) for _, v in values["train/loss"]), values["train/loss"]
    exported = load_file(str(out / "hf" / "model.safetensors"))
    start = load_file(os.path.join(start_folder, "model.safetensors"))
    assert sorted(exported) == sorted(start)
    # compared in the export's dtype (a bf16 run exports bf16: rounding alone is no training)
    moved = {k: (exported[k].float() - start[k].to(exported[k].dtype).float()).abs().max().item() for k in start}
    assert max(moved.values()) > 1e-6, moved
    return values, exported


def assert_same_run(out, reference):
    """An fp32 layout against the one-rank run (runs.assert_same_run): losses, gradient norms,
    parameters, prompts and completions."""
    assert_runs_equal(out, reference, loss_atol=1e-5, grad_norm_rtol=1e-4, param_atol=1e-5)
    # the rollout engine samples with the trainer's weights (the head's included) at step 2
    assert max(v for _, v in metrics(out)["train/sampling/sampling_logp_difference/max"]) < 1e-3


@pytest.fixture(scope="module")
def one_rank(untied, tmp_path_factory):
    """The reference run: one rank, fp32, ZeRO-3 (tiny_arith.yaml's), reference model (kl 0.02)."""
    out = tmp_path_factory.mktemp("one_rank")
    train_one_rank(untied, out)
    values, exported = check_trained(out, untied["warm"])
    return out, values, exported


def test_untied_head_one_rank_exports_an_untied_model(untied, one_rank, tmp_path):
    """The HF export loads in transformers with its own head (trained, not the embedding), and
    the ZeRO-3 checkpoint converts offline to the same tensors."""
    from transformers import AutoModelForCausalLM

    from megagrpo.checkpoints.convert import main as convert

    out, values, exported = one_rank
    assert max(v for _, v in values["train/sampling/sampling_logp_difference/max"]) < 1e-3
    start = load_file(os.path.join(untied["warm"], "model.safetensors"))
    assert (exported["lm_head.weight"] - start["lm_head.weight"]).abs().max() > 1e-6  # the head trained
    model = AutoModelForCausalLM.from_pretrained(str(out / "hf"), dtype=torch.float32)
    assert model.config.tie_word_embeddings is False
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head.data_ptr() != embedding.data_ptr() and not torch.equal(head, embedding)
    assert torch.equal(head, exported["lm_head.weight"])
    assert torch.equal(embedding, exported["model.embed_tokens.weight"])
    converted = tmp_path / "converted"
    assert convert(["to-hf", str(out / "checkpoints" / "step_00000002"), str(converted)]) == 0
    c = load_file(str(converted / "model-00001.safetensors"))
    assert sorted(c) == sorted(exported) and all(torch.equal(c[k], exported[k]) for k in exported)


@pytest.mark.multirank
def test_untied_head_pipeline_round_trip(untied, one_rank, tmp_path):
    """hf-to-pipeline keeps every tensor (the head in the last stage's file); 2 pipeline stages
    (ZeRO-0) train from those files as one rank does; the pipeline checkpoint converts back to
    the live export's tensors."""
    staged = tmp_path / "staged"
    run([f"{BIN}/megagrpo", "convert", "hf-to-pipeline", untied["warm"], str(staged), "--pipeline-parallel-size", "2"])
    weight_map = json.load(open(staged / "model.safetensors.index.json"))["weight_map"]
    start = load_file(os.path.join(untied["warm"], "model.safetensors"))
    assert sorted(weight_map) == sorted(start)
    assert weight_map["lm_head.weight"] == "model-stage002-of-002.safetensors"
    assert weight_map["model.embed_tokens.weight"] == "model-stage001-of-002.safetensors"
    for file in set(weight_map.values()):
        tensors = load_file(str(staged / file))
        assert sorted(tensors) == sorted(n for n, f in weight_map.items() if f == file), file
        assert all(torch.equal(t, start[n]) for n, t in tensors.items()), file

    out = tmp_path / "pp2"
    proc = train_two_ranks(untied, out, f"model.name_or_path={staged}", "parallel.pipeline_parallel_size=2",
                           "deepspeed=configs/ds_zero0.json", "checkpoint.save_steps=2")
    assert "world 2 = dp 1 x tp 1 x pp 2" in proc.stdout
    values, exported = check_trained(out, untied["warm"])
    assert_same_run(out, one_rank[0])
    assert not torch.equal(exported["lm_head.weight"], exported["model.embed_tokens.weight"])

    converted = tmp_path / "converted"
    run([f"{BIN}/megagrpo", "convert", "to-hf", str(out / "checkpoints" / "step_00000002"), str(converted)])
    c = load_file(str(converted / "model-00001.safetensors"))
    assert sorted(c) == sorted(exported) and all(torch.equal(c[k], exported[k]) for k in exported)


@pytest.mark.multirank
@pytest.mark.parametrize("ds", ["ds_zero0", "ds_zero1", "ds_zero2"])
def test_tensor_parallel(untied, one_rank, tmp_path, ds):
    """tp=2 (AutoTP; the untied head replicated) under ZeRO 0, 1 and 2 equals one rank."""
    out = tmp_path / f"tp2_{ds}"
    proc = train_two_ranks(untied, out, "parallel.tensor_parallel_size=2", f"deepspeed=configs/{ds}.json")
    assert "world 2 = dp 1 x tp 2 x pp 1" in proc.stdout
    check_trained(out, untied["warm"])
    assert_same_run(out, one_rank[0])


def test_zero3_offload_equals_one_rank(untied, one_rank, tmp_path):
    """ZeRO-3 with parameters and optimizer state offloaded to CPU (DeepSpeed's CPU Adam) is the
    one-rank run: an offload optimizer with a wrong scale or a lost update would differ."""
    out = tmp_path / "offload"
    # the first offload run on a machine JIT-compiles DeepSpeed's CPU Adam (minutes on 2 cores)
    train_one_rank(untied, out, "deepspeed=configs/ds_zero3_offload.json", timeout=840)
    check_trained(out, untied["warm"])
    assert_same_run(out, one_rank[0])


# bf16 against float32 at step 1 (same completions): the loss is -sum(A * ratio) / tokens + kl,
# with ratio 1 and kl 0 at the first step in any precision, so only the importance weights
# exp(logp_old - logp_sampler) carry rounding into it (measured on CPU: 1.2e-5 of 0.124); the
# gradient norm carries bf16's rounding through the forward and backward pass (2^-8 relative
# per operation; measured 4.3e-4 relative); vLLM's sampling log-probs against the trainer's,
# both bf16 (measured 3.9e-3)
BF16_LOSS_ABS, BF16_GRAD_NORM_REL, BF16_SAMPLING_LOGP = 5e-3, 2e-2, 2e-2


@pytest.mark.multirank
@pytest.mark.gpu_check
def test_bf16_zero3_within_bf16_of_float32(untied, one_rank, tmp_path, record_property):
    """2 GRPO steps in bf16 under ZeRO-3 (configs/ds_zero3_bf16.json) through the DeepSpeed
    launcher (one GPU, or one CPU rank) train, and at step 1 equal the float32 one-rank run
    within bf16's bounds: both sample the same completions there (same seeds, same starting
    weights, same rewards), so the loss and gradient norm differ by rounding alone."""
    out = tmp_path / "bf16"
    run([f"{BIN}/deepspeed", "--num_gpus", "1", "--master_port", str(free_port()), "--module",
         *_train_args(untied, out, ["model.dtype=bfloat16", "deepspeed=configs/ds_zero3_bf16.json"])],
        timeout=600, env=HELPERS)
    values, _ = check_trained(out, untied["warm"])
    reference = one_rank[1]
    first = {tag: values[tag][0][1] for tag in ("train/loss", "train/grad_norm", "train/reward",
                                                 "train/completions/mean_length")}
    ref = {tag: reference[tag][0][1] for tag in first}
    for tag in first:
        record_property(f"step1 {tag} bf16", first[tag])
        record_property(f"step1 {tag} float32", ref[tag])
    # the same completions at step 1, or the comparison below would be of different batches
    assert (first["train/reward"], first["train/completions/mean_length"]) == \
        (ref["train/reward"], ref["train/completions/mean_length"]), (first, ref)
    assert abs(first["train/loss"] - ref["train/loss"]) <= BF16_LOSS_ABS, (first, ref)
    assert abs(first["train/grad_norm"] / ref["train/grad_norm"] - 1) <= BF16_GRAD_NORM_REL, (first, ref)
    if "train/sampling/sampling_logp_difference/max" in values:  # vLLM sampled (not transformers)
        sampling = max(v for _, v in values["train/sampling/sampling_logp_difference/max"])
        record_property("sampling_logp_difference_max", sampling)
        assert sampling <= BF16_SAMPLING_LOGP, sampling


# CISPO on the highest-entropy fifth of the tokens, with the off-policy sequence mask (GSPO and
# the entropy bonus are held to one rank under tp and pp: tests/test_policy_parallel.py); no
# reference model, and completions cut at max_new_tokens left out of the loss. A stop string
# ends some of the random model's completions before the 8th token (its EOS is rare), so some
# are cut, not all
CISPO = ["grpo.loss_type=cispo", "grpo.top_entropy_quantile=0.2", "grpo.off_policy_mask_threshold=0.0",
         "grpo.kl_coef=0", "grpo.mask_truncated_completions=true", "rollout.max_new_tokens=8", "rollout.stop=[e]"]


def test_cispo_configuration(untied, tmp_path):
    """The CISPO run trains, its masks leave out what they should, and the loss its resolved
    configuration computes is CISPO's equation (docs/objectives.md), written out here:
    mean over the step's tokens of -sg(min(ratio, 1+eps_high)) * A * logp * keep * w_is + kl_coef * k3
    (times the ratio: use_bias_correction_kl)."""
    from megagrpo.validation import load_config

    out = tmp_path / "run"
    train_one_rank(untied, out, *CISPO)
    values, _ = check_trained(out, untied["warm"])
    masked = [v for _, v in values["train/entropy/masked"]]  # four fifths of the tokens left out
    assert all(0.7 < v < 0.85 for v in masked), masked
    assert all(0 <= v < 1 for _, v in values["train/sampling/off_policy_masked"]), values
    # at step 1 the policy is the sampler's old policy (ratio 1): nothing above 1 + eps_high
    assert values["train/clip_ratio/high_mean"][0] == (1, 0.0), values["train/clip_ratio/high_mean"]
    assert "train/kl" not in values  # no reference model, no KL term
    clipped = [v for _, v in values["train/completions/clipped_ratio"]]  # some cut, some trained on
    assert max(clipped) > 0 and min(clipped) < 1, clipped

    run_config = load_config("configs/tiny_arith.yaml", [*tiny_overrides(untied, out), *COMMON, *CISPO]).grpo
    assert (run_config.loss_type, run_config.importance_sampling_correction, run_config.kl_coef) == (
        "cispo", "token_truncate", 0)
    for g in (run_config, dataclasses.replace(run_config, kl_coef=0.05)):  # the KL term's part too
        check_cispo_equation(g)


def check_cispo_equation(g) -> None:
    """micro_batch_loss under config g (CISPO) equals CISPO's equation, in value and gradient,
    on random float64 tensors; without its masks the equation would differ."""
    from megagrpo.algorithm.loss import LossInputs, micro_batch_loss

    gen = torch.Generator().manual_seed(0)
    B, T = 6, 9
    mask = (torch.arange(T) < torch.tensor([9, 7, 5, 9, 3, 8])[:, None]).double()
    logp = (-torch.rand(B, T, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    entropy = torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    old, ref, sampler = (logp.detach() + torch.randn(B, T, generator=gen, dtype=torch.float64) * s
                         for s in (0.3, 0.2, 0.1))
    adv = torch.tensor([1.2, -0.7, 0.3, -1.5, 0.9, -0.2], dtype=torch.float64)
    normalisers = {"num_sequences": B, "num_tokens": float(mask.sum()), "max_sampled_tokens": T}
    ours = micro_batch_loss(g, logp, entropy, LossInputs(mask, adv, sampler, old, ref), normalisers, 1.0, None)

    def equation(masks: bool):
        ratio, eps_high = torch.exp(logp - old), g.epsilon if g.epsilon_high is None else g.epsilon_high
        w_is = torch.exp(old - sampler).clamp(max=g.importance_sampling_cap)
        off_policy = ((sampler - logp.detach()) * mask).sum(1) / mask.sum(1)
        keep = ((adv >= 0) | (off_policy <= g.off_policy_mask_threshold))[:, None] & (
            entropy >= torch.quantile(entropy[mask.bool()], 1 - g.top_entropy_quantile)) if masks else 1
        kl = (torch.exp(ref - logp) - (ref - logp) - 1) * (ratio if g.use_bias_correction_kl else 1)
        token = -ratio.clamp(max=1 + eps_high).detach() * adv[:, None] * logp * keep * w_is + g.kl_coef * kl
        return (token * mask).sum() / mask.sum()

    expected = equation(masks=True)
    assert abs(ours.item() - expected.item()) < 1e-12, (ours.item(), expected.item())
    got_grad, = torch.autograd.grad(ours, logp)
    expected_grad, = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(got_grad, expected_grad, atol=1e-12, rtol=0)
    assert abs(equation(masks=False).item() - expected.item()) > 1e-3  # the masks matter here
