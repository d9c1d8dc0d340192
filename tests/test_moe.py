"""Mixture-of-experts policies (docs/moe.md): tiny random Qwen3-MoE and Mixtral models from
tools/make_tiny_model.py --arch (8 experts, top 2), trained with vLLM co-located.

Each trains 2 steps of 2 update passes (routing replay R2, 32 completions a step) on one rank
and on 2 ranks with ep 2 and ZeRO-3 (DeepSpeed's AutoEP: each rank holds 4 experts per layer,
tokens go to them by all-to-all over gloo); Qwen3-MoE also on dp 2 with ZeRO-3 (its experts
partitioned; vLLM at tp 2 there), ep 2 with ZeRO-1, and dp 2 x ep 2 on 4 ranks (2 copies of each
expert). Each is held to the one-rank run: the losses and gradient norms, the parameters after 2
steps, vLLM's log-probs after each sync (whose experts are reloaded under their per-expert
checkpoint names). `convert to-hf` of the ep 2 checkpoint (the ranks' expert shards joined)
equals its export; the ep 2 checkpoint resumes on one rank (ep 1) into the one-rank run's step
3. The one-rank Qwen3-MoE run is repeated without replay: the routes of the update after an
optimizer step differ from the old-policy pass's there, and with R2 they do not, while the
routers' own choice moved as much. (The load-balancing loss is on in that run only: computed per
micro-batch, as transformers computes it per forward, it is not the same sum over other
micro-batches, so runs with it on differ across layouts.)"""
import json
import os
import shutil
import sys

import pytest
import torch
from conftest import PYTHON, ROOT, run, tiny_overrides, torchrun
from runs import assert_same_run, values
from safetensors.torch import load_file

from megagrpo.checkpoints.convert import main as convert

COMMON = ["data.eval_file=null", "grpo.max_steps=2", "grpo.learning_rate=1e-3", "logging.sample_steps=0",
          "grpo.num_iterations=2",
          "rewards.functions=[spread_reward:distinct_characters]"]
HELPERS = {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "helpers")])}  # the reward
EXPERT_NAMES = {"qwen3_moe": "model.layers.0.mlp.experts.7.up_proj.weight",
                "mixtral": "model.layers.0.block_sparse_moe.experts.7.w3.weight"}


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory):
    """arch -> the tiny random model, made once for this file's tests."""
    made = {}

    def model_of(arch):
        if arch not in made:
            made[arch] = make_model(tiny, tmp_path_factory.mktemp("moe"), arch)
        return made[arch]
    return model_of


def make_model(tiny, tmp_path, arch):
    model = tmp_path / arch
    run([PYTHON, "tools/make_tiny_model.py", "--arch", arch, "--out", str(model),
         "--corpus", os.path.join(tiny["data"], "sft.jsonl")])
    config = json.load(open(model / "config.json"))
    assert config["model_type"] == arch and config["num_experts_per_tok"] == 2
    assert config.get("num_experts", config.get("num_local_experts")) == 8
    assert EXPERT_NAMES[arch] in load_file(str(model / "model.safetensors"))  # the checkpoint's names, per expert
    return model


def train(tiny, tmp_path, name, launch, model, *extra):
    out = tmp_path / name
    run([*launch, "megagrpo.train", "--config", "configs/tiny_arith.yaml",
         *tiny_overrides({**tiny, "warm": str(model)}, out), *COMMON, *extra], timeout=600, env=HELPERS)
    return out


def check_expert_metrics(out, experts=8):
    for step in range(len(values(out, "train/moe/load_max"))):
        top, bottom = values(out, "train/moe/load_max")[step], values(out, "train/moe/load_min")[step]
        assert 1 / experts < top <= 1 and 0 <= bottom < 1 / experts, (top, bottom)
        assert 0 < values(out, "train/moe/load_entropy")[step] <= 1
        assert values(out, "train/moe/layer_1/load_max")[step] <= top


