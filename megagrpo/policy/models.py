"""What both policies build on: the tokenizer, the DeepSpeed settings filled in from ours,
the HF model with its log-prob head, and `deepspeed.initialize` with AdamW and the schedule.

Weights always come from `from_pretrained`, with DeepSpeed's config registered through
`HfDeepSpeedConfig` under ZeRO-3, so parameters are partitioned as they load and keep their
real values (a model built by hand inside `zero.Init` would skip transformers' init).
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Optional

import deepspeed
import torch
from transformers import AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig

from megagrpo.cluster.op_builds import say_if_cpu_adam_builds
from megagrpo.config.deepspeed_json import read_deepspeed_config
from megagrpo.config.schema import Config
from megagrpo.dtypes import DTYPES
from megagrpo.multimodal.models import auto_model_class, in_vision_tower
from megagrpo.policy.expert_parallel import deepspeed_section
from megagrpo.policy.logprobs import install_logprob_head
from megagrpo.policy.sequence_parallel import SequenceParallel, use_ulysses_attention
from megagrpo.policy.tiled_mlp import tile_mlps


def load_tokenizer(path: str):
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@dataclass
class DeepSpeedSettings:
    """The DeepSpeed config for this run, resolved once from the user's JSON and ours (batch
    sizes, precision, clipping, tensor parallelism); the policy carries it and every builder
    asks it, rather than reading the `deepspeed` setting again."""
    config: dict

    @classmethod
    def from_config(cls, cfg: Config) -> "DeepSpeedSettings":
        ds = read_deepspeed_config(cfg.deepspeed)
        g = cfg.grpo
        ds["train_micro_batch_size_per_gpu"] = g.per_device_train_batch_size
        ds["gradient_accumulation_steps"] = g.gradient_accumulation_steps
        ds.pop("train_batch_size", None)  # DeepSpeed derives it (micro x accumulation x dp)
        ds["gradient_clipping"] = g.max_grad_norm
        ds["bf16"] = {"enabled": cfg.model.dtype == "bfloat16"}
        ds.pop("fp16", None)
        ds.setdefault("zero_optimization", {"stage": 0})
        if cfg.parallel.expert_parallel_size > 1:
            # AutoEP replaces the experts inside deepspeed.initialize, after a client optimizer
            # would have taken the old ones (ZeRO 1-2 then find no expert group): DeepSpeed builds
            # torch's AdamW itself, on the new parameters
            ds.setdefault("optimizer", {"type": "AdamW", "params": {"torch_adam": True}})
        if "optimizer" in ds:
            ds["optimizer"].setdefault("params", {}).update(
                lr=g.learning_rate, betas=[g.adam_beta1, g.adam_beta2], weight_decay=g.weight_decay)
        if cfg.parallel.tensor_parallel_size > 1:
            ds["tensor_parallel"] = {**ds.get("tensor_parallel", {}),
                                     "autotp_size": cfg.parallel.tensor_parallel_size}
        if cfg.parallel.expert_parallel_size > 1:  # DeepSpeed's AutoEP (policy/expert_parallel.py)
            from transformers import AutoConfig

            model_type = AutoConfig.from_pretrained(cfg.model.name_or_path).model_type
            ds["expert_parallel"] = deepspeed_section(model_type, cfg.parallel.expert_parallel_size)
        ds.setdefault("steps_per_print", 10**9)
        ds.setdefault("wall_clock_breakdown", False)
        return cls(ds)

    @property
    def zero_stage(self) -> int:
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    @property
    def tensor_parallel(self) -> bool:
        """Whether AutoTP shards the model (`tensor_parallel` in the config)."""
        return "tensor_parallel" in self.config

    @property
    def partitions_while_loading(self) -> bool:
        """ZeRO-3 partitions parameters as they load; transformers refuses that path with
        AutoTP, so with tensor parallelism the model loads whole and deepspeed.initialize
        shards it (more host memory at start-up)."""
        return self.zero_stage == 3 and not self.tensor_parallel

    def for_frozen_model(self, zero3: bool = False, offload: bool = False) -> "DeepSpeedSettings":
        """The batch, precision and pipeline keys, for a frozen model's engine (no optimizer);
        zero3: partitioned and sharded like the policy (AutoTP kept), offload: its
        parameters on the CPU."""
        keys = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16", "steps_per_print", "pipeline",
                "expert_parallel")
        ds = {k: self.config[k] for k in keys if k in self.config}
        if zero3:
            ds["zero_optimization"] = {"stage": 3}
            if offload:
                ds["zero_optimization"]["offload_param"] = {"device": "cpu"}
            if self.tensor_parallel:
                ds["tensor_parallel"] = self.config["tensor_parallel"]
        return DeepSpeedSettings(ds)


def lr_lambda(cfg: Config, total_steps: int):
    """Linear warmup, then constant or cosine decay to 0 at the last step. The scheduler moves
    once per optimizer step: num_iterations per training step."""
    per_step = cfg.grpo.num_iterations
    warmup, kind = cfg.grpo.warmup_steps * per_step, cfg.grpo.lr_scheduler_type
    total_steps = total_steps * per_step

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


def attention_implementation() -> str:
    """flash-attn (varlen kernels for packed rows) where CUDA and the package exist, else SDPA.
    flash_attn is only looked up, never imported here: it is CUDA-only."""
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def vision_tower_parameters(model: torch.nn.Module) -> list:
    """A VLM's image-encoder parameters (not the connector that projects into the LM); [] for a
    text model."""
    return [p for name, p in model.named_parameters() if in_vision_tower(name)]


def load_model(cfg: Config, deepspeed_settings: DeepSpeedSettings, sp: Optional[SequenceParallel] = None):
    """The HF model from its folder, with the log-prob head installed (partitioned as it loads
    where the settings say so); sp: its attention made Ulysses over the sp group; with
    model.tiled_mlp its MLPs tiled (tiled_mlp.py)."""
    ds_config = deepspeed_settings.config
    dschf = HfDeepSpeedConfig(ds_config) if deepspeed_settings.partitions_while_loading else None  # noqa: F841
    model = auto_model_class(cfg.model.name_or_path).from_pretrained(
        cfg.model.name_or_path, dtype=DTYPES[cfg.model.dtype], attn_implementation=attention_implementation())
    if cfg.model.freeze_vision_tower:
        for param in vision_tower_parameters(model):
            param.requires_grad_(False)
    install_logprob_head(model, cfg.grpo.logprob_chunk_size)
    if sp is not None:
        use_ulysses_attention(model, sp)
    if cfg.model.tiled_mlp:
        tile_mlps(model)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if deepspeed_settings.tensor_parallel and not tied:
        # AutoTP follows the HF tp_plan, whose "lm_head": "colwise_gather_output" would replace
        # an untied head (a tied one DeepSpeed keeps whole) by a vocabulary-split layer, and
        # the fused log-prob head with it. The head stays replicated: this instance's plan
        # marks it with the one style DeepSpeed leaves whole without summing its gradient over
        # the tp group (the gradient is already the same on every tp rank). Not for a tied
        # head: there the style asks DeepSpeed to split embedding and head over the vocabulary.
        model._tp_plan = {**(model.__dict__.get("_tp_plan") or {}), "lm_head": "embedding_rowwise"}
    return model


def initialize(model: torch.nn.Module, cfg: Config, deepspeed_settings: DeepSpeedSettings, total_steps: int,
               mpu=None):
    """deepspeed.initialize for training: AdamW (DeepSpeed's when the JSON names an optimizer),
    linear warmup and the configured schedule; mpu: the sp groups (Topology.deepspeed_mpu)."""
    ds_config = deepspeed_settings.config
    if torch.distributed.get_rank() == 0:
        say_if_cpu_adam_builds(ds_config, lambda message: print(f"[megagrpo] {message}", flush=True))
    trained = [p for p in model.parameters() if p.requires_grad]  # a LoRA policy: its adapters only
    optimizer = None
    if "optimizer" not in ds_config:
        optimizer = torch.optim.AdamW(trained, lr=cfg.grpo.learning_rate,
                                      betas=(cfg.grpo.adam_beta1, cfg.grpo.adam_beta2),
                                      weight_decay=cfg.grpo.weight_decay)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=trained, optimizer=optimizer, config=ds_config, mpu=mpu,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total_steps)))
    return engine
