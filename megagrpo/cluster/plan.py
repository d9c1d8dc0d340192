"""The layout of a run, before anything starts: which rank holds which shard, and the bytes of
model state (parameters, gradients, optimizer) each rank will hold.

    megagrpo plan --config X.yaml --world-size 16 [key.sub=value ...]
    python -m megagrpo.train --dry-run --config X.yaml ...   (world size from the launcher)

The model is built on the meta device (no memory, no weights read) to count its parameters.
AutoTP splits the 2-D weights of the decoder layers over the tp ranks; embeddings, norms and
the LM head are replicated. A pipeline holds one stage per tp group, partitioned by parameters
as DeepSpeed does it (the largest stage is reported; a tied head keeps a copy of the embedding
on the last stage), its decoder layers split over the stage's tp ranks. Bytes per parameter as
DeepSpeed's ZeRO optimizers hold them:
4 (weights) + 4 (gradients) + 12 (a float32 master copy and the two Adam moments) in float32
training, which bench/parallel_memory.py measures within 1% per rank; 2 + 2 + 12 in bfloat16.
ZeRO stage 1 splits the optimizer state over the dp ranks, stage 2 the gradients too, stage 3
the weights too. Gradients are counted as held during the backward: between steps ZeRO 1 and 2
free them, so the model state measured at rest there is lower by the gradient bytes
(bench/parallel_memory.py shows both stages). The frozen reference model (when kl_coef > 0)
holds weights only; the vLLM engine holds one whole copy of the weights plus its
KV cache.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from megagrpo.cluster.topology import Topology
from megagrpo.config.deepspeed_json import zero_stage
from megagrpo.config.schema import Config, require

BYTES = {"float32": (4, 4, 12), "bfloat16": (2, 2, 12)}


@dataclass
class Plan:
    world_size: int
    dp: int
    tp: int
    pp: int
    zero_stage: int
    params_total: int
    params_sharded: int          # split by tensor parallelism
    per_rank: dict               # bytes: params, grads, optimizer, reference, rollout_weights
    ranks: list                  # (rank, dp_rank, tp_rank, pp_stage)


def count_parameters(model_path: str) -> tuple[int, int]:
    """(all parameters, those AutoTP splits) from the model's config, on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sharded = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if ".layers." in name and param.dim() == 2:
            sharded += param.numel()
    return total, sharded


def make_plan(cfg: Config, world_size: int) -> Plan:
    tp, pp = cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size
    dp = world_size // (tp * pp)
    stage = zero_stage(cfg.deepspeed)
    total, sharded = count_parameters(cfg.model.name_or_path)
    local = sharded // tp + (total - sharded)  # one rank's share before ZeRO
    if pp > 1:  # the largest stage (DeepSpeed's partition by parameters)
        from megagrpo.engines.pipeline_module import ModelParts
        local = max(ModelParts(cfg.model.name_or_path, torch.float32, "sdpa").stage_parameters(pp, tp))
    weight_b, grad_b, optim_b = BYTES[cfg.model.dtype]
    per_rank = {
        "params": local * weight_b // (dp if stage >= 3 else 1),
        "grads": local * grad_b // (dp if stage >= 2 else 1),
        "optimizer": local * optim_b // (dp if stage >= 1 else 1),
        "reference": (local * weight_b // (dp if stage >= 3 else 1)) if cfg.grpo.kl_coef > 0 else 0,
        "rollout_weights": total * weight_b,
    }
    layout = Topology(world_size, 0, 0, tp, pp)
    ranks = [(r, place.dp_rank, place.tp_rank, place.pp_rank) for r in range(world_size)
             for place in [layout.at(r)]]
    return Plan(world_size, dp, tp, pp, stage, total, sharded, per_rank, ranks)


PIPELINE_ARCHITECTURES = ("llama", "qwen2", "mistral")


def check_layout(cfg: Config) -> None:
    """Layouts DeepSpeed or the model cannot run are refused here, before anything is built."""
    tp, pp = cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size
    require(tp >= 1, f"parallel.tensor_parallel_size: {tp} must be >= 1")
    require(pp >= 1, f"parallel.pipeline_parallel_size: {pp} must be >= 1")
    if pp > 1:
        stage = zero_stage(cfg.deepspeed)
        require(stage <= 1, f"parallel.pipeline_parallel_size={pp} with ZeRO stage {stage}: DeepSpeed "
                "runs pipelines with ZeRO stage 0 or 1 only; use configs/ds_zero0.json or a "
                "stage-1 config, or pipeline_parallel_size=1")
    world = os.environ.get("WORLD_SIZE")
    if world is not None:
        require(int(world) % (tp * pp) == 0,
                f"world size {world} is not divisible by tensor_parallel_size x "
                f"pipeline_parallel_size = {tp} x {pp}; launch a multiple of {tp * pp} ranks")
    model_config = os.path.join(cfg.model.name_or_path, "config.json")
    if (tp > 1 or pp > 1) and os.path.isfile(model_config):
        with open(model_config) as f:
            model = json.load(f)
        heads = model.get("num_attention_heads")
        kv_heads = model.get("num_key_value_heads", heads)
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


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def format_plan(plan: Plan, max_rows: int = 16) -> str:
    lines = [f"world {plan.world_size} = dp {plan.dp} x tp {plan.tp} x pp {plan.pp}; "
             f"ZeRO stage {plan.zero_stage}",
             f"model: {plan.params_total / 1e6:.2f}M parameters, {plan.params_sharded / 1e6:.2f}M "
             f"split by tensor parallelism",
             "", f"{'rank':>5} {'dp rank':>8} {'tp shard':>9} {'pp stage':>9}"]
    for rank, dp_rank, tp_rank, stage in plan.ranks[:max_rows]:
        lines.append(f"{rank:>5} {dp_rank:>8} {f'{tp_rank + 1}/{plan.tp}':>9} {stage:>9}")
    if len(plan.ranks) > max_rows:
        lines.append(f"  ... {len(plan.ranks) - max_rows} more ranks, same pattern")
    lines += ["", "model state per rank:"]
    for key, value in plan.per_rank.items():
        lines.append(f"  {key:<16}{_gib(value):>14}")
    training = sum(plan.per_rank[k] for k in ("params", "grads", "optimizer"))
    lines.append(f"  {'trainer total':<16}{_gib(training):>14}  (params + grads + optimizer)")
    return "\n".join(lines)