@pytest.mark.multirank
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_layouts_equal_one_rank_and_replay_holds_the_routes(tiny, models, tmp_path, arch):
    model = models(arch)
    one = train(tiny, tmp_path, "one_rank", [sys.executable, "-m"], model, "grpo.per_device_train_batch_size=32",
                "grpo.max_steps=3", "checkpoint.save_steps=2")
    two = [torchrun(2, "-m"), model, "grpo.per_device_train_batch_size=16", "checkpoint.save_steps=2"]
    layouts = {"ep2_zero3": train(tiny, tmp_path, "ep2_zero3", *two, "deepspeed=configs/ds_zero3.json",
                                  "parallel.expert_parallel_size=2")}
    if arch == "qwen3_moe":
        # vLLM tp 2 as well: one engine over both ranks, each expert sliced in two
        layouts["dp2_zero3"] = train(tiny, tmp_path, "dp2_zero3", *two, "deepspeed=configs/ds_zero3.json",
                                     "rollout.tensor_parallel_size=2")
        layouts["ep2_zero1"] = train(tiny, tmp_path, "ep2_zero1", *two, "deepspeed=configs/ds_zero1.json",
                                     "parallel.expert_parallel_size=2")
        # 4 ranks: dp 4 for the dense weights, 2 copies of each expert (their gradients averaged)
        layouts["dp2_ep2_zero3"] = train(tiny, tmp_path, "dp2_ep2_zero3", torchrun(4, "-m"), model,
                                         "grpo.per_device_train_batch_size=8", "checkpoint.save_steps=2",
                                         "deepspeed=configs/ds_zero3.json", "parallel.expert_parallel_size=2")
    start = load_file(str(model / "model.safetensors"))
    for name, out in layouts.items():
        assert_same_run(out, one, steps=[1, 2], checkpoint="step_00000002", loss_atol=1e-5, grad_norm_rtol=1e-5,
                        param_atol=1e-5)
        exported = load_file(str(out / "hf" / "model.safetensors"))
        assert sorted(exported) == sorted(start), name  # the export keeps the checkpoint's per-expert names
        assert (exported[EXPERT_NAMES[arch]] - start[EXPERT_NAMES[arch]]).abs().max() > 1e-4  # an expert trained
    for out in (one, *layouts.values()):
        # vLLM samples what the trainer scores, after each sync of the experts
        assert max(values(out, "train/sampling/sampling_logp_difference/max")) < 1e-4
        check_expert_metrics(out)
        assert set(values(out, "train/moe/route_flips")) == {0.0}  # R2: the update used the old pass's routes
    assert max(values(one, "train/moe/route_flips_own")) > 0  # ... where the routers would have moved some
    # offline: AutoEP's expert shards joined, under the per-expert names, equal to the export
    ep2, converted = layouts["ep2_zero3"], tmp_path / "converted"
    assert convert(["to-hf", str(ep2 / "checkpoints" / "step_00000002"), str(converted)]) == 0
    offline = load_file(str(converted / "model-00001.safetensors"))
    exported = load_file(str(ep2 / "hf" / "model.safetensors"))
    assert sorted(offline) == sorted(exported) and all(torch.equal(offline[k], exported[k]) for k in exported)
    if arch != "qwen3_moe":
        return
    # the ep 2 checkpoint resumes on one rank (ep 1, re-sharded): its step 3 is the one-rank run's
    resumed = tmp_path / "resumed"
    shutil.copytree(ep2 / "checkpoints", resumed / "checkpoints")
    train(tiny, tmp_path, "resumed", [sys.executable, "-m"], model, "grpo.per_device_train_batch_size=32",
          "grpo.max_steps=3", "checkpoint.save_steps=0", "checkpoint.resume=auto")
    assert_same_run(resumed, one, steps=[3], loss_atol=1e-5, grad_norm_rtol=1e-5, param_atol=1e-5)
    fresh = train(tiny, tmp_path, "no_replay", [sys.executable, "-m"], model, "grpo.per_device_train_batch_size=32",
                  "checkpoint.save_steps=0", "rollout.routing_replay=none", "model.router_aux_loss_coef=0.01")
    flips, own = values(fresh, "train/moe/route_flips"), values(fresh, "train/moe/route_flips_own")
    assert min(flips) > 0 and flips == own, (flips, own)  # without replay the used routes are the routers' own
    assert min(values(fresh, "train/moe/aux_loss")) > 0  # the load-balancing loss, on


