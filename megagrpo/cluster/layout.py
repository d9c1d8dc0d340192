"""The parallel layout's rules, checked before anything is built or launched: what DeepSpeed, the
model and this version can run, each refusal naming the fix. The generator's own rules live in
generator_layout.py; this calls them."""
from __future__ import annotations

import json
import os

import torch

from megagrpo.cluster.generator_layout import (
    GeneratorLayout,
    check_disaggregated,
    check_generator_layout,
    generator_layout,
)
from megagrpo.config.deepspeed_json import zero_stage
from megagrpo.config.schema import Config, max_sequence_length, require

PIPELINE_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def check_layout(cfg: Config) -> GeneratorLayout:
    """Layouts DeepSpeed or the model cannot run are refused here, before anything is built;
    returns the generator's layout."""
    p = cfg.parallel
    tp, pp, sp = p.tensor_parallel_size, p.pipeline_parallel_size, p.sequence_parallel_size
    require(tp >= 1, f"parallel.tensor_parallel_size: {tp} must be >= 1")
    require(pp >= 1, f"parallel.pipeline_parallel_size: {pp} must be >= 1")
    if pp > 1:
        stage = zero_stage(cfg.deepspeed)
        require(stage <= 1, f"parallel.pipeline_parallel_size={pp} with ZeRO stage {stage}: DeepSpeed "
                "runs pipelines with ZeRO stage 0 or 1 only; use configs/ds_zero0.json or a "
                "stage-1 config, or pipeline_parallel_size=1")
    world = os.environ.get("WORLD_SIZE")
    if cfg.rollout.placement == "disaggregated":
        world = check_disaggregated(cfg, world)  # the trainers' share of the launch
    if world is not None:
        require(int(world) % (tp * pp * sp) == 0,
                f"world size {world} is not divisible by tensor_parallel_size x pipeline_parallel_size x "
                f"sequence_parallel_size = {tp} x {pp} x {sp}; launch a multiple of {tp * pp * sp} ranks")
    model_config = os.path.join(cfg.model.name_or_path, "config.json")
    model = {}
    if (tp > 1 or pp > 1 or sp > 1) and os.path.isfile(model_config):
        with open(model_config) as f:
            model = json.load(f)
    heads = model.get("num_attention_heads")
    kv_heads = model.get("num_key_value_heads", heads)
    check_sequence_parallel(cfg, heads or sp, kv_heads or sp)
    if model and (tp > 1 or pp > 1):
        for name, count in (("attention heads", heads), ("key-value heads", kv_heads)):
            require(count is None or count % tp == 0,
                    f"parallel.tensor_parallel_size={tp} does not divide the model's {count} "
                    f"{name}; use a divisor of {count}")
        require(pp == 1 or model.get("model_type") in PIPELINE_ARCHITECTURES,
                f"parallel.pipeline_parallel_size={pp}: no pipeline layer map for model_type "
                f"'{model.get('model_type')}' (supported: {', '.join(PIPELINE_ARCHITECTURES)})")
        layers = model.get("num_hidden_layers", pp)
        require(layers >= pp, f"parallel.pipeline_parallel_size={pp} exceeds the model's "
                f"{layers} layers")
    if pp > 1:
        require(cfg.grpo.packing, f"parallel.pipeline_parallel_size={pp} needs grpo.packing=true "
                "(the stages pass packed rows, not padded ones)")
    if cfg.model.tiled_mlp:
        require(pp == 1 and zero_stage(cfg.deepspeed) in (0, 3), "model.tiled_mlp=true runs with ZeRO stage 0 "
                "or 3 and no pipeline (ZeRO 1-2 would reduce a gradient once per tile): use "
                "configs/ds_zero3.json, or model.tiled_mlp=false")
    layout = check_generator_layout(cfg, world)
    check_kv_cache(cfg)
    return layout


def check_sequence_parallel(cfg: Config, heads: int, kv_heads: int) -> None:
    """The layouts sp composes with in this version, each refusal naming the fix."""
    sp, key = cfg.parallel.sequence_parallel_size, "parallel.sequence_parallel_size"
    require(sp >= 1, f"{key}: {sp} must be >= 1")
    if sp == 1:
        return
    require(cfg.parallel.tensor_parallel_size == 1 and cfg.parallel.pipeline_parallel_size == 1,
            f"{key}={sp} with tensor_parallel_size={cfg.parallel.tensor_parallel_size} and "
            f"pipeline_parallel_size={cfg.parallel.pipeline_parallel_size}: sequence parallelism composes "
            "with data parallelism and ZeRO 0-3 only in this version; set both to 1")
    require(cfg.grpo.packing, f"{key}={sp} needs grpo.packing=true: the sequences of a micro-batch are "
            "packed into one row, which the sp ranks split")
    require(heads % sp == 0, f"{key}={sp} does not divide the model's {heads} attention heads "
            "(Ulysses gives each rank heads/sp of them): choose a divisor")
    require(kv_heads % sp == 0 or sp % kv_heads == 0,
            f"{key}={sp} and the model's {kv_heads} key/value heads: one must divide the other")


def check_kv_cache(cfg: Config) -> None:
    """A co-located vLLM engine on CPU holds rollout.cpu_kv_cache_gb of KV cache, and vLLM does
    not start when one trajectory (max_model_len) does not fit it: refused before launch, with
    the length that fits and the cache that would hold this one. (On GPU vLLM sizes its cache
    from gpu_memory_utilization at start-up and says so itself.)"""
    r, path = cfg.rollout, os.path.join(cfg.model.name_or_path, "config.json")
    if (r.engine != "vllm" or r.servers or r.placement != "colocated" or torch.cuda.is_available()
            or not os.path.isfile(path)):
        return
    with open(path) as f:
        config = json.load(f)
    config = config.get("text_config", config)  # a vision-language model's language model
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = -(-config.get("num_key_value_heads", heads) // generator_layout(cfg).generator_tp)
    per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * (4 if cfg.model.dtype == "float32" else 2)
    holds, need = int(r.cpu_kv_cache_gb * 2**30) // per_token, max_sequence_length(cfg)
    require(need <= holds, f"rollout.cpu_kv_cache_gb={r.cpu_kv_cache_gb} holds {holds} tokens of this model's KV "
            f"cache ({per_token} bytes each), fewer than one trajectory's {need} (rollout.max_model_len, by default "
            f"the prompt and every turn): lower rollout.max_new_tokens so that the trajectory fits {holds} tokens, "
            f"or raise rollout.cpu_kv_cache_gb to {need * per_token / 2**30:.3f} or more")