def test_the_moe_quickstart_config_validates_on_the_tiny_moe_model(tiny, models, tmp_path):
    from megagrpo.validation import load_config

    cfg = load_config("configs/tiny_moe.yaml", tiny_overrides({**tiny, "warm": str(models("qwen3_moe"))}, tmp_path))
    assert (cfg.parallel.expert_parallel_size, cfg.rollout.routing_replay, cfg.grpo.num_iterations) == (2, "r2", 2)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_routes_are_recorded_replayed_and_counted_in_one_forward(models, arch):
    """In process, on the tiny model: replaying a forward's own routes gives the same logits bit
    for bit; other routes change them while the router still gets its gradient; the
    load-balancing loss equals transformers' own; padding is not counted."""
    from transformers import AutoModelForCausalLM

    from megagrpo.policy.moe import attach_routing

    model = AutoModelForCausalLM.from_pretrained(str(models(arch)), dtype=torch.float32)
    routing = attach_routing(model)
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    routing.keep_logits = True
    out = model(ids, output_router_logits=True)
    routes = routing.recorded()
    assert len(routes) == 2 and routes[0].shape == (24, 2) and routes[0].dtype == torch.uint8
    torch.testing.assert_close(routing.aux_loss(), out.aux_loss, rtol=1e-6, atol=0)  # transformers' own
    routing.replay = routes
    assert torch.equal(model(ids).logits, out.logits)
    moved = [(r.long() + 1) % 8 for r in routes]  # every token to other experts
    routing.replay = moved
    replayed = model(ids).logits
    assert (replayed - out.logits).abs().max() > 1e-3
    assert all(torch.equal(used.long(), want) for used, want in zip(routing.routes, moved))
    replayed.sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routing.routers)
    assert routing.flipped_tokens(routing.routes, routes) == 24  # all moved
    routing.replay, routing.real_tokens = None, torch.arange(24) < 20  # the last 4 tokens are padding
    model(ids)
    routing.count_load()
    assert routing.load.sum(dim=1).tolist() == [40.0, 40.0]  # 20 real tokens x top 2, per layer


def test_a_lora_policy_on_a_mixture_of_experts_adapts_attention_and_syncs_the_experts(tiny, models, tmp_path):
    """LoRA (all-linear) on the tiny Qwen3-MoE, one rank, ZeRO-3: the adapters go on the attention
    (the experts are 3-D tensors, not linear layers, so they stay frozen, as do the routers);
    vLLM samples what the trainer scores after each merged sync, experts included; the export
    is merged, under the per-expert names."""
    model = models("qwen3_moe")
    out = train(tiny, tmp_path, "lora", [sys.executable, "-m"], model, "grpo.per_device_train_batch_size=16",
                "checkpoint.save_steps=0", "model.lora.r=8", "model.lora.alpha=16", "grpo.learning_rate=1e-2",
                "deepspeed=configs/ds_zero3.json")
    assert max(values(out, "train/sampling/sampling_logp_difference/max")) < 1e-4
    start, merged = load_file(str(model / "model.safetensors")), load_file(str(out / "hf" / "model.safetensors"))
    assert sorted(merged) == sorted(start)
    moved = {name for name in start if not torch.equal(merged[name], start[name])}
    assert moved and all(".self_attn." in name for name in moved), sorted(moved)
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert adapter and not any("experts" in name or "mlp.gate" in name for name in adapter)



def test_r3_the_samplers_routes_are_laid_out_and_replayed_in_every_layout(tiny, models, tmp_path):
    """Routing replay R3 in process, on the tiny Qwen3-MoE in float32: transformers' sampler
    (rollout.engine hf) records each completion's routes, one per token it fed; the trainer
    lays them out packed and padded, and its own routers agree with them at every fed token (so
    a misplaced route would show as flips); routes moved to other experts are used instead and
    change the log-probs; the routes survive a checkpoint of the rollouts sampled ahead; the
    sampler takes the trainer's per-expert weight stream; vLLM on CPU is refused with the reason."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from megagrpo.checkpoints import rollouts_ahead
    from megagrpo.config.schema import ConfigError
    from megagrpo.policy.batch import Completion, make_batch
    from megagrpo.policy.logprobs import completion_logprobs, install_logprob_head
    from megagrpo.policy.moe import attach_routing, checkpoint_names
    from megagrpo.rollout.ahead import AheadBatch
    from megagrpo.rollout.generators import HFGenerator
    from megagrpo.rollout.vllm_settings import vllm_settings
    from megagrpo.validation import load_config

    path = str(models("qwen3_moe"))
    cfg = load_config("configs/tiny_arith.yaml", tiny_overrides({**tiny, "warm": path}, tmp_path) + [
        "rollout.engine=hf", "rollout.routing_replay=r3"])
    sampler = HFGenerator(cfg, path, seed=0)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    completions = [c for group in sampler.generate(prompts, n=2, seeds=[1, 2]) for c in group]
    rows = [p for p in prompts for _ in range(2)]
    for prompt, c in zip(rows, completions):  # every token fed: the prompt and all but the last sampled
        assert c.routes.shape == (len(prompt) + len(c.token_ids) - 1, 2, 2) and c.routes.dtype == np.uint8
    batch = make_batch(rows, completions, torch.zeros(4), pad_id=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    install_logprob_head(model, chunk_size=1024)
    routing = attach_routing(model)
    unrouted = make_batch(rows, [Completion(c.token_ids, c.logprobs, c.truncated) for c in completions],
                          torch.zeros(4), pad_id=0)
    for packing in (True, False):
        replayed = completion_logprobs(model, batch, 1.0, packing=packing)[0]
        routing.count_sampler_flips()
        own = completion_logprobs(model, unrouted, 1.0, packing=packing)[0]
        assert torch.equal(replayed, own)  # the sampler's routes are the trainer's own here (float32)
        assert (replayed - batch.sampler_logp).abs().max() < 1e-5
    fed = sum(len(c.routes) for c in completions)
    assert routing.sampler_flips.tolist() == [0.0, 2.0 * fed]  # both layouts: no fed token routed otherwise
    moved = [Completion(c.token_ids, c.logprobs, c.truncated, routes=(c.routes + 1) % 8) for c in completions]
    routing.sampler_flips.zero_()
    changed = completion_logprobs(model, make_batch(rows, moved, torch.zeros(4), pad_id=0), 1.0)[0]
    routing.count_sampler_flips()
    assert routing.sampler_flips.tolist() == [fed, fed] and (changed - replayed).abs().max() > 1e-2
    # the rollouts sampled ahead keep their routes through a checkpoint (JSON, no pickle)
    rollouts_ahead.save(str(tmp_path), 0, [AheadBatch(3, [0, 1], [completions[:2], completions[2:]], 2, 0.5)])
    back = [c for group in rollouts_ahead.read(str(tmp_path / rollouts_ahead.file_name(0)))[0].groups for c in group]
    assert all(np.array_equal(a.routes, b.routes) and a.routes.dtype == b.routes.dtype
               for a, b in zip(back, completions))
    # the sampler takes the trainer's weight stream, whose experts have per-expert names
    for param in sampler.model.parameters():
        param.data.normal_()
    sampler.load_weights(checkpoint_names(model.named_parameters(), model))
    theirs = dict(sampler.model.named_parameters())
    assert all(torch.equal(param, theirs[name]) for name, param in model.named_parameters())
    with pytest.raises(ConfigError, match="Model Runner V2"):
        vllm_settings(cfg, path, 0, 1, on_gpu=False)
    on_gpu = vllm_settings(cfg, path, 0, 1, on_gpu=True)
    assert on_gpu["enable_return_routed_experts"] and on_gpu["enable_prefix_caching"]


@pytest.mark.multirank
@pytest.mark.gpu_check
def test_routing_replay_r3_narrows_the_sampler_gap_in_bf16(tiny, models, tmp_path, record_property):
    """bf16, the tiny Qwen3-MoE, 3 steps with the reference on: the sampler (vLLM on CUDA, which
    returns its routes there; transformers' generate on CPU) routes some tokens otherwise than
    the trainer (moe/sampler_route_flips); with R3 the trainer scores them through the sampler's
    experts and the sampler/trainer log-prob gap narrows against no replay, in the reference,
    old-policy and update passes alike (the updates use no route other than the sampler's). On
    CPU also with ep 2 on 2 ranks under ZeRO-3 (AutoEP's routers and the reference's)."""
    import importlib.util

    engine = "vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") else "hf"
    model, common = models("qwen3_moe"), ["model.dtype=bfloat16", f"rollout.engine={engine}", "grpo.max_steps=3",
                                          "checkpoint.save_steps=0"]
    one = [[sys.executable, "-m"], model, "grpo.per_device_train_batch_size=32", *common]
    runs = {mode: train(tiny, tmp_path, mode, *one, f"rollout.routing_replay={mode}") for mode in ("none", "r3")}
    if not torch.cuda.is_available():
        runs["r3_ep2"] = train(tiny, tmp_path, "r3_ep2", torchrun(2, "-m"), model, *common,
                               "grpo.per_device_train_batch_size=16", "deepspeed=configs/ds_zero3_bf16.json",
                               "parallel.expert_parallel_size=2", "rollout.routing_replay=r3")
    gap = {name: values(out, "train/sampling/sampling_logp_difference/mean") for name, out in runs.items()}
    flips = {name: values(out, "train/moe/sampler_route_flips") for name, out in runs.items() if name != "none"}
    for name in gap:
        record_property(f"{name} sampler gap (mean per step)", gap[name])
    for name in flips:
        record_property(f"{name} sampler route flips", flips[name])
        assert set(values(runs[name], "train/moe/route_flips")) == {0.0}
        assert max(gap[name]) < min(gap["none"]), gap
    assert values(runs["none"], "train/moe/sampler_route_flips") == []  # no routes sampled without r3
    assert max(flips["r3"]) > 0, flips  # bf16 routes some tokens otherwise in the sampler
